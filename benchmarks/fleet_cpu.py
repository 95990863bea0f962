"""Claims on the CPU (issue 40): a straggler under the static deal and under claims, side by side; claims per
second of the POSIX claims store.

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

Usage: ``python benchmarks/fleet_cpu.py [--workers 4] [--factor 4] [--images 2] [--claims 5000] [--racers 4]
[--out benchmarks/results/fleet_cpu.json]``. About 5 minutes on 2 CPU cores.
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
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.core.claims import Claims, PosixClaimStore, batch_id  # noqa: E402
from runner.core.testing import run_processes  # noqa: E402


def _env(slow: str) -> Dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), RUNNER_TEST_SLOW_WORKER=slow)
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--images", type=int, default=2, help="images per builtin caption (24 captions)")
    p.add_argument("--repeats", type=int, default=3, help="trials of each mode, alternated; the median is reported")
    p.add_argument("--claims", type=int, default=5000)
    p.add_argument("--racers", type=int, default=4)
    p.add_argument("--tmp", default=None, help="where the runs and the claims dirs go (default: a temp dir)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet_cpu.json"))
    args = p.parse_args()
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="fleet_cpu-")).resolve()
    tmp.mkdir(parents=True, exist_ok=True)

    trials: Dict[str, List[Dict[str, Any]]] = {"static": [], "claims": []}
    for t in range(args.repeats):  # alternated, so that a noisy neighbour on shared cores hits both alike
        for a in ("static", "claims"):
            trials[a].append(straggler(a, tmp / f"trial{t}", args.workers, args.factor, args.images))
    runs = {a: sorted(r, key=lambda x: x["ratio"])[len(r) // 2] for a, r in trials.items()}  # the median trial
    same = all(r["images_sha256"] == trials["static"][0]["images_sha256"] for rs in trials.values() for r in rs)
    rate = claims_rate(tmp, args.claims, args.racers)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    res = {
        "what": "issue 40: a straggler under the static deal vs claims (torchrun ranks on the CPU, toy_shapes), and "
                "claims per second of the POSIX claims store",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "git_commit": git, "git_dirty": dirty,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "workers": args.workers, "slow_rank": args.workers - 1, "slow_factor": args.factor,
        "straggler_ratio": runs["claims"]["ratio"], "straggler_ratio_static": runs["static"]["ratio"],
        "claims_per_s": rate[f"processes_{args.racers}"]["claims_per_s"],
        "claims_per_s_one_process": rate["processes_1"]["claims_per_s"],
        "makespan_s": runs["claims"]["makespan_s"], "makespan_s_static": runs["static"]["makespan_s"],
        "ratios_all_trials": {a: [r["ratio"] for r in rs] for a, rs in trials.items()},
        "images_identical_static_vs_claims": same,
        "runs": {a: {k: v for k, v in r.items() if k != "images_sha256"} for a, r in runs.items()},
        "claims_rate": rate,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    for a in ("static", "claims"):
        r = runs[a]
        print(f"{a:>6}: makespan {r['makespan_s']:.1f} s, ideal {r['ideal_s']:.1f} s, ratio {r['ratio']:.2f}, "
              f"batches per rank {[w['batches'] for w in r['workers']]}, start-up {r['startup_s']:.1f} s, "
              f"exit {r['exit_code']}")
    print(f"straggler_ratio {res['straggler_ratio']} (claims) vs {res['straggler_ratio_static']} (static), medians "
          f"of {res['ratios_all_trials']}; images identical: {same}")
    print(f"claims_per_s {res['claims_per_s']} ({args.racers} processes), {res['claims_per_s_one_process']} (one)")
    print(f"-> {args.out}")
    return 0 if all(r["exit_code"] == 0 for r in runs.values()) and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
