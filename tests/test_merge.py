"""Data-parallel sharding and the merge of the workers' journals and manifests (``runner.core.distributed``), as units:
run dirs laid out the way the workers leave them (``items.rank<r>.jsonl``, ``manifest.rank<r>.json``, images), then
the merged ``items.jsonl``, ``manifest.json`` (status, counts, workers, evidence, timing) and the exit code.

Real multi-process runs (torchrun, Ray) are in test_scale.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from runner.core import distributed as dist
from runner.core.sinks import read_journal

pytestmark = pytest.mark.cpu

KEYS = ["a", "b", "c", "d", "e"]


# ------------------------------------------------------------------------------------------------- shard


def _batches(sizes: List[int]) -> List[List[str]]:
    out, n = [], 0
    for s in sizes:
        out.append([f"i{n + k}" for k in range(s)])
        n += s
    return out


def test_shard_deals_whole_batches_to_the_least_loaded_rank():
    batches = _batches([2, 2, 1, 2, 2])  # i0..i8
    assert dist.shard(batches, 2, 0) == ["i0", "i1", "i4", "i7", "i8"]  # batches 0, 2 (tie 2/2 -> rank 0), 4
    assert dist.shard(batches, 2, 1) == ["i2", "i3", "i5", "i6"]


def test_shard_ties_go_to_the_lowest_rank():
    batches = _batches([1, 1, 1, 1, 1])
    assert [dist.shard(batches, 3, r) for r in range(3)] == [["i0", "i3"], ["i1", "i4"], ["i2"]]


def test_shard_covers_every_item_once_and_balances():
    batches = _batches([4, 4, 3, 4, 1, 4, 2, 4, 4])
    shards = [dist.shard(batches, 4, r) for r in range(4)]
    assert sorted(sum(shards, [])) == sorted(sum(batches, []))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 4
    for s in shards:  # whole batches, in order: re-batching gives the same batches back
        for b in batches:
            assert set(b) <= set(s) or not set(b) & set(s)


def test_shard_one_rank_and_more_ranks_than_batches():
    batches = _batches([2, 3])
    assert dist.shard(batches, 1, 0) == ["i0", "i1", "i2", "i3", "i4"]
    assert dist.shard(batches, 3, 2) == []
    assert dist.shard([], 2, 0) == []


# ------------------------------------------------------------------------------------------------- merge


def _worker(d: Path, rank: int, records: List[Dict[str, Any]], status: str = "completed",
            verdict: Optional[str] = "verified", mismatches: Optional[List[str]] = None, loop_s: Optional[float] = 10.0,
            wall_s: Optional[float] = 12.0, reused: int = 0, resumed: Optional[str] = None, **extra: Any) -> None:
    (d / "images").mkdir(parents=True, exist_ok=True)
    for r in records:
        if r.get("status") == "ok":
            (d / r["file"]).write_bytes(r["key"].encode())
    (d / f"items.rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ok = sum(1 for r in records if r.get("status") == "ok")
    doc: Dict[str, Any] = {
        "run_id": "run-1", "status": status, "config": {"model": {"name": "tiny_flux"}},
        "dataset": {"sha256": "d" * 64, "items": len(records)},
        "worker": {"rank": rank, "host": f"host{rank}", "shard_items": len(records)},
        "platform": {"device": f"cpu:{rank}", "probes": {"device_name": "CPU"}},
        "counts": {"ok": ok, "failed": len(records) - ok, "reused": reused},
        "timing": {"wall_s": wall_s, "load_s": 1.0, "warmup_s": 0.5, "loop_s": loop_s, "images_per_hour": 1.0},
        "memory": {"peak_mb": 10 + rank},
        "identity": {"sha256": f"id{rank}"},
    }
    if verdict is not None:
        doc["evidence"] = {"pid": 100 + rank, "verdict": verdict, "mismatches": mismatches or []}
    if resumed is not None:
        doc["resumed_from"] = {"status": resumed}
    doc.update(extra)
    (d / f"manifest.rank{rank}.json").write_text(json.dumps(doc))


def ok(key: str, **kw: Any) -> Dict[str, Any]:
    return {"key": key, "id": key, "status": "ok", "file": f"images/{key}.png", "prompt": f"p {key}", "seed": 1,
            "inputs_sha256": f"in-{key}", **kw}


def failed(key: str) -> Dict[str, Any]:
    return {"key": key, "id": key, "status": "failed", "file": None, "reason": "nan"}


def _two_workers(d: Path, **kw1: Any) -> None:
    _worker(d, 0, [ok("a"), ok("c"), ok("e")])
    _worker(d, 1, kw1.pop("records", [ok("b"), ok("d")]), **kw1)


def test_two_completed_workers_merge_in_dataset_order(tmp_path):
    _two_workers(tmp_path)
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert [r["key"] for r in read_journal(tmp_path / "items.jsonl")] == KEYS
    assert m["status"] == "completed" and dist.merged_exit_code(m) == 0
    assert m["failed_workers"] == []
    assert m["counts"] == {"ok": 5, "failed": 0, "reused": 0, "items": 5, "missing": 0}
    assert m["dataset"] == {"sha256": "d" * 64, "items": 5}  # the run's items, not rank 0's shard
    assert m["parallelism"] == {"mode": "data", "world_size": 2, "launcher": "torchrun", "sharding": dist.SHARDING}
    assert "worker" not in m and m["run_id"] == "run-1"
    assert m["workers"][1] == {
        "rank": 1, "run_id": "run-1", "host": "host1", "device": "cpu:1", "device_name": "CPU", "pid": 101,
        "shard_items": 2,
        "status": "completed", "counts": {"ok": 2, "failed": 0, "reused": 0}, "evidence_verdict": "verified",
        "resumed_from": None,
        "timing": {"wall_s": 12.0, "load_s": 1.0, "warmup_s": 0.5, "loop_s": 10.0, "images_per_hour": 1.0},
        "memory": {"peak_mb": 11}}
    assert m["evidence"]["verdict"] == "verified" and m["evidence"]["mismatches"] == []
    assert set(m["evidence"]["workers"]) == {"0", "1"}
    assert json.loads((tmp_path / "manifest.json").read_text()) == m
    meta = read_journal(tmp_path / "images" / "metadata.jsonl")
    assert [r["file_name"] for r in meta] == [f"{k}.png" for k in KEYS]
    assert {r["model"] for r in meta} == {"tiny_flux"} and {r["run_id"] for r in meta} == {"run-1"}


def test_timing_is_the_slowest_workers_loop(tmp_path):
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("e")], loop_s=30.0, wall_s=40.0)
    _worker(tmp_path, 1, [ok("b"), ok("d")], loop_s=60.0, wall_s=35.0)
    m = dist.merge(tmp_path, 2, KEYS, "ray")
    assert m["timing"] == {"loop_s": 60.0, "wall_s": 40.0, "images_per_hour": 300.0, "per_worker": "workers[].timing"}


def test_timing_without_loops(tmp_path):
    _worker(tmp_path, 0, [ok(k) for k in KEYS], loop_s=None, wall_s=None)
    m = dist.merge(tmp_path, 1, KEYS, "torchrun")
    assert m["timing"]["loop_s"] is None and m["timing"]["wall_s"] is None and m["timing"]["images_per_hour"] is None


def test_a_worker_without_manifest(tmp_path):
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("e")])
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["workers"][1] == {"rank": 1, "status": "missing", "reason": "no manifest.rank1.json: the worker died "
                                                                   "before its run started, or never started"}
    assert m["status"] == "incomplete" and m["failed_workers"] == [1]
    assert m["counts"]["missing"] == 2 and m["counts"]["ok"] == 3
    assert m["evidence"]["verdict"] == "mismatch" and m["evidence"]["mismatches"] == ["rank 1: no manifest"]
    assert [r["key"] for r in read_journal(tmp_path / "items.jsonl")] == ["a", "c", "e"]
    assert dist.merged_exit_code(m) == 1


def test_a_worker_that_died_running_is_crashed(tmp_path):
    _two_workers(tmp_path, status="running", resumed="running")
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["workers"][1]["status"] == "crashed" and m["workers"][1]["resumed_from"] == "crashed"
    assert m["status"] == "incomplete" and m["failed_workers"] == [1]


def test_a_dead_workers_manifest_is_closed_and_it_is_named_with_its_pid_and_reason(tmp_path):
    """Issue 29 (a dead worker leaves stale state): rank 1 killed mid-run (its manifest at ``running``, no evidence
    section, so no pid there) and Ray's account of it. The merge names it with the pid its ``worker`` section holds
    and a reason, rewrites ``manifest.rank1.json`` as ``crashed`` (no rank manifest says running once the run has
    ended), leaves a completed rank's manifest as it was, and the job outcome names the dead worker, not items."""
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("e")])
    _worker(tmp_path, 1, [ok("b")], status="running", verdict=None,
            worker={"rank": 1, "host": "host1", "shard_items": 2, "pid": 4242})
    rank0 = (tmp_path / "manifest.rank0.json").read_text()
    m = dist.merge(tmp_path, 2, KEYS, "ray", reasons={1: "ray: WorkerCrashedError: The worker died unexpectedly"})
    w1 = m["workers"][1]
    assert w1["status"] == "crashed" and w1["pid"] == 4242 and m["workers"][0]["pid"] == 100
    assert w1["reason"].startswith("ray: WorkerCrashedError: The worker died unexpectedly; its process ended "
                                   "without a final status")
    assert "manifest.rank1.json still said running" in w1["reason"]
    assert "reason" not in m["workers"][0]
    doc = json.loads((tmp_path / "manifest.rank1.json").read_text())
    assert doc["status"] == "crashed" and doc["ended_at"] and doc["crash"] == {"reason": w1["reason"],
                                                                              "detected_by": "merge"}
    assert doc["counts"] == {"ok": 1, "failed": 0, "reused": 0}  # the rest of what it recorded is kept
    assert (tmp_path / "manifest.rank0.json").read_text() == rank0
    outcome, error = dist.worker_failure(m)
    assert outcome == "crashed"
    assert error.startswith("1 of 2 data-parallel workers did not complete: rank 1 (pid 4242, host host1) "
                            "crashed: ray: WorkerCrashedError")
    assert "1 of 5 items were not written" in error and "fix: re-run the same command" in error
    again = dist.merge(tmp_path, 2, KEYS, "ray")  # a merge of the closed manifest: still crashed, same reason
    assert again["workers"][1]["status"] == "crashed" and again["workers"][1]["reason"] == "it ended crashed"


def test_worker_failure_outcomes():
    """Every worker completed: no worker failure (the items decide); a stopped one is ``interrupted``; one with
    no manifest ``crashed``."""
    done = {"rank": 0, "status": "completed_with_failures"}
    assert dist.worker_failure({"workers": [done, {"rank": 1, "status": "completed"}]}) is None
    assert dist.worker_failure({"workers": []}) is None
    stopped = {"workers": [done, {"rank": 1, "status": "interrupted", "reason": "it ended interrupted"}],
               "counts": {"missing": 2, "items": 5}}
    assert dist.worker_failure(stopped)[0] == "interrupted"
    assert "rank 1 (pid None, host None) interrupted: it ended interrupted" in dist.worker_failure(stopped)[1]
    gone = {"workers": [done, {"rank": 1, "status": "missing", "reason": "x"}], "counts": {}}
    assert dist.worker_failure(gone)[0] == "crashed"
    failed = {"workers": [{"rank": 0, "status": "failed"}], "counts": {}}
    assert dist.worker_failure(failed)[0] == "failed_items"


@pytest.mark.parametrize("status", ["interrupted", "failed", "storage_error"])
def test_a_worker_that_did_not_complete(tmp_path, status):
    _two_workers(tmp_path, status=status)
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["status"] == ("interrupted" if status == "interrupted" else "incomplete") and m["failed_workers"] == [1]
    assert m["workers"][1]["status"] == status
    assert m["workers"][1]["reason"] == f"it ended {status}"
    assert json.loads((tmp_path / "manifest.rank1.json").read_text())["status"] == status  # not rewritten


def test_failed_items_make_completed_with_failures(tmp_path):
    _two_workers(tmp_path, records=[ok("b"), failed("d")], status="completed_with_failures")
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["status"] == "completed_with_failures" and m["failed_workers"] == []
    assert m["counts"] == {"ok": 4, "failed": 1, "reused": 0, "items": 5, "missing": 0}
    assert dist.merged_exit_code(m) == 1
    assert [r["key"] for r in read_journal(tmp_path / "images" / "metadata.jsonl")] == ["a", "b", "c", "e"]


def test_missing_items_are_incomplete_even_when_every_worker_completed(tmp_path):
    _two_workers(tmp_path, records=[ok("b")])
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["status"] == "incomplete" and m["counts"]["missing"] == 1 and m["failed_workers"] == []
    _two_workers(tmp_path, records=[ok("b"), failed("d")], status="completed_with_failures")
    (tmp_path / "items.rank1.jsonl").write_text(json.dumps(ok("b")) + "\n")
    assert dist.merge(tmp_path, 2, KEYS, "torchrun")["status"] == "incomplete"


def test_an_ok_record_wins_over_a_failed_one_in_any_journal(tmp_path):
    _worker(tmp_path, 0, [ok("a"), failed("b"), ok("c"), ok("e")])
    _worker(tmp_path, 1, [ok("b"), ok("d"), failed("a")])
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    recs = read_journal(tmp_path / "items.jsonl")
    assert [r["status"] for r in recs] == ["ok"] * 5
    assert m["counts"]["failed"] == 0 and m["counts"]["ok"] == 5


def test_a_failed_record_counts_when_nothing_ok_exists(tmp_path):
    _worker(tmp_path, 0, [failed("a"), failed("a")])
    m = dist.merge(tmp_path, 1, ["a"], "torchrun")
    assert read_journal(tmp_path / "items.jsonl") == [failed("a")]
    assert m["counts"] == {"ok": 0, "failed": 1, "reused": 0, "items": 1, "missing": 0}


def test_records_of_an_earlier_config_are_left_out(tmp_path):
    _worker(tmp_path, 0, [ok("a"), ok("c", inputs_sha256="stale"), ok("e")])
    _worker(tmp_path, 1, [ok("b"), ok("d")])
    asked = []

    def current(shas: List[str]) -> Dict[str, List[str]]:
        asked.append(shas)
        return {k: [f"in-{k}"] for k in KEYS}

    m = dist.merge(tmp_path, 2, KEYS, "torchrun", current=current)
    assert asked == [["id0", "id1"]]
    assert [r["key"] for r in read_journal(tmp_path / "items.jsonl")] == ["a", "b", "d", "e"]
    assert m["counts"]["missing"] == 1 and m["status"] == "incomplete"


def test_failed_records_are_not_filtered_by_identity(tmp_path):
    _worker(tmp_path, 0, [failed("a")])
    dist.merge(tmp_path, 1, ["a"], "torchrun", current=lambda shas: {})
    assert read_journal(tmp_path / "items.jsonl") == [failed("a")]


def test_reused_items_are_counted_apart(tmp_path):
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("e")], reused=2)
    _worker(tmp_path, 1, [ok("b"), ok("d")], reused=1)
    assert dist.merge(tmp_path, 2, KEYS, "torchrun")["counts"] == {"ok": 2, "failed": 0, "reused": 3, "items": 5,
                                                                   "missing": 0}


def test_evidence_of_every_worker(tmp_path):
    _two_workers(tmp_path, verdict="mismatch", mismatches=["stage denoise: the denoiser ran 3 forwards, expected 4"])
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["evidence"]["verdict"] == "mismatch"
    assert m["evidence"]["mismatches"] == ["rank 1: stage denoise: the denoiser ran 3 forwards, expected 4"]
    assert m["workers"][1]["evidence_verdict"] == "mismatch"


def test_not_collected_evidence_is_not_a_mismatch(tmp_path):
    _two_workers(tmp_path, verdict="not_collected")
    assert dist.merge(tmp_path, 2, KEYS, "torchrun")["evidence"]["verdict"] == "verified"


def test_a_worker_without_evidence_is_a_mismatch(tmp_path):
    _two_workers(tmp_path, verdict=None)
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["evidence"]["verdict"] == "mismatch" and m["workers"][1]["pid"] is None
    assert m["evidence"]["workers"]["1"] is None


def test_prompts_summary_is_the_whole_runs(tmp_path):
    _worker(tmp_path, 0, [ok("a", tokens={"t5": {"dropped": 3}}), ok("c"), ok("e", ignored={"x": 1})],
            prompts={"truncated_items": 1, "note": "rank 0 only"})
    _worker(tmp_path, 1, [ok("b", tokens={"t5": {"dropped": 1}, "clip": {"dropped": 0}}), ok("d")])
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["prompts"] == {"truncated_items": 2, "note": "rank 0 only", "items": 5,
                            "truncated_by_encoder": {"t5": 2, "clip": 0}, "items_with_ignored_fields": 1}


def test_no_prompts_section_when_the_workers_have_none(tmp_path):
    _two_workers(tmp_path)
    assert "prompts" not in dist.merge(tmp_path, 2, KEYS, "torchrun")


def test_the_merge_records_the_lock_of_the_process_that_holds_the_dir(tmp_path):
    from runner.core import rundir

    _two_workers(tmp_path)
    lock = rundir.acquire(tmp_path)
    try:
        m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    finally:
        rundir.release(lock)
    assert m["lock"] == lock.record() and m["owner"] == lock.holder


def test_context_parallel_merge_counts_the_writers_only(tmp_path):
    lay = dist.Layout(mode="ulysses", data=2, ring=1, ulysses=2)  # ranks 0,1 | 2,3; writers 0 and 2
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("e")], loop_s=10.0, context_parallel={"ulysses_degree": 2})
    _worker(tmp_path, 1, [], loop_s=99.0)
    _worker(tmp_path, 2, [ok("b"), ok("d")], loop_s=20.0, reused=1)
    _worker(tmp_path, 3, [], loop_s=5.0, reused=7)
    m = dist.merge(tmp_path, 4, KEYS, "torchrun", lay=lay)
    assert m["counts"] == {"ok": 4, "failed": 0, "reused": 1, "items": 5, "missing": 0}
    assert m["timing"]["loop_s"] == 99.0
    assert m["timing"]["images_per_hour"] == round(3600 * 5 / 99.0, 1)  # ok images of the writing ranks
    par = m["parallelism"]
    assert (par["mode"], par["world_size"], par["data"], par["ulysses_degree"], par["ring_degree"],
            par["context_degree"]) == ("ulysses", 4, 2, 2, 1, 2)
    assert par["mesh"] == lay.section() and par["roles"] == [lay.role(r) for r in range(4)]
    assert par["context_parallel"] == {"0": {"ulysses_degree": 2}, "1": None, "2": None, "3": None}
    assert par["sharding"].startswith(dist.SHARDING.replace("rank", "data group"))
    assert "context_parallel" not in m
    assert m["status"] == "completed"


def test_worker_role_is_kept_in_the_workers_list(tmp_path):
    _worker(tmp_path, 0, [ok(k) for k in KEYS])
    doc = json.loads((tmp_path / "manifest.rank0.json").read_text())
    doc["worker"]["role"] = {"data_group": 0}
    (tmp_path / "manifest.rank0.json").write_text(json.dumps(doc))
    assert dist.merge(tmp_path, 1, KEYS, "torchrun")["workers"][0]["role"] == {"data_group": 0}


def test_merged_exit_code():
    assert dist.merged_exit_code({"status": "completed"}) == 0
    for status in ("completed_with_failures", "incomplete"):
        assert dist.merged_exit_code({"status": status, "failed_workers": [], "counts": {"missing": 0}}) == 1


def test_ended():
    assert dist._ended("running") == "crashed"
    assert dist._ended("completed") == "completed" and dist._ended(None) is None


# ---------------------------------------------------------------------------------- what a worker may lack


def _minimal(d: Path, rank: int, status: str = "crashed") -> None:
    """The manifest of a worker that died early: a status and little else."""
    (d / f"manifest.rank{rank}.json").write_text(json.dumps({"status": status}))


def test_a_worker_manifest_with_almost_nothing(tmp_path):
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("e")])
    _minimal(tmp_path, 1)
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["workers"][1] == {"rank": 1, "run_id": None, "host": None, "device": None, "device_name": None,
                               "pid": None, "shard_items": None, "status": "crashed", "counts": None, "evidence_verdict": None,
                               "resumed_from": None,
                               "timing": {"wall_s": None, "load_s": None, "warmup_s": None, "loop_s": None,
                                          "images_per_hour": None},
                               "memory": None, "reason": "it ended crashed"}
    assert m["status"] == "incomplete" and m["failed_workers"] == [1]
    assert m["timing"]["loop_s"] == 10.0 and m["timing"]["images_per_hour"] == 1080.0


def test_rank_0_minimal_as_the_base(tmp_path):
    _minimal(tmp_path, 0, "completed")
    _worker(tmp_path, 1, [ok(k) for k in KEYS])
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert "worker" not in m and m["dataset"] == {"items": 5} and m["status"] == "completed"


def test_rank_0_without_manifest_the_others_still_listed(tmp_path):
    _worker(tmp_path, 1, [ok(k) for k in KEYS])
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert [w["status"] for w in m["workers"]] == ["missing", "completed"]
    assert m["run_id"] == "run-1"  # the base is the first manifest there is


def test_no_manifest_at_all(tmp_path):
    (tmp_path / "images").mkdir()
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["status"] == "incomplete" and m["counts"]["missing"] == 5
    assert [{k: w[k] for k in ("rank", "status")} for w in m["workers"]] == [{"rank": 0, "status": "missing"},
                                                                             {"rank": 1, "status": "missing"}]
    assert all("no manifest.rank" in w["reason"] for w in m["workers"])
    assert m["evidence"]["mismatches"] == ["rank 0: no manifest", "rank 1: no manifest"]
    assert read_journal(tmp_path / "items.jsonl") == []


def test_counts_without_reused_or_ok(tmp_path):
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("e")])
    _worker(tmp_path, 1, [ok("b"), ok("d")])
    for r in (0, 1):
        p = tmp_path / f"manifest.rank{r}.json"
        doc = json.loads(p.read_text())
        doc["counts"] = {"failed": 0}
        p.write_text(json.dumps(doc))
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["counts"]["reused"] == 0 and m["counts"]["ok"] == 5
    assert m["timing"]["images_per_hour"] == 0.0


def test_identity_filter_with_a_missing_worker_and_unknown_keys(tmp_path):
    _worker(tmp_path, 0, [ok("a"), ok("c"), ok("z")])
    m = dist.merge(tmp_path, 2, ["a", "c", "z"], "torchrun", current=lambda shas: {"a": ["in-a"], "c": ["in-c"]})
    assert [r["key"] for r in read_journal(tmp_path / "items.jsonl")] == ["a", "c"]
    assert m["counts"]["missing"] == 1


def test_the_evidence_and_folder_index_sections(tmp_path):
    _two_workers(tmp_path)
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    doc1 = json.loads((tmp_path / "manifest.rank1.json").read_text())
    assert m["evidence"]["workers"]["1"] == doc1["evidence"]
    assert m["folder_metadata"] == {"images/metadata.jsonl": 5}


def test_context_parallel_section_text(tmp_path):
    lay = dist.Layout(mode="ring", data=1, ring=2, ulysses=1)
    _worker(tmp_path, 0, [ok(k) for k in KEYS])
    _worker(tmp_path, 1, [])
    par = dist.merge(tmp_path, 2, KEYS, "torchrun", lay=lay)["parallelism"]
    assert par["launcher"] == "torchrun"
    assert par["sharding"] == ("the run's batches dealt whole, in order, each to the data group with the fewest items "
                               "(see shard); every rank of a context group computes its group's items together, the "
                               "group's first rank writes them")


def test_merged_exit_code_logs_what_is_missing(caplog):
    import logging

    with caplog.at_level(logging.ERROR, logger="runner"):
        assert dist.merged_exit_code({"status": "incomplete", "failed_workers": [1, 3], "counts": {"missing": 4}}) == 1
    assert caplog.messages == ["data-parallel run incomplete: workers not completed: [1, 3]; missing items: 4"]


def test_merged_exit_code_of_an_interrupted_run_is_128_plus_the_workers_signal():
    """Every worker that did not complete was stopped by a signal: 128 + that signal (SIGTERM 143, SIGINT 130, and
    130 when no worker recorded which), as a one-process run; any other status stays 1."""
    def merged(*workers):
        return {"status": "interrupted", "failed_workers": [1], "counts": {"missing": 3},
                "workers": [{"rank": 0, "status": "completed"}, *workers]}

    assert dist.merged_exit_code(merged({"rank": 1, "status": "interrupted", "signal": "SIGTERM"})) == 143
    assert dist.merged_exit_code(merged({"rank": 1, "status": "interrupted", "signal": "SIGINT"})) == 130
    assert dist.merged_exit_code(merged({"rank": 1, "status": "interrupted"})) == 130
    assert dist.merged_exit_code({**merged({"rank": 1, "status": "interrupted", "signal": "SIGTERM"}),
                                  "status": "incomplete"}) == 1


def test_merge_of_workers_all_stopped_by_a_signal_is_interrupted_and_names_it(tmp_path):
    """A worker manifest's ``interrupt.signal`` reaches its ``workers[]`` entry; a stopped worker beside a crashed
    one leaves the run ``incomplete`` (the crash decides)."""
    _two_workers(tmp_path, status="interrupted")
    doc = json.loads((tmp_path / "manifest.rank1.json").read_text())
    (tmp_path / "manifest.rank1.json").write_text(json.dumps({**doc, "interrupt": {"signal": "SIGTERM"}}))
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert (m["status"], m["workers"][1]["signal"], "signal" in m["workers"][0]) == ("interrupted", "SIGTERM", False)
    assert dist.merged_exit_code(m) == 143


def test_ray_reason_is_one_line_of_rays_message():
    """Ray's exception text (many lines of actor and node ids) becomes one bounded line of the worker's reason."""
    from runner.app.ray_launcher import ray_reason

    e = RuntimeError("\nThe worker died unexpectedly while executing this task.\n\tworker_id: abc\n\tnode_id: def")
    assert ray_reason(e) == "ray: RuntimeError: The worker died unexpectedly while executing this task."
    assert ray_reason(ValueError()) == "ray: ValueError"
    long = ray_reason(RuntimeError("x" * 1000))
    assert len(long) == 300 and long.endswith("...")


def test_torchrun_exit_line_only_on_rank_0_of_several(tmp_path, monkeypatch):
    """The line is rank 0's alone (every rank checks the same config), and only under torchrun with 2+ ranks."""
    from runner.core.errors import RefusedError

    e = RefusedError("backend.attention=X cannot run here.")
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    assert dist.torchrun_exit_line(2, "refused", e, tmp_path) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert dist.torchrun_exit_line(2, "refused", e, tmp_path) is None
    monkeypatch.setenv("RANK", "0")
    line = dist.torchrun_exit_line(2, "refused", e, tmp_path)
    assert line.startswith("runner: exit 2 (refused) on every rank: RefusedError: backend.attention=X cannot run "
                           "here; torchrun reports this as its own exit 1") and "\n" not in line
    assert line.endswith(f"the runner's exit code is 2, recorded in {tmp_path / 'job_status.json'}")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dist.torchrun_exit_line(2, "refused", e, tmp_path) is None


def test_a_limited_worker_verdict_merges_as_limited_not_mismatch(tmp_path):
    """Regression (families merge): a worker whose forward-count check is ``limited`` (``model.engine=diffusers``)
    contradicted nothing; the merged verdict said ``mismatch`` because only verified/not_collected counted."""
    _two_workers(tmp_path, verdict="limited")
    m = dist.merge(tmp_path, 2, KEYS, "torchrun")
    assert m["evidence"]["verdict"] == "limited" and m["evidence"]["mismatches"] == []
    _two_workers(tmp_path, verdict="limited")
    _worker(tmp_path, 0, [ok("a")], verdict="mismatch", mismatches=["stage denoise: x"])
    assert dist.merge(tmp_path, 2, KEYS, "torchrun")["evidence"]["verdict"] == "mismatch"
