"""Claims on the CPU (issue 40): a straggler under the static deal and under claims, side by side; claims per
second of the POSIX claims store; the control plane at scale; kill and preemption verdicts of every launcher.

**Straggler.** ``toy_shapes`` (platform=cpu, cpu_threads=1), the 24 builtin captions x ``--images`` per prompt at
``batch_size=1``, on ``--workers`` torchrun ranks, once with ``parallelism.assign=static`` (today's deal) and once
with ``parallelism.assign=claims``, the same command otherwise. Rank ``workers - 1`` is made ``--factor`` times
slower by the test-only hook ``RUNNER_TEST_SLOW_WORKER=<rank>:<factor>`` (``runner.core.testing``: it sleeps
``factor - 1`` times each batch's own duration at the batch boundary). For each run:

* ``makespan_s``: the slowest worker's generation loop (``workers[].timing.loop_s``; a claims worker's loop lasts
  until every batch is done, its wait for the others included);
* ``ideal_s``: total work / total speed = ``batches / sum_w(batches_w / busy_w)``, each worker's speed measured
  in the same run (``busy_w``: seconds in its own batches, the hook's sleep included: static ``loop_s``, claims
  ``claims.busy_s``);
* ``ratio = makespan_s / ideal_s`` (1.0: no worker idle while work is left). ``straggler_ratio`` is the claims run's,
  ``straggler_ratio_static`` the static deal's: the median of ``--repeats`` trials of each, run alternately (the
  cores may be shared). Every run's images are compared byte for byte.

Start-up (process start to the first batch: imports, model load) is reported apart (``startup_s``: wall minus the
slowest loop), not in the ratios.

**Claims per second.** ``--claims`` batches claimed and completed (``try_claim`` + ``complete``: two exclusive
creates and the held-claim bookkeeping) in a fresh claims dir under ``--tmp``: by one process, and by ``--racers``
processes racing over the same batches (each batch claimed once; the rate is batches over the slowest racer).

**Scale** (``--parts scale``): the control plane at ``--scale-workers`` (256) simulated workers and each of
``--scale-items`` (10k, 100k items): the incremental merge (every worker appends a toy record per round, a live merge
step per round, the last round left to the final merge; the final merge timed 3 times on copies, its Python peak
memory apart; the one-shot merge of the same journals beside it), and claims per second of the workers pulling the
items' batches (``--scale-batch-size`` 8) through ``Claims.pull`` from ``--scale-processes`` processes; each figure's
growth from the first size to the second (``scale.growth``).

**Kill** (``--parts kill``, ``--kill-cases claims_process,torchrun_rank,ray_actor``): the same 10 rows
(``KILL_ARGS``, 48 steps a batch so that a kill lands mid-batch) run by two workers of each launcher, one of them
SIGKILLed while it holds a batch (``runner.core.testing.kill_mid_batch``): ``claims_process``, a claims worker
started by hand; ``torchrun_rank``, rank 1 of a torchrun group (``--max-restarts=1``); ``ray_actor``, an actor
process of a ``launcher=ray`` run (Ray Data actor pool of two on a local Ray; Ray restarts the actor and retries its
task). The verdict of each (``kill.<case>``): exit 0 without a manual restart, every item ok, images byte-identical to
a one-worker run of the same rows, the death recorded with its pid and the batches it lost.

**Preemption** (``--parts preempt``): the same rows as a ``launcher=slurm`` job array of two tasks under submitit's
LocalExecutor; one task gets SIGUSR2 mid-batch (what SLURM's ``--signal`` sends before the time limit), the other's
job SIGTERM mid-batch (what SLURM sends a preempted job), each requeued through submitit's checkpoint
(``runner.core.testing.preempt_two_tasks``, as ``tests/test_slurm.py`` does). The verdict
(``preemption.slurm_array_task``): both tasks requeued (their signal recorded, a new process of the same job), each
journaled the batch it held before leaving (``journaled_before_requeue``), the requeued processes joined the run,
completed and resumed from the journal, nothing journaled generated again
(``regenerated_journaled``: ``ok`` records beyond one per item over all the journals, 0), every item ok, images
byte-identical to the one-worker run, exit 0, the seconds it took.

Usage: ``python benchmarks/fleet_cpu.py [--parts straggler,rate,scale,kill,preempt] [--workers 4] [--factor 4]
[--images 2] [--claims 5000] [--racers 4] [--kill-cases ...] [--out benchmarks/results/fleet_cpu.json]``; the parts
(and kill cases) not run keep their figures in ``--out``. Straggler and rate about 5 minutes on 2 CPU cores, scale
about 10, kill about 8, preempt about 3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.core.claims import Claims, PosixClaimStore, batch_id  # noqa: E402
from runner.core.testing import kill_mid_batch, preempt_two_tasks, run_processes, worker_pids  # noqa: E402


def _env(slow: Optional[str] = None) -> Dict[str, str]:
    """The runs' environment: offline, this checkout first, ``RUNNER_TEST_SLOW_WORKER=<slow>`` when given."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "RUNNER_TEST_SLOW_WORKER"):
        env.pop(k, None)
    if slow:
        env["RUNNER_TEST_SLOW_WORKER"] = slow
    return env


def straggler(assign: str, out: Path, workers: int, factor: float, images: int) -> Dict[str, Any]:
    """One torchrun run of ``workers`` ranks with ``parallelism.assign=<assign>``, the last rank ``factor`` x slower."""
    out.mkdir(parents=True, exist_ok=True)
    d = out / assign
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
           "-m", "runner", "platform=cpu", "cpu_threads=1", "batch_size=1", f"num_images_per_prompt={images}",
           "parallelism=data", f"parallelism.assign={assign}", "parallelism.lease_s=30", f"hydra.run.dir={d}"]
    t0 = time.perf_counter()
    with open(out / f"{assign}.log", "w") as f:
        code = subprocess.call(cmd, cwd=out, env=_env(f"{workers - 1}:{factor}"), stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    m = json.loads((d / "manifest.json").read_text())
    per = []
    for w in m["workers"]:
        n = (w.get("counts") or {}).get("ok", 0) + (w.get("counts") or {}).get("failed", 0)
        busy = (w.get("claims") or {}).get("busy_s") if assign == "claims" else w["timing"]["loop_s"]
        per.append({"rank": w["rank"], "batches": n, "busy_s": busy, "loop_s": w["timing"]["loop_s"],
                    "load_s": w["timing"]["load_s"], "speed_batches_per_s": round(n / busy, 4) if busy else 0.0})
    batches = sum(p["batches"] for p in per)
    ideal = batches / sum(p["speed_batches_per_s"] for p in per)
    makespan = max(p["loop_s"] for p in per)
    hashes = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((d / "images").glob("*.png"))}
    return {"assign": assign, "exit_code": code, "status": m["status"], "items": m["counts"]["items"],
            "batches": batches, "makespan_s": round(makespan, 3), "ideal_s": round(ideal, 3),
            "ratio": round(makespan / ideal, 3), "wall_s": round(wall, 3), "startup_s": round(wall - makespan, 3),
            "workers": per, "claims": m.get("claims"), "images_sha256": hashes, "command": " ".join(cmd)}


def _racer(root: str, n: int, q: "mp.Queue") -> None:
    c = Claims(PosixClaimStore(Path(root)), lease_s=60)
    t0 = time.perf_counter()
    got = 0
    for i in range(n):
        b = batch_id(i)
        if c.try_claim(b) is not None:
            c.complete(b)
            got += 1
    q.put((got, time.perf_counter() - t0))


def claims_rate(tmp: Path, n: int, racers: int) -> Dict[str, Any]:
    """Claims per second: one process, then ``racers`` processes over the same ``n`` batches."""
    out: Dict[str, Any] = {"batches": n, "store": "posix", "dir": str(tmp)}
    for k in (1, racers):
        root = Path(tempfile.mkdtemp(prefix=f"claims{k}-", dir=tmp))
        res = run_processes(_racer, (str(root), n), k)
        got = sum(r[0] for r in res)
        assert got == n, f"{got} claims for {n} batches"  # each batch claimed exactly once
        slowest = max(r[1] for r in res)
        out[f"processes_{k}"] = {"claims_per_s": round(n / slowest, 1), "seconds": round(slowest, 3),
                                 "per_process": [r[0] for r in res]}
    return out


# --------------------------------------------------------------------------- the control plane at scale
_RECORD = {"id": "", "index": 0, "key": "", "prompt": "a green square in the top left on a white background",
           "negative_prompt": None, "prompt_sha256": "f" * 64, "seed": 3430186994888434292,
           "params": {"width": 64, "height": 64, "num_inference_steps": 16, "guidance_scale": None,
                      "negative_prompt": None, "true_cfg_scale": None, "batch_size": 1},
           "tokens": {"clip": {"count": 13, "limit": 77, "dropped": 0}, "t5": {"count": 12, "limit": 16, "dropped": 0}},
           "timing": {"generate_s": 0.5286, "write_s": 0.0245}, "inputs_sha256": "a" * 64,
           "batch": {"size": 1, "position": 0}, "status": "ok", "file": "", "file_name": "", "file_sha256": "4" * 64}


def _fake_worker(d: Path, rank: int) -> None:
    """A worker manifest of a toy run's size (about 20 kB: provenance, packages), as the merge reads it."""
    doc = {"run_id": "bench", "status": "completed", "owner": {"token": "bench"},
           "config": {"model": {"name": "toy_shapes"}}, "identity": {"sha256": "i" * 64},
           "worker": {"rank": rank, "host": "h", "pid": 1000 + rank}, "counts": {"ok": 0, "failed": 0, "reused": 0},
           "evidence": {"verdict": "verified", "pid": 1000 + rank, "mismatches": []},
           "timing": {"loop_s": 10.0, "wall_s": 12.0}, "progress": {"done": 0, "since": 0.0, "at": 10.0},
           "packages": {f"package-{i}": "1.0.0" for i in range(400)}, "prompts": {"items": 0},
           "claims": {"store": "posix", "claimed": 0, "completed": 0, "reclaimed": [], "busy_s": 1.0, "idle_s": 0.0}}
    (d / f"manifest.rank{rank}.json").write_text(json.dumps(doc, indent=2))


def merge_case(d: Path, items: int, workers: int) -> Dict[str, Any]:
    """The merge of ``items`` records from ``workers`` journals, as a run makes them: every worker appends one
    record per round (a toy record, about 900 bytes) and a live merge step follows each round; the last round is
    left to the final merge. Then the one-shot merge (no state: every journal read whole, as before) of a copy."""
    import shutil
    import statistics

    from runner.core.live_merge import JournalMerge

    (d / "images").mkdir(parents=True)
    for r in range(workers):
        _fake_worker(d, r)
    keys = [f"item-{i:07d}" for i in range(items)]
    jm = JournalMerge(d, keys, "bench")
    step_s, rounds = [], (items + workers - 1) // workers
    for rnd in range(rounds):
        for r in range(workers):
            i = rnd * workers + r
            if i < items:
                with open(d / f"items.rank{r}.jsonl", "a") as f:
                    f.write(json.dumps({**_RECORD, "id": keys[i], "key": keys[i], "file": f"images/{keys[i]}.png",
                                        "file_name": f"{keys[i]}.png"}) + "\n")
        if rnd < rounds - 1:
            t0 = time.perf_counter()
            jm.step(base={"run_id": "bench", "config": {"model": {"name": "toy_shapes"}}})
            step_s.append(time.perf_counter() - t0)
    one = d.parent / f"{d.name}-oneshot"
    shutil.copytree(d, one, ignore=shutil.ignore_patterns("merge"))
    out = {"items": items, "workers": workers, "rounds": rounds, "journal_bytes": sum(
        p.stat().st_size for p in d.glob("items.rank*.jsonl")),
        "live_step_s": {"median": round(statistics.median(step_s), 5), "max": round(max(step_s), 5),
                        "records_per_step": workers, "steps": len(step_s)}}
    for name, run_dir, token in (("final", d, "bench"), ("oneshot", one, None)):
        trials = []
        for t in range(TRIALS):  # each on a copy of the dir as the run left it (a merge removes its state)
            copy = d.parent / f"{d.name}-{name}-{t}"
            _copy_run(run_dir, copy)
            trials.append(_timed_merge(copy, keys, workers, JournalMerge(copy, keys, token)))
            shutil.rmtree(copy)
        copy = d.parent / f"{d.name}-{name}-mem"
        _copy_run(run_dir, copy)
        out[name] = {**sorted(trials, key=lambda x: x["seconds"])[len(trials) // 2],
                     "seconds_all_trials": [x["seconds"] for x in trials],
                     "python_peak_mb": _merge_memory(copy, keys, workers, JournalMerge(copy, keys, token))}
        shutil.rmtree(copy)
    return out


def _copy_run(src: Path, dst: Path) -> None:
    """A copy of a run dir for one more merge: the journals hard-linked (the merge only reads them, and its state
    knows them by inode), everything else copied (the merge writes its state in place)."""
    import shutil

    def copy(a: str, b: str) -> None:
        (os.link if Path(a).name.startswith("items.rank") else shutil.copy2)(a, b)

    shutil.copytree(src, dst, copy_function=copy)


def _merge_memory(d: Path, keys: List[str], workers: int, live: Any) -> float:
    """The Python memory one final merge allocates at its peak (``tracemalloc``; a run apart from the timed ones)."""
    import tracemalloc

    from runner.core.distributed import merge

    tracemalloc.start()
    merge(d, workers, keys, "torchrun", live=live, assign="claims")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return round(peak / 2**20, 2)


#: Trials of each final merge (the median is reported: the cores are shared).
TRIALS = 3


def _timed_merge(d: Path, keys: List[str], workers: int, live: Any) -> Dict[str, Any]:
    """One final merge, timed, with what it read and the process's peak memory growth over it (run each case in a
    fresh process: ``ru_maxrss`` is the process's peak)."""
    from runner.core.distributed import merge

    t0 = time.perf_counter()
    m = merge(d, workers, keys, "torchrun", live=live, assign="claims")
    took = time.perf_counter() - t0
    assert m["counts"]["ok"] + m["counts"]["reused"] == len(keys) and not m["counts"]["missing"], m["counts"]
    return {"seconds": round(took, 4), "read": m["merge"]["final"],
            "items_jsonl_bytes": (d / "items.jsonl").stat().st_size}


def _merge_subprocess(tmp: Path, items: int, workers: int) -> Dict[str, Any]:
    d = tmp / f"merge-{items}-{workers}"
    if d.exists():
        import shutil

        shutil.rmtree(d)
        shutil.rmtree(d.parent / f"{d.name}-oneshot", ignore_errors=True)
    r = subprocess.run([sys.executable, __file__, "--merge-case", str(items), str(workers), str(d)],
                       capture_output=True, text=True, env=_env(), timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _sim_workers(root: str, n: int, workers: int, q: "mp.Queue") -> None:
    """``workers`` simulated claims workers in this process (one ``Claims`` each, their ``pull`` stepped in turn),
    each completing a batch as soon as it gets it."""
    store = PosixClaimStore(Path(root))
    cs = [Claims(store, lease_s=60, poll_s=0.001) for _ in range(workers)]
    ids = [batch_id(i) for i in range(n)]
    gens = [(c, c.pull(range(n), ids, stop=lambda: False)) for c in cs]
    t0 = time.perf_counter()
    got = 0
    while gens:
        for c, g in list(gens):
            b = next(g, None)
            if b is None:
                gens.remove((c, g))
                continue
            c.complete(ids[b])
            got += 1
    q.put((got, time.perf_counter() - t0))


def _one_worker_walk(root: Path, n: int) -> Dict[str, Any]:
    """What one worker pays to walk a run's ``n`` batches once they are all done (a late worker, or any worker's
    last pass): seconds and Python memory (``tracemalloc`` peak: its done set)."""
    import tracemalloc

    ids = [batch_id(i) for i in range(n)]
    tracemalloc.start()
    t0 = time.perf_counter()
    c = Claims(PosixClaimStore(root), lease_s=60, poll_s=0.001)
    assert next(c.pull(range(n), ids, stop=lambda: False), None) is None  # every batch done: nothing to claim
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"seconds": round(took, 3), "memory_mb": round(peak / 2**20, 3)}


def claims_scale(tmp: Path, n: int, workers: int, procs: int) -> Dict[str, Any]:
    """Claims per second of ``workers`` simulated workers (``procs`` processes of ``workers / procs`` each) pulling
    ``n`` batches through the real protocol (``Claims.pull``: every worker walks every batch; done, claim,
    complete); each batch must be claimed exactly once. On 2 shared cores every worker's walk runs here; in a fleet
    each worker walks on its own host, and the store serves ``workers x batches`` look-ups."""
    root = Path(tempfile.mkdtemp(prefix=f"claims-scale-{n}-", dir=tmp))
    res = run_processes(_sim_workers, (str(root), n, workers // procs), procs, timeout_s=3600)
    got = sum(r[0] for r in res)
    assert got == n, f"{got} batches generated for {n}: a batch claimed twice or never"
    slowest = max(r[1] for r in res)
    return {"batches": n, "workers": workers, "processes": procs, "claims_per_s": round(n / slowest, 1),
            "seconds": round(slowest, 2), "store_lookups": workers * n, "one_worker_walk": _one_worker_walk(root, n)}


def scale(tmp: Path, workers: int, sizes: List[int], procs: int, batch_size: int) -> Dict[str, Any]:
    """Merge time and memory, and claims per second, at each of ``sizes`` items (``batch_size`` items a batch),
    ``workers`` workers."""
    out: Dict[str, Any] = {"workers": workers, "batch_size": batch_size, "merge": {}, "claims": {}}
    for n in sizes:
        out["merge"][str(n)] = _merge_subprocess(tmp, n, workers)
        print(f"merge {n} items / {workers} workers: final {out['merge'][str(n)]['final']['seconds']} s, one-shot "
              f"{out['merge'][str(n)]['oneshot']['seconds']} s", flush=True)
        out["claims"][str(n)] = {"items": n, **claims_scale(tmp, n // batch_size, workers, procs)}
        print(f"claims {n // batch_size} batches ({n} items) / {workers} workers: "
              f"{out['claims'][str(n)]['claims_per_s']}/s", flush=True)
    a, b = (str(x) for x in sizes[:2])
    out["growth"] = {f"{k}_{b}_over_{a}": round(v(b) / v(a), 2) for k, v in {
        "merge_final_s": lambda n: out["merge"][n]["final"]["seconds"],
        "merge_oneshot_s": lambda n: out["merge"][n]["oneshot"]["seconds"],
        "merge_final_memory": lambda n: out["merge"][n]["final"]["python_peak_mb"],
        "live_step_s": lambda n: out["merge"][n]["live_step_s"]["median"],
        "claims_s": lambda n: out["claims"][n]["seconds"]}.items()}
    out["growth"]["items"] = round(int(b) / int(a), 2)
    return out


# --------------------------------------------------------------------------------------------- kill verdicts
KILL_ARGS = ["platform=cpu", "cpu_threads=1", "dataset.limit=10", "model.generation.num_inference_steps=48"]
KILL_CLAIMS = ["parallelism=data", "parallelism.assign=claims", "parallelism.lease_s=3"]


def _hashes(d: Path) -> Dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((d / "images").glob("*.png"))}


def _verdict(d: Path, pid: Any, lost: List[str], code: int, ref: Dict[str, str], t0: float) -> Dict[str, Any]:
    m = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
    items = [json.loads(x) for x in (d / "items.jsonl").read_text().splitlines()] if (d / "items.jsonl").exists() \
        else []
    death = next((x for x in (m.get("claims") or {}).get("deaths") or [] if x.get("pid") == pid), None)
    v = {"killed_pid": pid, "held_when_killed": lost, "exit_code": code, "status": m.get("status"),
         "all_ok": len(items) == len(ref) and all(i.get("status") == "ok" for i in items),
         "byte_identical_to_one_worker": _hashes(d) == ref, "death_recorded": death,
         "lost_batches_recorded": bool(death) and set(lost) <= set(death.get("lost_batches") or []),
         "seconds": round(time.perf_counter() - t0, 1)}
    v["verdict"] = "pass" if (code == 0 and v["all_ok"] and v["byte_identical_to_one_worker"]
                              and v["lost_batches_recorded"]) else "fail"
    return v


def one_worker(tmp: Path) -> Dict[str, str]:
    """The reference of the kill and preemption verdicts: a one-process run of the same rows (``KILL_ARGS``); file
    name -> sha256 of its images."""
    d = tmp / "kill-single"
    if not (d / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "runner", *KILL_ARGS, f"hydra.run.dir={d}"], cwd=tmp, env=_env(),
                       capture_output=True, timeout=900, check=True)
    return _hashes(d)


def _fresh(d: Path) -> Path:
    """``d``, emptied: a run dir left by an earlier benchmark under the same ``--tmp`` would make the run resume."""
    import shutil

    shutil.rmtree(d, ignore_errors=True)
    return d


def _wait(p: subprocess.Popen, timeout_s: float = 900) -> int:
    """``p``'s exit code; killed (-9) when it runs past ``timeout_s``."""
    try:
        return p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        return -9


def kill_claims_process(tmp: Path, ref: Dict[str, str]) -> Dict[str, Any]:
    """Two claims workers started by hand on one run dir; one SIGKILLed mid-batch."""
    d = _fresh(tmp / "kill-claims")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "runner", *KILL_ARGS, *KILL_CLAIMS, f"hydra.run.dir={d}"],
                              cwd=tmp, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(2)]
    pid, lost = kill_mid_batch(d, lambda: [p.pid for p in procs if p.poll() is None])
    codes = [_wait(p) for p in procs]
    return _verdict(d, pid, lost, max(c for c in codes if c != -9) if pid else 1, ref, t0)


def kill_torchrun_rank(tmp: Path, ref: Dict[str, str]) -> Dict[str, Any]:
    """Two torchrun ranks (``--max-restarts=1``, claims); rank 1 SIGKILLed mid-batch (torchrun restarts the group)."""
    cwd = _fresh(tmp / "kill-torchrun")
    cwd.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--max-restarts=1", "-m", "runner", *KILL_ARGS, *KILL_CLAIMS], cwd=cwd, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def run_dir() -> Any:
        found = [x for x in (cwd / "outputs" / "runs").glob("*/*") if x.is_dir()]
        return found[0] if found else None

    while run_dir() is None and p.poll() is None:
        time.sleep(0.1)
    pid, lost = kill_mid_batch(run_dir(), lambda: worker_pids(run_dir(), rank=1))
    return _verdict(run_dir(), pid, lost, _wait(p), ref, t0)


#: ``launcher=ray`` as ``tests/test_ray_data.py`` runs it: two actors on a local Ray the driver starts.
KILL_RAY = ["parallelism=data", "launcher=ray", "launcher.num_workers=2", "parallelism.lease_s=3"]


def kill_ray_actor(tmp: Path, ref: Dict[str, str]) -> Dict[str, Any]:
    """A ``launcher=ray`` run (Ray Data actor pool of two, a local Ray); one actor process SIGKILLed mid-batch (Ray
    restarts it and retries its task; the actor that gets the batch takes the dead one's claim over)."""
    d = _fresh(tmp / "kill-ray")
    t0 = time.perf_counter()
    with open(tmp / "kill-ray.log", "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "runner", *KILL_ARGS, *KILL_RAY, f"hydra.run.dir={d}"], cwd=tmp,
                             env=_env(), stdout=log, stderr=subprocess.STDOUT)
        pid, lost = kill_mid_batch(d, lambda: worker_pids(d))
        code = _wait(p)
    v = _verdict(d, pid, lost, code, ref, t0)
    m = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
    v["ray"] = {k: (m.get("ray") or {}).get(k) for k in ("batches", "answered", "generated", "journaled")}
    v["scheduler"] = (m.get("parallelism") or {}).get("scheduler")
    return v


KILL_CASES = {"claims_process": kill_claims_process, "torchrun_rank": kill_torchrun_rank,
              "ray_actor": kill_ray_actor}


def kill_runs(tmp: Path, cases: List[str], ref: Dict[str, str]) -> Dict[str, Any]:
    """Each of ``cases`` (``KILL_CASES``): a worker SIGKILLed mid-batch (``runner.core.testing.kill_mid_batch``);
    the run's verdict against a one-worker run of the same rows."""
    out = {}
    for c in cases:
        out[c] = KILL_CASES[c](tmp, ref)
        print(f"kill {c}: {out[c]['verdict']} ({out[c]['seconds']} s)", flush=True)
    return out


# ---------------------------------------------------------------------------------------- preemption verdict
#: ``launcher=slurm`` as ``tests/test_slurm.py`` runs it: a job array of two tasks under submitit's LocalExecutor.
PREEMPT_SLURM = ["parallelism=data", "launcher=slurm", "launcher.executor=local", "launcher.num_workers=2",
                 "launcher.num_gpus_per_worker=0", "launcher.timeout_min=30", "parallelism.lease_s=300"]


def _ok_keys(journal: Path) -> List[str]:
    return [r["key"] for r in (json.loads(x) for x in journal.read_text().splitlines()) if r.get("status") == "ok"] \
        if journal.exists() else []


def _requeue(m: Dict[str, Any], d: Path, pid: int) -> Dict[str, Any]:
    """What became of task process ``pid`` after its signal: its requeue event, the process its job started next
    (same job, next attempt) and how that process's worker ended, the items ``pid`` journaled before it left."""
    tasks = (m.get("slurm") or {}).get("tasks") or []
    workers = {w.get("pid"): w for w in m.get("workers") or []}
    ev = next((t for t in tasks if t["event"] == "requeued" and t["pid"] == pid), None) or {}
    again = next((t for t in tasks if ev and t["event"] == "started" and t["job_id"] == ev["job_id"]
                  and t["attempt"] == ev["attempt"] + 1), None) or {}
    before = _ok_keys(d / f"items.rank{(workers.get(pid) or {}).get('rank')}.jsonl")
    return {"pid": pid, "job_id": ev.get("job_id"), "signal": ev.get("signal"), "requeued": bool(ev),
            "batch_unfinished": ev.get("batch_unfinished"), "status": (workers.get(pid) or {}).get("status"),
            "journaled_before_requeue": len(before), "requeued_pid": again.get("pid"),
            "requeued_status": (workers.get(again.get("pid")) or {}).get("status"), "_keys": before}


def preempt_slurm_task(tmp: Path, ref: Dict[str, str]) -> Dict[str, Any]:
    """A ``launcher=slurm`` run of two array tasks (submitit's LocalExecutor); one task sent SIGUSR2 mid-batch (the
    time limit), the other's job SIGTERM (preemption), as SLURM sends them (``runner.core.testing.
    preempt_two_tasks``); each requeued through submitit's checkpoint. The verdict: both requeued (a new process of
    the same job), each signalled task journaled its batch before leaving, the requeued processes completed the run
    from the journal (nothing journaled generated again: every item has one ``ok`` record over all the journals),
    every item ok, images byte-identical to a one-worker run."""
    d = _fresh(tmp / "preempt-slurm")
    t0 = time.perf_counter()
    with open(tmp / "preempt-slurm.log", "w") as log:
        p = subprocess.Popen([sys.executable, "-m", "runner", *KILL_ARGS, *PREEMPT_SLURM, f"hydra.run.dir={d}"],
                             cwd=tmp, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        usr2, term = preempt_two_tasks(d)
        code = _wait(p)
    m = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
    items = [json.loads(x) for x in (d / "items.jsonl").read_text().splitlines()] if (d / "items.jsonl").exists() \
        else []
    oks: Dict[str, int] = {}
    for j in d.glob("items.rank*.jsonl"):
        for k in _ok_keys(j):
            oks[k] = oks.get(k, 0) + 1
    tasks = {s: _requeue(m, d, pid) for s, pid in (("SIGUSR2", usr2), ("SIGTERM", term))}
    v = {"exit_code": code, "status": m.get("status"), "counts": m.get("counts"),
         "requeued": all(t["requeued"] and t["signal"] == s and t["requeued_pid"] not in (None, t["pid"])
                         for s, t in tasks.items()),
         "resumed_from_journal": all(t["requeued_status"] == "completed" and t["journaled_before_requeue"] > 0
                                     and all(oks.get(k) == 1 for k in t["_keys"]) for t in tasks.values()),
         "regenerated_journaled": sum(n - 1 for n in oks.values()),
         "all_ok": len(items) == len(ref) == len(oks) and all(i.get("status") == "ok" for i in items),
         "byte_identical_to_one_worker": _hashes(d) == ref,
         "tasks": {s: {k: x for k, x in t.items() if k != "_keys"} for s, t in tasks.items()},
         "slurm_results_exit_codes": [r.get("exit_code") for r in (m.get("slurm") or {}).get("results") or []],
         "seconds": round(time.perf_counter() - t0, 1)}
    v["verdict"] = "pass" if (code == 0 and v["requeued"] and v["resumed_from_journal"]
                              and v["regenerated_journaled"] == 0 and v["all_ok"]
                              and v["byte_identical_to_one_worker"]) else "fail"
    return v


def _git() -> Dict[str, Any]:
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":!benchmarks/results"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {"git_commit": git, "git_dirty": dirty}  # (the results this benchmark writes do not make the tree dirty)


def stragglers(tmp: Path, args: argparse.Namespace) -> Dict[str, Any]:
    """The straggler trials (static vs claims, alternated) and the claims rate of ``--racers`` processes."""
    trials: Dict[str, List[Dict[str, Any]]] = {"static": [], "claims": []}
    for t in range(args.repeats):  # alternated, so that a noisy neighbour on shared cores hits both alike
        for a in ("static", "claims"):
            trials[a].append(straggler(a, tmp / f"trial{t}", args.workers, args.factor, args.images))
    runs = {a: sorted(r, key=lambda x: x["ratio"])[len(r) // 2] for a, r in trials.items()}  # the median trial
    same = all(r["images_sha256"] == trials["static"][0]["images_sha256"] for rs in trials.values() for r in rs)
    for a in ("static", "claims"):
        r = runs[a]
        print(f"{a:>6}: makespan {r['makespan_s']:.1f} s, ideal {r['ideal_s']:.1f} s, ratio {r['ratio']:.2f}, "
              f"batches per rank {[w['batches'] for w in r['workers']]}, start-up {r['startup_s']:.1f} s, "
              f"exit {r['exit_code']}")
    return {"workers": args.workers, "slow_rank": args.workers - 1, "slow_factor": args.factor,
            "straggler_ratio": runs["claims"]["ratio"], "straggler_ratio_static": runs["static"]["ratio"],
            "makespan_s": runs["claims"]["makespan_s"], "makespan_s_static": runs["static"]["makespan_s"],
            "ratios_all_trials": {a: [r["ratio"] for r in rs] for a, rs in trials.items()},
            "images_identical_static_vs_claims": same,
            "runs": {a: {k: v for k, v in r.items() if k != "images_sha256"} for a, r in runs.items()}}


PARTS = ("straggler", "rate", "scale", "kill", "preempt")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--merge-case":  # one merge case, in its own process (its memory)
        print(json.dumps(merge_case(Path(sys.argv[4]), int(sys.argv[2]), int(sys.argv[3]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"which to run, of {','.join(PARTS)}; the figures of "
                   "the others are kept from --out")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--images", type=int, default=2, help="images per builtin caption (24 captions)")
    p.add_argument("--repeats", type=int, default=3, help="trials of each mode, alternated; the median is reported")
    p.add_argument("--claims", type=int, default=5000)
    p.add_argument("--racers", type=int, default=4)
    p.add_argument("--scale-workers", type=int, default=256)
    p.add_argument("--scale-items", default="10000,100000", help="item counts of the scale part (growth: 2nd/1st)")
    p.add_argument("--scale-processes", type=int, default=8, help="processes hosting the simulated claims workers")
    p.add_argument("--scale-batch-size", type=int, default=8, help="items per batch of the scale part's claims")
    p.add_argument("--kill-cases", default=",".join(KILL_CASES), help=f"the kill part's cases, of "
                   f"{','.join(KILL_CASES)}; the others keep their verdicts from --out")
    p.add_argument("--tmp", default=None, help="where the runs and the claims dirs go (default: a temp dir)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet_cpu.json"))
    args = p.parse_args()
    parts = [x for x in args.parts.split(",") if x]
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="fleet_cpu-")).resolve()
    tmp.mkdir(parents=True, exist_ok=True)
    res: Dict[str, Any] = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    res.update({"what": "issue 40: a straggler under the static deal vs claims (torchrun ranks on the CPU, "
                        "toy_shapes); claims per second of the POSIX claims store; the control plane at scale (merge "
                        "time and memory, claims per second, 256 simulated workers, 10k and 100k items); SIGKILL "
                        "verdicts (a claims worker, a torchrun rank, a Ray actor); the preemption verdict (a SLURM "
                        "array task under submitit's LocalExecutor: SIGUSR2 and SIGTERM, requeue, resume)",
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]), **_git(),
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}})
    kill_cases = [c for c in args.kill_cases.split(",") if c]
    bad = [c for c in kill_cases if c not in KILL_CASES]
    if bad:
        p.error(f"--kill-cases {','.join(bad)}: unknown; fix: some of {','.join(KILL_CASES)}")
    res.setdefault("parts_run", {}).update({x: res["git_commit"] for x in parts if x != "kill"})
    if "kill" in parts:  # each case's commit: the cases may be run apart
        res["parts_run"].update({f"kill.{c}": res["git_commit"] for c in kill_cases})
    def save() -> None:  # after each part: a later part that fails keeps the figures of the earlier ones
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")

    if "straggler" in parts:
        res.update(stragglers(tmp, args))
        save()
    if "rate" in parts:
        rate = claims_rate(tmp, args.claims, args.racers)
        res.update(claims_rate=rate, claims_per_s=rate[f"processes_{args.racers}"]["claims_per_s"],
                   claims_per_s_one_process=rate["processes_1"]["claims_per_s"])
        save()
    if "scale" in parts:
        sizes = [int(x) for x in args.scale_items.split(",")]
        sc = scale(tmp, args.scale_workers, sizes, args.scale_processes, args.scale_batch_size)
        res["scale"] = sc
        for n, name in ((sizes[0], "10k"), (sizes[-1], "100k")):
            res[f"merge_s_{name}"] = sc["merge"][str(n)]["final"]["seconds"]
            res[f"merge_oneshot_s_{name}"] = sc["merge"][str(n)]["oneshot"]["seconds"]
            res[f"merge_python_peak_mb_{name}"] = sc["merge"][str(n)]["final"]["python_peak_mb"]
            res[f"merge_oneshot_python_peak_mb_{name}"] = sc["merge"][str(n)]["oneshot"]["python_peak_mb"]
            res[f"claims_per_s_{name}_{args.scale_workers}_workers"] = sc["claims"][str(n)]["claims_per_s"]
        save()
    if "kill" in parts or "preempt" in parts:
        ref = one_worker(tmp)
    if "kill" in parts:
        res.setdefault("kill", {}).update(kill_runs(tmp, kill_cases, ref))
        res["kill_verdict"] = {k: v["verdict"] for k, v in res["kill"].items()}
        print(f"kill verdicts: {res['kill_verdict']}", flush=True)
        save()
    if "preempt" in parts:
        res.setdefault("preemption", {})["slurm_array_task"] = preempt_slurm_task(tmp, ref)
        res["preemption_verdict"] = {k: v["verdict"] for k, v in res["preemption"].items()}
        print(f"preemption verdicts: {res['preemption_verdict']}", flush=True)
    save()
    print(f"straggler_ratio {res.get('straggler_ratio')} (claims) vs {res.get('straggler_ratio_static')} (static); "
          f"claims_per_s {res.get('claims_per_s')}; merge_s_10k {res.get('merge_s_10k')}, merge_s_100k "
          f"{res.get('merge_s_100k')}; kill {res.get('kill_verdict')}; preemption {res.get('preemption_verdict')}")
    print(f"-> {args.out}")
    ok = all(v == "pass" for part, key in (("kill", "kill_verdict"), ("preempt", "preemption_verdict")) if part in parts
             for v in (res.get(key) or {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
