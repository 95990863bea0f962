"""A data-parallel run's ``accuracy`` is the run's, not rank 0's: the merge recomputes the oracle's section from the
union of the workers' per-item entries (``models.oracles.merged_section``), so it equals a one-worker run's section
of the same rows; an item two workers scored counts once; a worker manifest missing makes the section say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import console_lines, summary_lines
from models.oracles import merged_section, union_entries
from models.toy_edit import oracle as edit
from models.toy_motion import oracle as motion
from models.toy_shapes import oracle as shapes

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parent.parent
NONE = {"color": None, "shape": None, "position": None}
RED = {"color": "red", "shape": "circle", "position": "center"}


def test_union_counts_an_item_scored_by_two_workers_once_with_its_ok_read():
    # worker 0 scored a (failed: all None) and b; worker 1 retried a (ok) and scored c
    w0 = shapes.section({"a": NONE, "b": RED}, {"a": RED, "b": RED})
    w1 = shapes.section({"a": RED, "c": NONE}, {"a": RED, "c": {"color": "blue"}})
    merged = merged_section([w0, w1], ["c", "b", "a"])
    assert merged == shapes.section({"c": NONE, "b": RED, "a": RED}, {"c": {"color": "blue"}, "b": RED, "a": RED})
    assert merged["n"] == 3 and merged["all"] == pytest.approx(2 / 3) and merged["color"] == pytest.approx(2 / 3)
    assert list(merged["read"]) == ["c", "b", "a"]  # dataset order
    # the order of the workers does not change which read counts
    assert merged_section([w1, w0], ["c", "b", "a"]) == merged
    assert union_entries([w0, w0])["read"] == w0["read"]


def test_union_keeps_toy_edit_prompts_and_by_instruction():
    rows = {"a": ("make it blue", {"color": "blue", "shape": "circle", "position": "center"}),
            "b": ("make it a square", {"color": "red", "shape": "square", "position": "center"})}
    got = {"a": {"color": "blue", "shape": "circle", "position": "center"}, "b": RED}
    parts = [edit.section({k: got[k]}, {k: rows[k][1]}, {k: rows[k][0]}) for k in rows]
    whole = edit.section(got, {k: e for k, (_, e) in rows.items()}, {k: p for k, (p, _) in rows.items()})
    assert merged_section(parts, ["a", "b"]) == whole
    assert whole["by_instruction"]["shape"] == {"n": 1, "instructed": 0.0, "kept": 1.0} and whole["n"] == 2


def test_union_of_toy_motion_sections_reads_direction():
    exp = {"a": {"color": "red", "direction": "left"}, "b": {"shape": "circle"}}
    got = {"a": {"color": "red", "shape": "square", "direction": "left"}, "b": dict(motion.NONE)}
    whole = motion.section(got, exp)
    assert merged_section([motion.section({k: got[k]}, {k: exp[k]}) for k in ("b", "a")], ["a", "b"]) == whole
    assert (whole["oracle"], whole["n"], whole["direction"], whole["shape"], whole["all"]) == ("toy_motion", 2, 1.0,
                                                                                               0.0, 0.5)


def test_a_missing_worker_manifest_is_said_not_hidden():
    w0 = shapes.section({"a": RED}, {"a": RED})
    merged = merged_section([w0], ["a", "b"], ["worker 1's manifest is missing"])
    assert merged == {"oracle": "toy_shapes", "incomplete": "worker 1's manifest is missing"}
    old = {k: v for k, v in w0.items() if k != "expect"}  # a section of before the per-item expectations
    assert "no per-item entries" in merged_section([old], ["a"])["incomplete"]
    assert merged_section([], ["a"]) is None


def _run(args, env, cwd, torchrun):
    env = dict(env, PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner"] if torchrun
           else [sys.executable, "-m", "runner"])
    p = subprocess.run(cmd + ["platform=cpu", "dataset.limit=6"] + list(args), cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p


@pytest.fixture(scope="module")
def one_worker(runner_cache, tmp_path_factory):
    """The accuracy section of a one-worker run of the same 6 rows (environment as ``conftest.subprocess_env``)."""
    one = tmp_path_factory.mktemp("one") / "run"
    env = dict(os.environ, RUNNER_CACHE=str(runner_cache), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    _run([f"hydra.run.dir={one}"], env, one.parent, torchrun=False)
    return json.loads((one / "manifest.json").read_text())["accuracy"]


@pytest.mark.parametrize("assign", ["static", "claims"])
def test_two_worker_merged_accuracy_equals_a_one_worker_run(subprocess_env, tmp_path, assign, one_worker):
    two = tmp_path / "two"
    p = _run(["parallelism=data", f"parallelism.assign={assign}", f"hydra.run.dir={two}"], subprocess_env, tmp_path,
             torchrun=True)
    single = one_worker
    merged = json.loads((two / "manifest.json").read_text())["accuracy"]
    ranks = [json.loads((two / f"manifest.rank{r}.json").read_text()) for r in (0, 1)]
    own = [set((d.get("accuracy") or {}).get("read") or {}) for d in ranks]
    assert all(own) and not own[0] & own[1], own  # each worker scored a part of the run's items
    assert merged["n"] == 6 and set(merged["read"]) == own[0] | own[1]
    assert merged == single, (merged, single)
    summary = summary_lines(console_lines(p.stdout + p.stderr))
    assert len(summary) == 1 and f"(n 6) -> {two}" in summary[0], summary


def test_the_merge_says_which_worker_is_missing_and_skips_workers_without_expectations():
    from runner.core.distributed import merged_accuracy

    w0 = {"status": "completed", "accuracy": shapes.section({"a": RED}, {"a": RED})}
    assert merged_accuracy([w0, None], ["a", "b"], None, 0, "static") == {
        "oracle": "toy_shapes", "incomplete": "worker 1's manifest is missing"}
    crashed = {"status": "crashed"}
    assert "worker 1 ended 'crashed'" in merged_accuracy([w0, crashed], ["a", "b"], None, 0, "static")["incomplete"]
    no_rows = {"status": "completed"}  # its items carried no expect: nothing of its to score
    assert merged_accuracy([w0, no_rows], ["a", "b"], None, 0, "static")["n"] == 1
    assert "1 items no worker journaled" in merged_accuracy([w0, no_rows], ["a", "b"], None, 1, "claims")["incomplete"]
    assert merged_accuracy([no_rows, no_rows], ["a"], None, 0, "static") is None
