"""The quality gate's command line (``python -m runner.gate``, :mod:`runner.tools.gate`) over a real sweep dir
(issue 29, "tests that catch wrong runs").

One real CPU sweep through ``python -m runner -m`` on the trained toy_shapes (4 rows): ``seed=1,0`` x
``batch_size=1,2`` x ``cache={none},{taylorseer}``, so every lossy job has several lossless jobs beside it: one of
the same rows and batch size (its twin), one of the same rows at the other batch size, and two of other rows (the
other seed), which come first in job order. The sweep runs the gate itself at its end (``gate.json``).

* **Pairing**: each lossy job is gated against the lossless job of its seed (the same rows) *and* its batch size,
  never the first lossless job of the sweep nor the first of its rows; the expected twin is derived from the
  job manifests' config, and the pixels agree (a wrong twin of another seed shows as a low PSNR).
* **--min-ratio** from the command line decides the verdict: a floor equal to the measured ratio passes
  (``>=``), a floor just above it fails every lossy job (exit 1, the reason names the CLI floor), and gate.json
  records the floor given; the sweep's own ``gate.json`` is never replaced by a hand run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest

from _helpers import run_module

SWEEP = ["model=toy_shapes", "platform=cpu", "dataset.limit=4", "seed=1,0", "batch_size=1,2",
         "cache={method:none},{method:taylorseer,compute_every:2,warmup_steps:3}"]




@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gate_sweep")
    p = run_module("runner", ["-m", *SWEEP, f"hydra.sweep.dir={root / 'sweep'}"], cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return root / "sweep"


def _records(job_dir: Path) -> Dict[str, Dict[str, Any]]:
    return {r["key"]: r for r in map(json.loads, (job_dir / "items.jsonl").read_text().splitlines())}


def _jobs(sweep: Path) -> Dict[str, Dict[str, Any]]:
    """Job name -> {seed, batch_size, lossy} from its manifest."""
    out = {}
    for d in sorted(p for p in sweep.iterdir() if (p / "manifest.json").is_file()):
        m = json.loads((d / "manifest.json").read_text())
        out[d.name] = {"seed": m["config"]["seed"], "batch_size": m["config"]["batch_size"],
                       "lossy": m["lossy"]["lossy"]}
    return out


def test_each_lossy_job_is_gated_against_the_lossless_job_of_its_rows_and_batch_size(sweep, capsys):
    from runner.tools import gate

    jobs = _jobs(sweep)
    lossless = [k for k, j in jobs.items() if not j["lossy"]]
    lossy = [k for k, j in jobs.items() if j["lossy"]]
    assert len(lossless) == len(lossy) == 4
    # the setting this test is about: before each lossy job's twin the sweep holds lossless jobs of other rows
    # (seed) or another batch size, so "the first lossless job" or "the first of the same rows" is a wrong twin
    twin = {k: next(n for n in lossless if (jobs[n]["seed"], jobs[n]["batch_size"])
                    == (jobs[k]["seed"], jobs[k]["batch_size"])) for k in lossy}
    assert sorted(set(twin.values())) == sorted(lossless)
    assert any(lossless.index(t) > 0 for t in twin.values())
    assert any(next(n for n in lossless if jobs[n]["seed"] == jobs[k]["seed"]) != t for k, t in twin.items())

    sweeps_gate = (sweep / "gate.json").read_bytes()
    code = gate.main([str(sweep)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (sweep / "gate.json").read_bytes() == sweeps_gate  # the hand run wrote beside it
    doc = json.loads((sweep / "gate.cli.json").read_text())
    assert doc["verdict"] == "pass" and sorted(doc["lossless_jobs"]) == sorted(lossless)
    by = {e["lossy_job"]: e for e in doc["jobs"]}
    assert sorted(by) == sorted(lossy)
    for k in lossy:
        e = by[k]
        assert e["lossless_job"] == twin[k], (k, e["lossless_job"], twin[k])
        assert e["lossless_path"] == str(sweep / twin[k])
        assert e["batch_size"] == {"lossy": jobs[k]["batch_size"], "lossless": jobs[k]["batch_size"]}
        assert "note" not in e, e["note"]  # a twin of the same batch size needs no note
        assert e["verdict"] == "pass" and len(e["items"]) == 4
        assert all(i["psnr_db"] > 30 for i in e["items"]), e["items"]  # the same rows: close pixels
        assert f"vs {twin[k]}" in next(line for line in out.splitlines() if line.split()[1:2] == [k])

    # the pixels say the same: against a lossless job of the other seed every image differs far more
    other = {k: next(n for n in lossless if jobs[n]["seed"] != jobs[k]["seed"]
                     and jobs[n]["batch_size"] == jobs[k]["batch_size"]) for k in lossy}
    for k in lossy:
        mine, theirs = _records(sweep / k), _records(sweep / other[k])
        for key in mine:
            wrong = gate.item_metrics(sweep / k / mine[key]["file"], sweep / other[k] / theirs[key]["file"])
            assert wrong["psnr_db"] < by[k]["psnr_db"]["min"], (k, key, wrong, by[k]["psnr_db"])


def test_min_ratio_from_the_command_line_decides_the_verdict(sweep, tmp_path):
    """``--min-ratio`` is what the verdict is measured against: the measured ratio itself passes (the floor is
    inclusive), a floor just above it fails every lossy job with exit 1 and a reason naming that floor; a run
    that ignored the CLI value (the 0.97 default) would pass both."""
    from runner.tools import gate

    assert gate.main([str(sweep), "--out", str(tmp_path / "default.json")]) == 0
    base = json.loads((tmp_path / "default.json").read_text())
    assert base["min_ratio"] == gate.MIN_RATIO
    ratios = [a["ratio"] for e in base["jobs"] for a in e["accuracy"].values()]
    assert ratios and all(r is not None for r in ratios)
    top = max(ratios)
    assert top > gate.MIN_RATIO  # so a floor above it differs from the default's verdict
    lowest = min(ratios)

    # at the lowest measured ratio every job passes (the floor is inclusive) and the document records the floor
    assert gate.main([str(sweep), "--min-ratio", str(lowest), "--out", str(tmp_path / "at.json")]) == 0
    at = json.loads((tmp_path / "at.json").read_text())
    assert at["min_ratio"] == lowest and at["verdict"] == "pass"
    assert all(e["verdict"] == "pass" and e["min_ratio"] == lowest for e in at["jobs"])

    # just above the highest ratio: every lossy job fails, through the real command line
    floor = round(top + 0.001, 4)
    p = run_module("runner.gate", [sweep, "--min-ratio", floor, "--out", tmp_path / "above.json"], cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    above = json.loads((tmp_path / "above.json").read_text())
    assert above["min_ratio"] == floor and above["verdict"] == "fail" and above["exit_code"] == 1
    assert len(above["jobs"]) == len(base["jobs"])
    for e in above["jobs"]:
        assert e["verdict"] == "fail" and e["min_ratio"] == floor
        assert e["reasons"] and all(f"needs >= {floor:g}" in r for r in e["reasons"]), e["reasons"]
        assert {k: a["pass"] for k, a in e["accuracy"].items()} == {k: False for k in e["accuracy"]}
    assert p.stdout.count("FAIL") == len(above["jobs"]) and f"gate: fail -> {tmp_path / 'above.json'}" in p.stdout
