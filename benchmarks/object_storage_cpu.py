"""Object storage on the CPU (issue 40): a run reading its rows from and writing its artifacts to an S3-compatible
server on the loopback (moto's server mode, ``runner.core.testing.s3_server``; s3fs as the client), a write SIGKILLed
between a temp object's upload and its publication, the resume from the URL, and ``runner.repro`` of the URL.

Recorded under ``object_storage`` in ``--out`` (default ``benchmarks/results/fleet_cpu.json``; the file's other
keys are kept): each step's exit code and wall seconds, ``publish_s`` (the run's ``timing.write_s``: encode, local
write and publication), and the checks behind ``verdict`` (``ok`` when all hold): every record at the URL names an
object with the recorded sha256; after the kill no record (local or remote) names the object being published and
its final key does not exist; the resume completes, removes the temp object and reuses what was published; the
repro of the URL is byte-identical.

Usage: ``python benchmarks/object_storage_cpu.py [--rows 8] [--out benchmarks/results/fleet_cpu.json]``. About two
minutes on 2 CPU cores (needs the ``storage`` and ``s3-server`` extras).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runner.core.testing import PUBLISH_PAUSE, s3_server  # noqa: E402

BUCKET = "bench"
COLORS, SHAPES = ("red", "green", "blue"), ("circle", "square", "triangle")


def _fs() -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def _cmd(url: str, rows: str, stage: Path) -> List[str]:
    return [sys.executable, "-m", "runner", "platform=cpu", "cpu_threads=1", "dataset=jsonl", f"dataset.path={rows}",
            f"output.dir={url}", f"hydra.run.dir={stage}"]


def _records_match(url: str) -> Dict[str, Any]:
    """The records at ``url`` and whether each names an object with its sha256."""
    fs, root = _fs(), url[len("s3://"):]
    if not fs.exists(f"{root}/items.jsonl"):
        return {"records": 0, "all_match": True, "files": []}
    recs = [json.loads(x) for x in fs.cat_file(f"{root}/items.jsonl").decode().splitlines() if x.strip()]
    ok = all(fs.exists(f"{root}/{r['file']}") and hashlib.sha256(fs.cat_file(f"{root}/{r['file']}")).hexdigest()
             == r["file_sha256"] for r in recs)
    return {"records": len(recs), "all_match": ok, "files": [r["file"] for r in recs]}


def _timed(cmd: List[str], cwd: Path, env: Dict[str, str]) -> Dict[str, Any]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    return {"exit_code": p.returncode, "wall_s": round(time.perf_counter() - t0, 2), "stderr_tail": p.stderr[-400:]}


def _killed(url: str, rows: str, tmp: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """A run SIGKILLed while its first artifact's temp object waits for publication, then the same command."""
    marker = tmp / "paused"
    p = subprocess.Popen(_cmd(url, rows, tmp / "killed1"), cwd=tmp, env={**env, PUBLISH_PAUSE: str(marker)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    rel = marker.read_text() if marker.exists() else None
    fs, root = _fs(), url[len("s3://"):]
    local = (tmp / "killed1" / "items.jsonl")
    local_files = [json.loads(x).get("file") for x in local.read_text().splitlines()] if local.exists() else []
    after = _records_match(url)
    out = {"paused_at": rel, "final_object_visible": bool(rel) and fs.exists(f"{root}/{rel}"),
           "temp_objects": len([x for x in fs.find(root) if "/." in x]),
           "record_names_it": rel in local_files or rel in after["files"], "records_match_objects": after["all_match"]}
    out["resume"] = _timed(_cmd(url, rows, tmp / "killed2"), tmp, env)
    m = json.loads(fs.cat_file(f"{root}/manifest.json"))
    out["resume"].update(status=m["status"], counts=m["counts"], pulled=m["storage"]["pulled"],
                         temp_objects_after=len([x for x in fs.find(root) if "/." in x]),
                         records_match_objects=_records_match(url)["all_match"])
    return out


def scenario(n_rows: int, tmp: Path, env: Dict[str, str]) -> Dict[str, Any]:
    """The run, the repro and the killed write (module docstring)."""
    fs = _fs()
    fs.mkdir(BUCKET)
    rows = b"".join(json.dumps({"id": f"r{i}", "prompt": f"a {COLORS[i % 3]} {SHAPES[i // 3 % 3]} in the center on "
                                                          "a white background"}).encode() + b"\n" for i in range(n_rows))
    fs.pipe_file(f"{BUCKET}/data/rows.jsonl", rows)
    src = f"s3://{BUCKET}/data/rows.jsonl"
    url = f"s3://{BUCKET}/run"
    run = _timed(_cmd(url, src, tmp / "stage"), tmp, env)
    m = json.loads(fs.cat_file(f"{BUCKET}/run/manifest.json"))
    run.update(status=m["status"], items=m["counts"]["ok"], publish_s=m["timing"]["write_s"],
               records_match_objects=_records_match(url)["all_match"])
    repro = _timed([sys.executable, "-m", "runner.repro", url, "--out", str(tmp / "rerun")], tmp, env)
    check = json.loads((tmp / "rerun" / "repro_check.json").read_text()) if (tmp / "rerun").is_dir() else {}
    repro.update(ok=check.get("ok"), mode=check.get("mode"), items=len(check.get("items") or []))
    killed = _killed(f"s3://{BUCKET}/killed", src, tmp, env)
    checks = {"run_records_match_objects": run["exit_code"] == 0 and run["records_match_objects"],
              "repro_byte_identical": repro["exit_code"] == 0 and bool(repro["ok"]) and repro["mode"] == "bytes",
              "killed_write_not_recorded": killed["paused_at"] is not None and not killed["record_names_it"]
              and not killed["final_object_visible"] and killed["records_match_objects"],
              "resume_completes": killed["resume"]["exit_code"] == 0 and killed["resume"]["status"] == "completed"
              and killed["resume"]["temp_objects_after"] == 0 and killed["resume"]["records_match_objects"]}
    for step in (run, repro, killed["resume"]):
        step.pop("stderr_tail") if step["exit_code"] == 0 else None
    return {"verdict": "ok" if all(checks.values()) else "failed", "checks": checks, "rows": n_rows, "run": run,
            "repro": repro, "killed_mid_object": killed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/fleet_cpu.json")
    a = ap.parse_args()
    server = s3_server()
    env = dict(os.environ, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL_S3=server.endpoint, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                           "AWS_ENDPOINT_URL_S3")})
    from importlib.metadata import version

    try:
        with tempfile.TemporaryDirectory() as tmp:
            res = scenario(a.rows, Path(tmp), env)
    finally:
        server.stop()
    res.update(command=" ".join(sys.argv), server=f"moto {version('moto')} (server mode, loopback)",
               client=f"s3fs {version('s3fs')}", git_commit=subprocess.run(
                   ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip())
    doc = json.loads(a.out.read_text()) if a.out.exists() else {}
    doc["object_storage"] = res
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("verdict", "checks")}, indent=2))
    return 0 if res["verdict"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
