"""The incremental merge (``runner.core.live_merge``, ``runner.core.distributed.merge`` / ``live_merge``): the
workers' journals folded in as they grow, each step reading only the bytes appended since the last one, the final
merge reading only what no step read and writing the same ``items.jsonl`` and folder index a one-shot merge writes;
a line still being written waits, a rewritten journal is read again, a step killed half-way is recovered from; the
live ``manifest.json`` (status ``running``, totals, pool) that ``runner.report`` shows; the pool's console lines.

Real processes, signals and the report on a live claims run: tests/test_claims.py. Sizes and timing of the merge at
100k items and 256 workers: ``benchmarks/fleet_cpu.py``."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List

import filelock
import pytest

from runner.app.console import pool_postfix, pool_summary
from runner.core import distributed as dist
from runner.core import rundir
from runner.core.live_merge import JournalMerge
from runner.core.sinks import read_journal

pytestmark = pytest.mark.cpu

KEYS = [f"k{i:02d}" for i in range(12)]


def ok(key: str, **kw: Any) -> Dict[str, Any]:
    return {"key": key, "id": key, "status": "ok", "file": f"images/{key}.png", "prompt": f"p {key}", "seed": 1,
            "inputs_sha256": f"in-{key}", "tokens": {"t5": {"dropped": 1 if key.endswith("3") else 0}}, **kw}


def failed(key: str) -> Dict[str, Any]:
    return {"key": key, "id": key, "status": "failed", "file": None, "reason": "nan"}


def _append(d: Path, rank: int, records: List[Dict[str, Any]], tail: bytes = b"") -> int:
    data = b"".join((json.dumps(r) + "\n").encode() for r in records) + tail
    with open(d / f"items.rank{rank}.jsonl", "ab") as f:
        f.write(data)
    return len(data)


def _manifest(d: Path, rank: int, status: str = "completed", token: str = "t", **extra: Any) -> None:
    doc = {"run_id": "run-1", "status": status, "config": {"model": {"name": "toy"}}, "owner": {"token": token},
           "worker": {"rank": rank, "host": "h", "pid": 100 + rank}, "counts": {"ok": 0, "failed": 0, "reused": 0},
           "identity": {"sha256": "id"}, "prompts": {"items": 0}, **extra}
    (d / f"manifest.rank{rank}.json").write_text(json.dumps(doc))


def _layout(d: Path) -> None:
    (d / "images").mkdir(parents=True, exist_ok=True)
    for r in range(2):
        _manifest(d, r)


def _one_shot(src: Path, tmp: Path) -> Path:
    """The same journals merged by one merge with no state (what the merge did before it was incremental)."""
    d = tmp / "oneshot"
    (d / "images").mkdir(parents=True)
    for p in src.glob("*.rank*.json*"):
        shutil.copy(p, d / p.name)
    dist.merge(d, 2, KEYS, "torchrun")
    return d


def test_steps_read_only_appended_bytes_and_the_final_merge_only_the_rest(tmp_path):
    d = tmp_path / "run"
    _layout(d)
    token = "tok1"
    jm = JournalMerge(d, KEYS, token)
    base = json.loads((d / "manifest.rank0.json").read_text())  # the state's run_id and model, as the workers pass
    first = _append(d, 0, [ok(k) for k in KEYS[0:3]]) + _append(d, 1, [ok(k) for k in KEYS[3:5]])
    st = jm.step(base=base)
    assert jm.counters.bytes_read == first and jm.counters.records_parsed == 5
    assert st["counts"] == {"ok": 5, "failed": 0}
    assert jm.step()["counts"] == {"ok": 5, "failed": 0} and jm.counters.bytes_read == first  # nothing new: no read
    second = _append(d, 1, [ok(k) for k in KEYS[5:8]] + [failed(KEYS[8])])
    jm.step()
    assert jm.counters.bytes_read == first + second and jm.counters.records_parsed == 9
    last = _append(d, 0, [ok(k) for k in KEYS[9:]] + [ok(KEYS[8])])  # the failed item done again: ok wins
    other = JournalMerge(d, KEYS, token)  # the final merge, in another process: the state is on disk
    m = dist.merge(d, 2, KEYS, "torchrun", live=other)
    assert m["merge"]["final"]["bytes_read"] == last  # only the bytes no step had read
    assert m["merge"]["final"]["records_parsed"] == 4 and m["merge"]["final"]["rereads"] == 0
    assert m["merge"]["journal_bytes"] == first + second + last and m["merge"]["steps"] == 4
    assert m["counts"] == {"ok": 12, "failed": 0, "reused": 0, "items": 12, "missing": 0}
    assert m["prompts"]["truncated_items"] == 1 and m["prompts"]["items"] == 12
    assert not (d / "merge").exists()  # the state goes with the final merge
    ref = _one_shot(d, tmp_path)
    for name in ("items.jsonl", "images/metadata.jsonl"):  # byte for byte what a one-shot merge writes
        assert (d / name).read_bytes() == (ref / name).read_bytes(), name
    assert [r["key"] for r in read_journal(d / "items.jsonl")] == KEYS


def test_a_line_still_being_written_waits_for_the_next_step(tmp_path):
    d = tmp_path / "run"
    _layout(d)
    jm = JournalMerge(d, KEYS, "t")
    line = (json.dumps(ok(KEYS[1])) + "\n").encode()
    n = _append(d, 0, [ok(KEYS[0])], tail=line[:10])
    assert jm.step()["counts"]["ok"] == 1
    with open(d / "items.rank0.jsonl", "ab") as f:
        f.write(line[10:])
    st = jm.step()
    assert st["counts"]["ok"] == 2 and st["journals"]["items.rank0.jsonl"]["offset"] == n + len(line) - 10
    assert jm.counters.records_parsed == 2  # the torn half was never parsed


def test_records_of_an_earlier_config_and_of_other_keys_are_left_out(tmp_path):
    d = tmp_path / "run"
    _layout(d)
    jm = JournalMerge(d, KEYS, "t")
    _append(d, 0, [ok(KEYS[0]), ok(KEYS[1], inputs_sha256="stale"), ok("not-an-item")])
    st = jm.step(valid={k: [f"in-{k}"] for k in KEYS})
    assert st["counts"] == {"ok": 1, "failed": 0}


def test_a_rewritten_journal_is_read_again_and_its_records_supersede_their_earlier_versions(tmp_path):
    d = tmp_path / "run"
    _layout(d)
    jm = JournalMerge(d, KEYS, "t")
    _append(d, 0, [ok(KEYS[0]), ok(KEYS[1])])
    _append(d, 1, [ok(KEYS[2])])
    jm.step()
    p = d / "items.rank0.jsonl"  # the metrics scoring rewrites a journal (a new file renamed over it)
    tmp = d / "x.tmp"
    tmp.write_text("".join(json.dumps(ok(k, metrics={"clip": 0.5})) + "\n" for k in KEYS[:2]))
    tmp.replace(p)
    m = dist.merge(d, 2, KEYS, "torchrun", live=jm)
    assert m["merge"]["final"]["rereads"] == 1
    recs = {r["key"]: r for r in read_journal(d / "items.jsonl")}
    assert recs[KEYS[0]]["metrics"] == {"clip": 0.5} and recs[KEYS[1]]["metrics"] == {"clip": 0.5}
    assert m["counts"]["ok"] == 3 and m["prompts"]["items"] == 3  # superseded, not counted twice


def test_an_ok_record_of_another_journal_does_not_replace_the_first(tmp_path):
    """A batch taken over from a worker whose lease lapsed is finished by both: the first ok record stays."""
    d = tmp_path / "run"
    _layout(d)
    jm = JournalMerge(d, KEYS, "t")
    _append(d, 0, [ok(KEYS[0], by=0)])
    jm.step()
    _append(d, 1, [ok(KEYS[0], by=1), failed(KEYS[1])])
    _append(d, 0, [ok(KEYS[1], by=0), failed(KEYS[2])])
    _append(d, 1, [failed(KEYS[2])])
    st = jm.step()
    assert st["counts"] == {"ok": 2, "failed": 1}
    jm.write_outputs()
    recs = {r["key"]: r for r in read_journal(d / "items.jsonl")}
    assert recs[KEYS[0]]["by"] == 0 and recs[KEYS[1]]["status"] == "ok" and recs[KEYS[2]]["status"] == "failed"


def test_a_step_killed_half_way_is_recovered_from(tmp_path):
    d = tmp_path / "run"
    _layout(d)
    jm = JournalMerge(d, KEYS, "t")
    _append(d, 0, [ok(k) for k in KEYS[:4]])
    jm.step()
    with open(d / "merge" / "t" / "records.jsonl", "ab") as f:  # appended, then killed before state.json
        f.write(b'{"key": "k05", "status": "ok"}\n')
    _append(d, 1, [ok(k) for k in KEYS[4:6]])
    st = JournalMerge(d, KEYS, "t").step()
    assert st["recoveries"] == 1 and st["counts"] == {"ok": 6, "failed": 0}


def _hold(path: str, q: "mp.Queue", go: "mp.Event") -> None:
    with filelock.FileLock(path):
        q.put("held")
        go.wait(60)


def test_a_worker_does_not_wait_for_a_step_another_process_runs(tmp_path):
    d = tmp_path / "run"
    _layout(d)
    jm = JournalMerge(d, KEYS, "t")
    _append(d, 0, [ok(KEYS[0])])
    jm.step()
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_hold, args=(str(d / "merge" / "t" / "merge.lock"), q, go))
    p.start()
    try:
        assert q.get(timeout=60) == "held"
        assert jm.step(block=False) is None and jm.counters.busy == 1
    finally:
        go.set()
        p.join(60)
    assert jm.step(block=False)["counts"]["ok"] == 1


def test_the_live_manifest_is_running_with_the_totals_and_the_report_shows_it(tmp_path):
    from runner.tools.report import _details, load_jobs, main

    d = tmp_path / "run"
    lock = rundir.acquire(d)  # the run is alive: its owner holds the dir
    try:
        (d / "images").mkdir()
        now = time.time()
        _manifest(d, 0, status="running", token=lock.token, progress={"done": 4, "since": now - 4, "at": now})
        _manifest(d, 1, status="running", token=lock.token, progress={"done": 1, "since": now - 4, "at": now})
        _manifest(d, 2, status="running", token=lock.token, progress={"done": 4, "since": now - 4, "at": now})
        _append(d, 0, [ok(k) for k in KEYS[:4]])
        _append(d, 1, [ok(KEYS[4])])
        _append(d, 2, [ok(k) for k in KEYS[5:9]])
        jm = JournalMerge(d, KEYS, lock.token)
        m = dist.live_merge(d, jm, 3, "torchrun")
        assert m["status"] == "running" and json.loads((d / "manifest.json").read_text())["status"] == "running"
        assert m["counts"] == {"ok": 9, "failed": 0, "reused": 0, "items": 12, "missing": 3}
        assert m["evidence"]["verdict"] == "pending" and m["evidence"]["pending"] == [0, 1, 2]
        assert [w["status"] for w in m["workers"]] == ["running"] * 3 and m["failed_workers"] == []
        assert m["pool"]["done"] == 9 and m["pool"]["slow"] == [1]  # 0.25 items/s against a median of 1
        job = load_jobs([d])[0]
        assert job.outcome == "running" and job.manifest["counts"]["ok"] == 9
        html = _details(job)
        assert "pool: 9 of 12 items done" in html and "slow: rank 1" in html
        assert main([str(d), "--out", str(tmp_path / "report.html")]) == 0  # the CLI on the live run
        page = (tmp_path / "report.html").read_text()
        assert "running" in page and "pool: 9 of 12 items done" in page
        assert not (d / "items.jsonl").exists()  # written once, by the final merge
    finally:
        rundir.release(lock)


def test_pool_summary_names_the_dead_and_the_slow():
    pool = dist.pool_section(
        [{"progress": {"done": 10, "since": 0.0, "at": 10.0}, "worker": {"pid": 7}, "status": "completed"},
         {"progress": {"done": 2, "since": 0.0, "at": 4.0}, "worker": {"pid": 8}, "status": "crashed"},
         {"progress": {"done": 12, "since": 0.0, "at": 10.0}, "worker": {"pid": 9}, "status": "completed"},
         {"progress": {"done": 3, "since": 0.0, "at": 10.0}, "worker": {"pid": 10}, "status": "completed"}],
        {"ok": 25, "failed": 1, "reused": 2, "items": 28},
        {"claimed": 27, "taken_over": [{"batch": "b0000004"}],
         "deaths": [{"rank": 1, "pid": 8, "lost_batches": ["b0000004"]}]}, now=10.0)
    line = pool_summary(pool)
    assert line.startswith("pool: 28 of 28 items done (25 ok, 1 failed, 2 reused); 27 batches claimed, 1 retried")
    assert "rank 0 10 (1)" in line and "rank 1 2 (0.5, dead)" in line and "rank 3 3 (0.3)" in line
    assert "dead: rank 1 (pid 8, lost b0000004)" in line
    assert "slow: rank 3 (0.3 items/s, median 1)" in line  # the dead one is not also slow
    assert pool_postfix(pool) == "4 workers, 27 claimed, 1 retried, dead: 1, slow: 3"
