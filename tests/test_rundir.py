"""One run per run dir (C11), a final status for every way a run ends (C18), and unique default dirs.

* C11: two ``python -m runner`` processes started together with the same ``hydra.run.dir`` (seed 1 and 3): one is
  refused (exit 2, naming the dir and the holder) before it writes anything; every journal record matches its
  file, and the manifest's seed is the one that made the file.
* A live holder refuses a run; the stale lock of a killed run is taken over and recorded in the manifest.
* C18: Ctrl-C twice during generation: manifest ``interrupted`` with its end time, ``job_status.json`` written.
* Readers (report, matrix, sweep summary, repro, data-parallel merge, resume) report a ``running`` manifest whose
  run is dead as ``crashed``, and a live one as ``running``.
* Default dirs (Hydra's run and sweep dirs, ``repro.sh``, ``python -m runner.repro``) never collide.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

REPO = Path(__file__).resolve().parent.parent


def _env(subprocess_env: Dict[str, str]) -> Dict[str, str]:
    return dict(subprocess_env, PYTHONPATH=str(REPO) + os.pathsep + subprocess_env.get("PYTHONPATH", ""))


def _journal(d: Path) -> List[Dict[str, Any]]:
    p = d / "items.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []


def _lines(p: Path) -> int:
    try:
        return p.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


HOLDER = textwrap.dedent("""
    import fcntl, json, os, socket, sys, time
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)
    fd = os.open(os.path.join(d, "run.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": "2026-01-01T00:00:00",
                             "command": "holder " + d, "token": "t-" + str(os.getpid())}).encode())
    os.fsync(fd)
    print("held", flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), 9)  # a run killed with SIGKILL: its lock file stays, naming it; the kernel unlocks
    time.sleep(600)
""")


def _hold(d: Path, how: str) -> subprocess.Popen:
    """A process that locks ``d/run.lock`` the way a run does (flock + holder record), then sleeps or dies."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(d), how], stdout=subprocess.PIPE, text=True)
    if how == "sleep":
        assert p.stdout.readline().strip() == "held"
    else:
        p.wait(timeout=30)
    return p


# ============================================================================================== C11
def test_c11_two_runs_started_together_into_one_dir(tmp_path, subprocess_env):
    d = tmp_path / "same"
    env = _env(subprocess_env)
    procs = {seed: subprocess.Popen([sys.executable, "-m", "runner", "model=toy_shapes", "platform=cpu",
                                     "dataset.limit=1", f"seed={seed}", f"hydra.run.dir={d}"], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 3)}
    out = {seed: p.communicate(timeout=600) for seed, p in procs.items()}
    codes = {seed: p.returncode for seed, p in procs.items()}
    assert sorted(codes.values()) == [0, 2], (codes, {s: o[1][-2000:] for s, o in out.items()})
    winner = next(s for s, c in codes.items() if c == 0)
    loser = next(s for s, c in codes.items() if c == 2)
    err = out[loser][0] + out[loser][1]
    assert str(d) in err and "in use by another run" in err, err
    assert f"pid {procs[winner].pid}" in err, err  # the holder is named
    assert "Traceback" not in err
    recs = _journal(d)
    assert len(recs) == 1
    for r in recs:  # every record's hash is its file's
        assert r["file_sha256"] == hashlib.sha256((d / r["file"]).read_bytes()).hexdigest()
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and m["config"]["seed"] == winner
    assert m["owner"]["pid"] == procs[winner].pid
    assert f"seed={winner}" in (d / ".hydra" / "overrides.yaml").read_text()  # the refused run wrote nothing
    assert json.loads((d / "job_status.json").read_text())["outcome"] == "ok"
    assert not (d / "run.lock").exists()  # an ended run leaves no lock behind


def test_live_holder_refuses_before_anything_is_written(tmp_path, subprocess_env, compose):
    d = tmp_path / "held"
    holder = _hold(d, "sleep")
    try:
        p = subprocess.run([sys.executable, "-m", "runner", "model=tiny_flux", "platform=cpu", "dataset.limit=1",
                            f"hydra.run.dir={d}"], cwd=tmp_path, env=_env(subprocess_env), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 2, p.stderr[-2000:]
        assert str(d) in p.stderr and f"pid {holder.pid}" in p.stderr and f"holder {d}" in p.stderr
        assert sorted(x.name for x in d.iterdir()) == ["run.lock"]  # no .hydra, log, manifest or job_status
        from runner.core.errors import RunDirInUseError
        from runner.app.execute import run

        with pytest.raises(RunDirInUseError, match="in use by another run"):  # in-process callers too
            run(compose(["platform=cpu", "dataset.limit=1"]), d)
        assert sorted(x.name for x in d.iterdir()) == ["run.lock"]
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_killed_run_is_taken_over_and_recorded(tmp_path, subprocess_env):
    d = tmp_path / "stale"
    dead = _hold(d, "die")
    assert dead.returncode == -signal.SIGKILL and (d / "run.lock").exists()
    p = subprocess.run([sys.executable, "-m", "runner", "model=tiny_flux", "platform=cpu", "dataset.limit=1",
                        f"hydra.run.dir={d}"], cwd=tmp_path, env=_env(subprocess_env), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed"
    took = m["lock"]["took_over"]
    assert took["pid"] == dead.pid and took["command"] == f"holder {d}"
    assert m["lock"]["holder"]["pid"] == m["owner"]["pid"] != dead.pid
    assert "took over the stale lock" in p.stdout + p.stderr
    assert not (d / "run.lock").exists()


# ============================================================================================== C18
def test_c18_ctrl_c_twice_during_generation_records_the_final_status(tmp_path, subprocess_env):
    d = tmp_path / "run"
    log = tmp_path / "run.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "runner", "model=tiny_flux", "platform=cpu", "dataset.limit=4",
                              "model.generation.num_inference_steps=300", f"hydra.run.dir={d}"], cwd=tmp_path,
                             env=_env(subprocess_env), stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while _lines(d / "items.jsonl") < 1:  # the first journal line: the next item is generating
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=60)
    assert rc == 128 + signal.SIGINT, log.read_text()[-3000:]
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "interrupted" and m["ended_at"], m["status"]
    assert m["interrupt"]["forced"] is True  # the second signal ended it mid-generation
    assert len(_journal(d)) < 4
    st = json.loads((d / "job_status.json").read_text())
    assert st["exit_code"] == 128 + signal.SIGINT and st["outcome"] == "interrupted"
    assert not (d / "run.lock").exists()  # released: the next run takes the dir without a takeover
    for r in _journal(d):
        assert r["file_sha256"] == hashlib.sha256((d / r["file"]).read_bytes()).hexdigest()


# ============================================================================= readers: running -> crashed
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _running_manifest(d: Path, pid: int, token: str) -> Dict[str, Any]:
    d.mkdir(parents=True, exist_ok=True)
    doc = {"schema_version": 1, "run_id": "x", "status": "running", "started_at": "2026-01-01T00:00:00+00:00",
           "ended_at": None, "owner": {"pid": pid, "host": socket.gethostname(), "token": token},
           "config": {"model": {"name": "tiny_flux", "engine": "flux"}, "seed": 0}, "overrides": ["seed=0"]}
    (d / "manifest.json").write_text(json.dumps(doc))
    # an earlier attempt's job_status.json: stale beside a manifest of a later attempt
    (d / "job_status.json").write_text(json.dumps({"exit_code": 0, "outcome": "ok"}))
    return doc


def test_readers_report_a_running_manifest_with_a_dead_owner_as_crashed(tmp_path):
    from runner.tools.matrix import classify
    from runner.tools.report import load_jobs
    from runner.tools.sweep import summarize

    sweep = tmp_path / "sweep"
    _running_manifest(sweep / "0", _dead_pid(), "tok-dead")
    (sweep / "0" / "run.lock").write_text(json.dumps({"pid": 1, "token": "tok-dead"}))  # stale, unlocked
    holder = _hold(sweep / "1", "sleep")  # a live run: its lock is held
    try:
        _running_manifest(sweep / "1", holder.pid, f"t-{holder.pid}")
        jobs = {j.name: j for j in load_jobs([sweep])}
        assert jobs["0"].manifest["status"] == "crashed" and jobs["0"].outcome == "crashed"
        assert jobs["0"].manifest["recorded_status"] == "running"
        assert jobs["1"].manifest["status"] == "running" and jobs["1"].outcome == "running"
        state, note = classify(jobs["0"], None)
        assert state == "failed" and "crashed" in note
        doc = summarize(sweep)
        assert [(j["dir"], j["status"], j["outcome"]) for j in doc["jobs"]] == [
            ("0", "crashed", "crashed"), ("1", "running", "running")]
        assert doc["exit_code"] == 1
        from runner.core import rundir

        assert rundir.effective_status(sweep / "0", json.loads((sweep / "0" / "manifest.json").read_text())) == \
            "crashed"
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone now: the same manifest reads as crashed
    assert {j.name: j.outcome for j in load_jobs([sweep])}["1"] == "crashed"


def test_repro_refuses_a_live_run_and_notes_a_crashed_one(tmp_path):
    from runner.tools.repro import ReproInputError, reproduce

    d = tmp_path / "live"
    holder = _hold(d, "sleep")
    try:
        _running_manifest(d, holder.pid, f"t-{holder.pid}")
        with pytest.raises(ReproInputError, match="still running"):
            reproduce(d, tmp_path / "new")
        assert not (tmp_path / "new").exists()
    finally:
        holder.kill()
        holder.wait()


def test_merge_reports_a_worker_left_running_as_crashed(tmp_path):
    from runner.core.distributed import merge

    d = tmp_path / "dp"
    d.mkdir()
    for r, st in ((0, "completed"), (1, "running")):
        (d / f"manifest.rank{r}.json").write_text(json.dumps({
            "status": st, "worker": {"rank": r}, "counts": {"ok": 1, "reused": 0}, "evidence": {"verdict": "verified"},
            "resumed_from": {"status": "running"} if r == 1 else None}))
    merged = merge(d, 2, ["a", "b"], "torchrun")
    assert [w["status"] for w in merged["workers"]] == ["completed", "crashed"]
    assert merged["workers"][1]["resumed_from"] == "crashed"
    assert merged["status"] == "incomplete" and merged["failed_workers"] == [1]


def test_resume_of_a_run_left_running_records_crashed(tmp_path, compose):
    from runner.app.execute import run

    d = tmp_path / "r"
    ov = ["platform=cpu", "dataset.limit=2"]
    assert run(compose(ov), d) == 0
    m = json.loads((d / "manifest.json").read_text())
    m.update(status="running", ended_at=None)  # as a SIGKILL leaves it
    (d / "manifest.json").write_text(json.dumps(m))
    (d / "images" / sorted(os.listdir(d / "images"))[0]).unlink()
    assert run(compose(ov), d) == 0
    m = json.loads((d / "manifest.json").read_text())
    assert m["resumed_from"]["status"] == "crashed" and m["resumed_from"]["reused_items"] == 1


# ============================================================================================ default dirs
def test_default_dirs_never_collide(tmp_path, subprocess_env, monkeypatch):
    from runner.core.provenance import write_repro

    # repro.sh: two re-runs into the default dir in the same second get two dirs
    orig = tmp_path / "orig"
    orig.mkdir()
    monkeypatch.chdir(tmp_path)
    write_repro(orig, ["seed=1"], {})
    fake = tmp_path / "fakepy"  # the script's interpreter: prints the run dir the re-run would get (repro.sh
    # hands it to Hydra through RUNNER_REPRO_DIR, so no character of it meets Hydra's override grammar)
    fake.write_text('#!/bin/sh\ncase "$1" in -m) echo "hydra.run.dir=$RUNNER_REPRO_DIR";; esac\n')
    fake.chmod(0o755)
    env = dict(subprocess_env, PYTHON=str(fake))
    outs = []
    procs = [subprocess.Popen(["bash", str(orig / "repro.sh")], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        outs.append(p.communicate(timeout=60)[0])
        assert p.returncode == 0
    dirs = [next(a for a in o.split() if a.startswith("hydra.run.dir=")).split("=", 1)[1] for o in outs]
    assert dirs[0] != dirs[1], dirs
    assert all((tmp_path / x).is_dir() for x in dirs), dirs  # created exclusively, before the run

    # python -m runner.repro's default: created exclusively, a suffix when the name is taken
    from runner.core import rundir

    a, b = rundir.new_dir(tmp_path / "repro", "2026-01-01_00-00-00"), rundir.new_dir(tmp_path / "repro",
                                                                                      "2026-01-01_00-00-00")
    assert a != b and a.is_dir() and b.is_dir()

    # Hydra's default run and sweep dirs: time to the microsecond and the process id
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        ps = [subprocess.Popen([sys.executable, "-m", "runner", "--cfg", "hydra", "--resolve", "-p", key],
                               cwd=tmp_path, env=_env(subprocess_env), stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
        got = [(p.pid, p.communicate(timeout=120)[0].strip()) for p in ps]
        assert got[0][1] != got[1][1], got
        for pid, text in got:
            assert text.endswith(f"-{pid}"), (pid, text)


# ==================================================================================== data parallelism
def test_torchrun_run_holds_its_dir_for_all_ranks(tmp_path, subprocess_env, compose):
    """The two ranks of one torchrun run share the dir (rank 0 holds run.lock, rank 1 joined through
    workers.lock); a second run started meanwhile is refused naming rank 0; the run completes and merges."""
    from omegaconf import OmegaConf

    from models.flux import embedded_snapshot

    cfg = compose([])  # the embedded tiny_flux exists before two ranks start (they would both create it)
    embedded_snapshot(cfg.model.name, OmegaConf.to_container(cfg.model.architecture, resolve=True), None)
    d = tmp_path / "dp"
    env = _env(subprocess_env)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    log = tmp_path / "dp.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner",
                              "model=tiny_flux", "parallelism=data", "dataset.limit=8",
                              "model.generation.num_inference_steps=300", f"hydra.run.dir={d}"], cwd=tmp_path,
                             env=env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while _lines(d / "items.rank1.jsonl") < 1 or not (d / "manifest.rank0.json").exists():
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)
    rank0 = json.loads((d / "manifest.rank0.json").read_text())["worker"]["pid"]
    rank1 = json.loads((d / "manifest.rank1.json").read_text())
    assert json.loads((d / "run.lock").read_text())["pid"] == rank0
    assert rank1["owner"]["token"] == json.loads((d / "run.lock").read_text())["token"]  # rank 1 joined the run
    assert (d / "workers.lock").exists()
    # a second run taking the dir now is refused naming rank 0: the check a second `python -m runner` makes first,
    # made here while the run is known to be alive (a second interpreter's start-up of several seconds on a loaded
    # machine outlasted the run it was meant to meet: CI saw it reach the resume check of the finished run instead)
    from runner.core import rundir
    from runner.core.errors import RunDirInUseError

    assert p.poll() is None
    with pytest.raises(RunDirInUseError, match=f"pid {rank0}"):
        rundir.acquire(d)
    assert p.poll() is None, "the run ended before the check: the check proved nothing"
    assert p.wait(timeout=400) == 0, log.read_text()[-3000:]
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and m["counts"]["missing"] == 0
    assert m["lock"]["holder"]["pid"] == rank0
    assert not (d / "run.lock").exists() and not (d / "workers.lock").exists()


# regression: bug: Ctrl-C during a sweep stopped the current job only; Hydra then launched the next jobs
def test_ctrl_c_during_a_sweep_stops_the_sweep(tmp_path, subprocess_env):
    sweep = tmp_path / "sweep"
    log = tmp_path / "sweep.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "runner", "-m", "model=tiny_flux", "platform=cpu",
                              "dataset.limit=3", "model.generation.num_inference_steps=100", "seed=1,2",
                              f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=_env(subprocess_env), stdout=f,
                             stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while _lines(sweep / "0" / "items.jsonl") < 1:  # job 0 is generating its second item
        assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=120)
    assert rc == 128 + signal.SIGINT, log.read_text()[-3000:]
    assert json.loads((sweep / "0" / "job_status.json").read_text())["outcome"] == "interrupted"
    assert not (sweep / "1").exists()  # the second job never started


# regression: a sweep re-run into a sweep dir with other values: every job was refused (its dir holds the earlier
# job's run), yet sweep.json and the log said "ok" for each (the earlier runs' job_status.json) and the sweep exited 0
def test_a_sweep_whose_jobs_are_refused_in_dirs_of_earlier_runs_reports_them_and_exits_1(tmp_path, subprocess_env):
    sweep = tmp_path / "sweep"

    def sweep_run(seeds):
        return subprocess.run([sys.executable, "-m", "runner", "-m", "platform=cpu", "dataset.limit=1",
                               f"seed={seeds}", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=_env(subprocess_env),
                              capture_output=True, text=True, timeout=600)

    first = sweep_run("1,2")
    assert first.returncode == 0, first.stderr[-3000:]
    before = {d: (sweep / d / "manifest.json").read_bytes() for d in ("0", "1")}
    second = sweep_run("4,2")  # job 0: seed 1 -> 4, refused; job 1: the same config, nothing left to do
    out = second.stdout + second.stderr
    assert second.returncode == 1, out[-3000:]
    doc = json.loads((sweep / "sweep.json").read_text())
    jobs = {j["dir"]: j for j in doc["jobs"]}
    assert doc["exit_code"] == 1
    assert jobs["0"]["outcome"] == "invalid" and jobs["0"]["exit_code"] == 2 and jobs["0"]["status"] == "not_run"
    assert "seed=4" in jobs["0"]["overrides"] and "seed=1" in jobs["0"]["dir_holds"], jobs["0"]
    assert "seed: 1 -> 4" in jobs["0"]["error"], jobs["0"]["error"]
    assert jobs["1"]["outcome"] == "ok" and "seed=2" in jobs["1"]["overrides"], jobs["1"]
    assert (sweep / "0" / "manifest.json").read_bytes() == before["0"]  # the earlier run's records, untouched
    assert json.loads((sweep / "0" / "job_status.json").read_text())["outcome"] == "ok"
