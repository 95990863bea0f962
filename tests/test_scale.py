"""Scale-out on CPU: torchrun data parallelism gives the artifacts of a 1-worker run, merges into one manifest,
survives a killed worker with a resume (launcher=ray: ``tests/test_ray_data.py``; launcher=slurm:
``tests/test_slurm.py``); submitit_local runs a sweep; CFG parallelism (none in diffusers)
and context parallelism without torchrun refuse (context parallelism itself: ``tests/test_context_parallel.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner.core.distributed import SHARDING
from _helpers import image_hashes, requires_extra, worker_env  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ROWS = 6




def _runner(args, cwd, timeout=300, torchrun=0):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(torchrun), "-m", "runner"]
           if torchrun else [sys.executable, "-m", "runner"]) + list(args) + ["model=tiny_flux"]
    return subprocess.run(cmd, cwd=cwd, env=worker_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("single") / "run"
    r = _runner([f"dataset.limit={ROWS}", f"hydra.run.dir={d}"], cwd=d.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    h = image_hashes(d)
    assert len(h) == ROWS
    return h


def _check_merged(d: Path, single, world_size: int, launcher: str):
    assert image_hashes(d) == single  # byte-identical to the 1-worker run
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed"
    assert m["parallelism"] == {"mode": "data", "world_size": world_size, "launcher": launcher,
                                "sharding": SHARDING}
    assert [w["rank"] for w in m["workers"]] == list(range(world_size))
    assert m["dataset"]["items"] == ROWS and m["counts"] == {"ok": ROWS, "failed": 0, "reused": 0, "items": ROWS,
                                                              "missing": 0}
    assert m["evidence"]["mismatches"] == []
    assert all(w["status"] == "completed" and w["evidence_verdict"] == "verified" for w in m["workers"])
    assert len({w["pid"] for w in m["workers"]}) == world_size  # really different processes
    assert sum(w["shard_items"] for w in m["workers"]) == ROWS
    assert max(w["shard_items"] for w in m["workers"]) - min(w["shard_items"] for w in m["workers"]) <= 1
    items = [json.loads(l) for l in (d / "items.jsonl").read_text().splitlines()]
    assert len(items) == ROWS and len({i["key"] for i in items}) == ROWS
    return m


def test_torchrun_two_workers_equal_single(tmp_path, single):
    d = tmp_path / "dp"
    r = _runner(["parallelism=data", f"dataset.limit={ROWS}", f"hydra.run.dir={d}"], cwd=tmp_path, torchrun=2)
    assert r.returncode == 0, r.stderr[-3000:]
    _check_merged(d, single, 2, "torchrun")
    assert (d / "workers" / "rank1").is_dir() and not (d / "workers" / "rank0").exists()  # rank 0 owns the run dir
    assert not (tmp_path / "outputs").exists()  # no rank made a run dir of its own


def test_torchrun_killed_worker_then_resume(tmp_path, single):
    d = tmp_path / "dpk"
    # 6x the default steps: rank 1 is still busy when it is killed (with 12, rank 1 once finished its 8 items on
    # a loaded 2-core CI machine between the poll that saw its first record and the kill)
    slow = "model.generation.num_inference_steps=24"
    args = ["parallelism=data", "dataset.limit=16", slow, f"hydra.run.dir={d}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner", "model=tiny_flux",
           *args]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    victim = None
    deadline = time.time() + 240
    while time.time() < deadline and victim is None:
        m1 = d / "manifest.rank1.json"
        if m1.exists() and (d / "items.rank1.jsonl").exists() and (d / "items.rank1.jsonl").read_text().count("\n") >= 1:
            victim = json.loads(m1.read_text())["worker"]["pid"]
            os.kill(victim, signal.SIGSTOP)  # frozen at once: the kill below finds it where the poll saw it
            break
        time.sleep(0.05)
    assert victim, "rank 1 never started writing"
    assert json.loads((d / "manifest.rank1.json").read_text())["status"] == "running"
    os.kill(victim, signal.SIGKILL)
    assert p.wait(timeout=120) != 0
    r = _runner(args, cwd=tmp_path, torchrun=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and m["counts"]["missing"] == 0 and m["dataset"]["items"] == 16
    assert m["counts"]["ok"] + m["counts"]["reused"] == 16 and m["counts"]["reused"] >= 1  # as a 1-worker resume
    w1 = m["workers"][1]
    assert w1["resumed_from"] == "crashed"  # rank 1 died in the first attempt (its manifest was left at running)
    assert w1["counts"]["reused"] >= 1  # its finished rows were kept, not regenerated
    ref = tmp_path / "ref"
    r = _runner(["dataset.limit=16", slow, f"hydra.run.dir={ref}"], cwd=tmp_path)
    assert r.returncode == 0
    assert image_hashes(d) == image_hashes(ref)
    assert not [p for p in d.rglob("*") if ".tmp" in p.name]


def test_torchrun_interrupted_records_128_plus_the_signal(tmp_path):
    """A signal to torchrun (its agent forwards it to every rank once, as a Ctrl-C or a scheduler's signal to the
    job's main process does): each rank stops after its batch and records the signal; the merged run is
    ``interrupted`` and job_status.json records 130, the code a one-process run stopped by SIGINT records (was:
    ``incomplete``, exit 1, the signal nowhere). torchrun's own exit (1, its SignalException) is torchrun's."""
    d = tmp_path / "dpi"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner",
           "parallelism=data", "model.generation.num_inference_steps=200", f"hydra.run.dir={d}"]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not all(
            (d / f"items.rank{r}.jsonl").exists() and (d / f"items.rank{r}.jsonl").read_text().count("\n") >= 1
            for r in (0, 1)):
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=240)
    st = json.loads((d / "job_status.json").read_text())
    m = json.loads((d / "manifest.json").read_text())
    assert (st["exit_code"], st["outcome"], m["status"]) == (128 + signal.SIGINT, "interrupted", "interrupted"), st
    assert [(w["status"], w["signal"]) for w in m["workers"]] == [("interrupted", "SIGINT")] * 2
    assert 2 <= m["counts"]["ok"] < 24 and m["counts"]["missing"] == 24 - m["counts"]["ok"]


@requires_extra("scale")
def test_submitit_local_two_job_sweep(tmp_path):
    sw = tmp_path / "sweep"
    r = _runner(["-m", "hydra/launcher=submitit_local", "seed=1,2", "dataset.limit=1", f"hydra.sweep.dir={sw}",
                 "hydra.launcher.timeout_min=10"], cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((sw / "sweep.json").read_text())
    assert [j["outcome"] for j in doc["jobs"]] == ["ok", "ok"]
    seeds = [json.loads((sw / j["dir"] / "manifest.json").read_text())["config"]["seed"] for j in doc["jobs"]]
    assert sorted(seeds) == [1, 2]


@pytest.mark.parametrize("mode,says", [("cfg", "diffusers 0.42 has no CFG parallelism"),
                                       ("ulysses", "torchrun --nproc-per-node 2 -m runner parallelism=ulysses")])
def test_parallel_modes_refused_without_what_they_need(tmp_path, mode, says):
    r = _runner([f"parallelism={mode}", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert r.returncode == 2
    assert says in (r.stdout + r.stderr)
    assert not (tmp_path / "r" / "images").exists()


def test_torchrun_refusal_prints_the_runners_exit_code_once(tmp_path):
    """Issue 29: a refusal is exit 2 on each rank, but torchrun exits 1 with its ChildFailedError traceback. Rank 0
    prints one line naming the runner's exit code and the refusal; job_status.json records exit 2."""
    d = tmp_path / "tr"
    r = _runner(["parallelism=data", "backend.attention=FLASH_ATTN", f"hydra.run.dir={d}"], cwd=tmp_path, torchrun=2)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]  # torchrun's own code, whatever the ranks' (documented)
    lines = [x for x in out.splitlines() if x.startswith("runner: exit ")]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("runner: exit 2 (refused) on every rank: BackendUnavailableError: "
                               "backend.attention=FLASH_ATTN cannot run here")
    assert "the runner's exit code is 2" in lines[0] and str(d / "job_status.json") in lines[0]
    job = json.loads((d / "job_status.json").read_text())
    assert (job["exit_code"], job["outcome"], job["error_type"]) == (2, "refused", "BackendUnavailableError")
    assert not (d / "images").exists()


def test_data_parallel_without_workers_refuses(tmp_path):
    r = _runner(["parallelism=data", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert r.returncode == 2
    assert "torchrun" in (r.stdout + r.stderr)
