"""``launcher=slurm``: a submitit job array whose tasks claim the run's batches (``runner.app.slurm_launcher``), run
by submitit's LocalExecutor: real task processes under submitit's controller, real signals. A task sent USR2 (what
SLURM sends before the time limit) and a task whose controller gets SIGTERM (what SLURM sends a preempted job,
forwarded to the task as SLURM does) each finish their batch, are requeued through submitit's checkpoint (the
controller starts the task again: exit 144) and resume from the journal: every item ok, byte-identical to a
one-worker run, no item generated twice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from _helpers import image_hashes, requires_extra, worker_env
from runner.core.testing import preempt_two_tasks

pytestmark = [pytest.mark.cpu, requires_extra("scale")]

ROWS = 8
SLOW = "model.generation.num_inference_steps=48"  # about 3 s a batch here: signals land mid-run


def _cmd(args):
    return [sys.executable, "-m", "runner", "model=toy_shapes", f"dataset.limit={ROWS}", SLOW, *args]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("single") / "run"
    r = subprocess.run(_cmd([f"hydra.run.dir={d}"]), cwd=d.parent, env=worker_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return image_hashes(d)


def _diagnose(d, m, pid):
    """What a failed look at the journals needs to be understood: every rank's records (key, status), the workers,
    the tasks' events and the claim files with their holders."""
    out = {"pid": pid, "workers": [{k: w.get(k) for k in ("pid", "rank", "status")} for w in m["workers"]],
           "tasks": [{k: t.get(k) for k in ("event", "pid", "job_id", "attempt", "signal", "batch_unfinished",
                                           "batches_unfinished", "run_ended", "waited_s")} for t in m["slurm"]["tasks"]]}
    for j in sorted(d.glob("items.rank*.jsonl")):
        out[j.name] = [(r.get("key"), r.get("status")) for r in map(json.loads, j.read_text().splitlines())]
    for c in sorted(d.glob("claims/*/b*")):
        out[c.name] = c.read_text()[:200]
    return json.dumps(out, indent=1)


def test_preempted_tasks_requeue_and_resume_from_the_journal(tmp_path, single):
    d = tmp_path / "slurm"
    p = subprocess.Popen(_cmd(["parallelism=data", "launcher=slurm", "launcher.executor=local",
                               "launcher.num_workers=2", "launcher.num_gpus_per_worker=0", "launcher.timeout_min=30",
                               "parallelism.lease_s=300", f"hydra.run.dir={d}"]),
                         cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # SIGUSR2 to one task mid-batch, SIGTERM to the other's job mid-batch, each while the other task's process is
    # frozen so that every requeued process joins the same run (runner.core.testing.preempt_two_tasks says how)
    usr2, term = preempt_two_tasks(d)
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out[-5000:]

    assert image_hashes(d) == single  # byte-identical to the one-worker run
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and m["counts"]["missing"] == 0 and m["counts"]["failed"] == 0
    assert m["counts"]["ok"] + m["counts"]["reused"] == ROWS
    assert m["parallelism"]["launcher"] == "slurm" and m["parallelism"]["assign"] == "claims"
    # nothing journaled was generated again: every item has exactly one ok record over all the workers' journals
    oks = {}
    for j in d.glob("items.rank*.jsonl"):
        for line in j.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("status") == "ok":
                oks[rec["key"]] = oks.get(rec["key"], 0) + 1
    assert len(oks) == ROWS and set(oks.values()) == {1}, oks
    # each signalled task: its run ended interrupted after its batch, and it was requeued by its own job
    tasks = m["slurm"]["tasks"]
    by_pid = {t["pid"]: t for t in tasks if t["event"] == "requeued"}
    assert set(by_pid) == {usr2, term}, tasks
    assert by_pid[usr2]["signal"] == "SIGUSR2" and by_pid[term]["signal"] == "SIGTERM"
    assert not any(t["batch_unfinished"] for t in by_pid.values())
    # each was signalled holding a batch: it journaled that batch before leaving (generated once: above)
    rank = {w["pid"]: w["rank"] for w in m["workers"]}
    for pid in (usr2, term):
        mine = [json.loads(x) for x in (d / f"items.rank{rank[pid]}.jsonl").read_text().splitlines()]
        assert [r for r in mine if r["status"] == "ok"], _diagnose(d, m, pid)
    for pid, ev in by_pid.items():
        again = [t for t in tasks if t["event"] == "started" and t["job_id"] == ev["job_id"]
                 and t["attempt"] == ev["attempt"] + 1]
        assert len(again) == 1 and again[0]["pid"] != pid, tasks  # the same job, a new process: requeued
    status = {w["pid"]: w["status"] for w in m["workers"]}
    assert status[usr2] == status[term] == "interrupted" and len(status) == 4, m["workers"]
    assert sorted(status.values()) == ["completed", "completed", "interrupted", "interrupted"]
    assert [r["exit_code"] for r in m["slurm"]["results"]] == [0, 0] and m["slurm"]["errors"] == []
    assert not [q for q in d.rglob("*") if ".tmp" in q.name]


def test_a_signal_landing_inside_a_logging_call_does_not_stall_the_run(tmp_path):
    """Regression (a CI hang of the test above, reproduced here): SIGCONT then SIGTERM back to back; submitit's
    SIGCONT handler logs, the SIGTERM handler interrupted that ``logging`` call while it held the root handler's lock
    and waited (up to ``grace_s``) for the run's thread, which was blocked logging on that lock: the batch was not
    journaled in time and the task aborted instead of requeueing. Now the handler only records the signal; the main
    thread hands it to submitit's handler outside any handler frame, so the run's thread finishes and the checkpoint
    sees it ended (``run_ended``). Real signals, a real ``logging`` handler lock, the real :class:`ClaimsTask`."""
    import logging
    import signal
    import threading
    import time

    from runner.app.slurm_launcher import TASKS_LOG, ClaimsTask

    usr = signal.SIGUSR2  # submitit.JobEnvironment._usr_sig() by default
    main = threading.main_thread()
    told = []

    class Handler(logging.Handler):  # emit holds self.lock (logging.Handler.handle)
        def emit(self, record):
            if record.getMessage() == "Bypassing signal SIGUSR1" and threading.current_thread() is main:
                os.kill(os.getpid(), usr)  # the preemption signal lands inside this logging call
                for _ in range(50):
                    time.sleep(0.002)
            told.append((threading.current_thread().name, record.getMessage()))

    def job(cfg, out_dir, overrides, reraise, task):
        os.kill(os.getpid(), signal.SIGUSR1)  # the main thread's "bypass" handler logs (submitit's SIGCONT)
        time.sleep(0.3)
        logging.getLogger("runner.test").warning("the batch is journaled")  # needs the root handler's lock
        return 0

    task = ClaimsTask({}, str(tmp_path / "run"), [], str(tmp_path / "folder"), grace_s=10.0, job=job)
    requeued = []

    def theirs(signum, frame):  # submitit's checkpoint_and_try_requeue, without the requeue and the exit
        requeued.append(task.checkpoint(0))

    root = logging.getLogger()
    h = Handler()
    saved = (signal.getsignal(usr), signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM),
             root.handlers[:], root.level)
    try:
        root.handlers[:] = [h]
        root.setLevel(logging.INFO)
        signal.signal(usr, theirs)
        signal.signal(signal.SIGUSR1, lambda signum, frame: logging.getLogger("submitit").warning(
            "Bypassing signal SIGUSR1"))
        assert task(0)["exit_code"] == 0
    finally:
        signal.signal(usr, saved[0])
        signal.signal(signal.SIGUSR1, saved[1])
        signal.signal(signal.SIGTERM, saved[2])
        root.handlers[:], _ = saved[3], root.setLevel(saved[4])
    events = [json.loads(x) for x in (tmp_path / "folder" / TASKS_LOG).read_text().splitlines()]
    req = [e for e in events if e["event"] == "requeued"]
    assert len(requeued) == 1 and len(req) == 1 and req[0]["signal"] == "SIGUSR2", events
    assert req[0]["run_ended"] is True, req  # the old handler held the run's thread for the whole grace time
    assert ("runner-slurm-run", "the batch is journaled") in told
    assert [e["event"] for e in events] == ["started", "requeued", "ended"]


@pytest.mark.parametrize("overrides,says", [
    (["launcher=slurm"], "launcher=slurm with parallelism=single"),
    (["parallelism=data"], "add launcher=ray (or launcher=slurm)"),
])
def test_launcher_slurm_needs_data_parallelism(compose, overrides, says):
    from runner.app import checks
    from runner.core.errors import ConfigValueError

    with pytest.raises(ConfigValueError) as e:
        checks.check_run_values(compose(overrides))
    assert says in str(e.value) and "fix:" in str(e.value)


def test_launcher_slurm_config_reaches_submitit(compose, tmp_path):
    """The launcher's resources become the executors' parameters; sbatch where there is no SLURM is refused."""
    from runner.app.slurm_launcher import SlurmUnavailableError, _executor, slurm_parameters

    cfg = compose(["parallelism=data", "launcher=slurm", "launcher.executor=local", "launcher.timeout_min=7",
                   "launcher.signal_delay_s=5", "launcher.num_gpus_per_worker=0"])
    ex = _executor(cfg, tmp_path)
    assert (ex.parameters["timeout_min"], ex.parameters["signal_delay_s"]) == (7, 5)
    cfg = compose(["parallelism=data", "launcher=slurm", "launcher.partition=gpu", "launcher.mem_gb=64",
                   "launcher.num_workers=16"])
    p = slurm_parameters(cfg)
    assert (p["partition"], p["mem"], p["gpus_per_node"], p["cpus_per_task"], p["array_parallelism"], p["time"],
            p["signal_delay_s"], p["ntasks_per_node"]) == ("gpu", "64GB", 1, 8, 16, 240, 120, 1)
    if shutil.which("srun") is None:
        with pytest.raises(SlurmUnavailableError, match="fix: run the command on a SLURM login node, or "
                                                        "launcher.executor=local"):
            _executor(cfg, tmp_path)


def test_requeue_record_names_the_batches_held_and_not_journaled(tmp_path, monkeypatch):
    """What a requeued task's event says of its batches: a claim it still holds without a ``done`` marker is
    unfinished (another worker takes it over), a completed one is not, whatever its run thread is doing then."""
    from runner.app import slurm_launcher
    from runner.core import claims

    monkeypatch.setattr(claims, "LIVE", [])
    c = claims.Claims(claims.PosixClaimStore(tmp_path), lease_s=60)
    assert c.try_claim("b0000000") and c.try_claim("b0000001")
    assert slurm_launcher._held_not_journaled() == ["b0000000", "b0000001"]
    c.complete("b0000001")
    assert slurm_launcher._held_not_journaled() == ["b0000000"]
    c.complete("b0000000")
    assert slurm_launcher._held_not_journaled() == []
