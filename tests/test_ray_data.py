"""``launcher=ray``: a Ray Data actor pool pulls the run's batches (``runner.app.ray_launcher``). Real Ray, real
processes, a real SIGKILL of an actor mid-batch: the run completes without a restart, every item ``ok``, artifacts
byte-identical to a one-worker run, the death named with its pid and the batch it lost; a re-run generates nothing
(the journal is the checkpoint); a refusal in the actors ends the run with its exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import image_hashes, requires_extra, worker_env

pytestmark = [pytest.mark.cpu, requires_extra("scale")]

ROWS = 6
SLOW = "model.generation.num_inference_steps=32"  # about 2 s a batch here: the kill lands mid-batch


def _cmd(args):
    return [sys.executable, "-m", "runner", "model=toy_shapes", f"dataset.limit={ROWS}", SLOW, *args]


def _ray_args(d: Path, address: str):
    return ["parallelism=data", "launcher=ray", "launcher.num_workers=2", "parallelism.lease_s=3",
            f"launcher.address={address}", f"hydra.run.dir={d}"]


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray (2 CPUs) for the module, joined by every run's driver (``launcher.address``): Ray starts once."""
    import ray

    info = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield info.address_info["gcs_address"]
    ray.shutdown()


def _claims_dir(d: Path):
    dirs = sorted((d / "claims").glob("*/fleet.json")) if (d / "claims").is_dir() else []
    return dirs[-1].parent if dirs else None


def _kill_mid_batch(d: Path, p: subprocess.Popen, deadline_s: float = 400):
    """SIGKILL the actor holding a batch that is not journaled yet (frozen with SIGSTOP first, then checked still
    undone, so the kill lands mid-batch). Returns (pid, batch id)."""
    deadline = time.time() + deadline_s
    while time.time() < deadline and p.poll() is None:
        c = _claims_dir(d)
        for g0 in sorted(c.glob("b*.g0")) if c else ():
            batch = g0.name.split(".")[0]
            if (c / f"{batch}.done").exists():
                continue
            try:
                pid = json.loads(g0.read_text())["pid"]
            except (ValueError, KeyError):
                continue  # still being written
            os.kill(pid, signal.SIGSTOP)
            if (c / f"{batch}.done").exists():  # finished between the look and the stop: another one
                os.kill(pid, signal.SIGCONT)
                continue
            os.kill(pid, signal.SIGKILL)
            return pid, batch
        time.sleep(0.05)
    raise AssertionError("no actor ever held an undone batch")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("single") / "run"
    r = subprocess.run(_cmd([f"hydra.run.dir={d}"]), cwd=d.parent, env=worker_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    h = image_hashes(d)
    assert len(h) == ROWS
    return h


def test_actor_killed_mid_batch_run_completes_byte_identical_then_rerun_generates_nothing(tmp_path, single,
                                                                                        ray_address):
    d = tmp_path / "ray"
    p = subprocess.Popen(_cmd(_ray_args(d, ray_address)), cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    victim, lost = _kill_mid_batch(d, p)
    out = p.communicate(timeout=500)[0]
    assert p.returncode == 0, out[-4000:]  # no manual restart: Ray retried the task on a restarted actor
    assert image_hashes(d) == single  # byte-identical to the one-worker run
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and m["counts"] == {"ok": ROWS, "failed": 0, "reused": 0, "items": ROWS,
                                                          "missing": 0}
    items = [json.loads(x) for x in (d / "items.jsonl").read_text().splitlines()]
    assert [i["status"] for i in items] == ["ok"] * ROWS and len({i["key"] for i in items}) == ROWS
    assert m["parallelism"]["launcher"] == "ray" and m["parallelism"]["scheduler"].startswith("ray.data")
    # the death: its pid, the batch it lost, who took it over
    deaths = m["claims"]["deaths"]
    assert [(x["pid"], x["lost_batches"]) for x in deaths] == [(victim, [lost])], deaths
    dead = next(w for w in m["workers"] if w["pid"] == victim)
    assert dead["status"] == "crashed" and dead["lost_batches"] == [lost]
    took = [t for t in m["claims"]["taken_over"] if t["batch"] == lost]
    assert len(took) == 1 and took[0]["from_pid"] == victim and took[0]["by_rank"] != dead["rank"]
    # every live actor completed and verified; Ray's pool section: every batch answered, start-up apart
    live = [w for w in m["workers"] if w["pid"] != victim]
    assert live and all(w["status"] == "completed" and w["evidence_verdict"] == "verified" for w in live)
    ray_doc = m["ray"]
    assert ray_doc["batches"] == ray_doc["answered"] == ray_doc["generated"] == ROWS and ray_doc["journaled"] == 0
    assert all(a["startup_s"] > 0 for a in ray_doc["actors"].values())
    assert sum(a["batches"] for a in ray_doc["actors"].values()) == ROWS
    assert not [q for q in d.rglob("*") if ".tmp" in q.name]

    # a re-run: every batch is journaled, so no actor generates (nor loads a model) and nothing is rewritten
    mtimes = {q.name: q.stat().st_mtime_ns for q in (d / "images").glob("*.png")}
    r = subprocess.run(_cmd(_ray_args(d, ray_address)), cwd=tmp_path, env=worker_env(), capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    again = json.loads((d / "manifest.json").read_text())
    assert again["counts"] == {"ok": 0, "failed": 0, "reused": ROWS, "items": ROWS, "missing": 0}
    assert again["ray"]["journaled"] == ROWS and again["ray"]["generated"] == 0
    assert {q.name: q.stat().st_mtime_ns for q in (d / "images").glob("*.png")} == mtimes
    assert image_hashes(d) == single


def test_refusal_in_the_actors_ends_the_run_with_its_exit_code(tmp_path, ray_address):
    d = tmp_path / "refused"
    r = subprocess.run(_cmd(_ray_args(d, ray_address) + ["backend.attention=FLASH_ATTN"]), cwd=tmp_path, env=worker_env(),
                       capture_output=True, text=True, timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-4000:]
    job = json.loads((d / "job_status.json").read_text())
    assert (job["exit_code"], job["outcome"], job["error_type"]) == (2, "refused", "BackendUnavailableError"), job
    assert "FLASH_ATTN" in job["error"]
    assert not (d / "images").exists() or not list((d / "images").glob("*.png"))
