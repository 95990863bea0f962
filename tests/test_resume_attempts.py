"""A resume keeps the provenance of every attempt that wrote the run's items (docs/resume.md, docs/provenance.md).

Each item record carries the ``run_id`` of the attempt that wrote it; the manifest's ``resumed_from.attempts`` keeps
every earlier attempt's git state, packages, evidence and counts, oldest first; ``items_by_attempt`` says which
attempt wrote how many of the run's items. A re-run that reuses everything does not take over the artifacts'
provenance: its own ``git`` and ``evidence`` describe it, the earlier attempt's are kept.

The runs are real ``python -m runner`` processes (the trained ``toy_shapes`` default, a few 64 px images) of a copy
of this checkout under ``tmp_path`` that is its own git repository, so the tree can be clean for one attempt and
dirty for the next (``runner.core.manifest.git_state`` reads the checkout the runner is imported from).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of this checkout's code (``runner``, ``conf``; ``models`` linked) as a fresh git repo, clean."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("runner", "conf"):
        shutil.copytree(REPO_ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "models").symlink_to(REPO_ROOT / "models")
    shutil.copy(REPO_ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "NOTES.md").write_text("clean\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "snapshot")
    return repo


def _run(repo: Path, run_dir: Path, env: Dict[str, str], *overrides: str) -> Dict[str, Any]:
    """``python -m runner`` of ``repo`` into ``run_dir``; returns its manifest (the run must exit 0)."""
    env = dict(env, PYTHONPATH=str(repo))
    p = subprocess.run([sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", *overrides], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return json.loads((run_dir / "manifest.json").read_text())


def _items(run_dir: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "items.jsonl").read_text().splitlines() if line.strip()]


def _dirty(repo: Path) -> None:
    (repo / "NOTES.md").write_text("edited after the commit\n")


def test_full_rerun_on_a_dirty_tree_keeps_the_first_attempts_provenance(checkout, subprocess_env, tmp_path):
    """Kills: a re-run that reuses every item rewriting the artifacts' provenance with its own (git dirty,
    evidence not_collected) and keeping only the last run_id; items that do not name the attempt that wrote them."""
    d = tmp_path / "run"
    first = _run(checkout, d, subprocess_env, "dataset.limit=2")
    assert first["git"] == {"commit": _git(checkout, "rev-parse", "HEAD"), "dirty": False}
    assert first["evidence"]["verdict"] == "verified"
    assert [r["run_id"] for r in _items(d)] == [first["run_id"]] * 2
    assert first["items_by_attempt"] == [{"run_id": first["run_id"], "current": True, "items": 2,
                                          "status": "completed", "git": first["git"], "evidence": "verified"}]

    _dirty(checkout)
    again = _run(checkout, d, subprocess_env, "dataset.limit=2")
    assert again["counts"]["reused"] == 2 and again["counts"]["ok"] == 0
    assert again["git"]["dirty"] is True  # the re-run's own tree ...
    assert again["evidence"]["verdict"] == "not_collected"  # ... and evidence: it generated nothing
    assert "resumed_from.attempts" in again["evidence"]["reason"]
    # ... while the artifacts keep the attempt that produced them, with its clean tree and verified evidence
    assert [r["run_id"] for r in _items(d)] == [first["run_id"]] * 2
    rf = again["resumed_from"]
    assert (rf["run_id"], rf["status"], rf["reused_items"], rf["forced"]) == (first["run_id"], "completed", 2, False)
    [a] = rf["attempts"]
    assert a["run_id"] == first["run_id"] and a["status"] == "completed"
    assert a["git"] == first["git"] and a["git"]["dirty"] is False
    assert a["evidence"]["verdict"] == first["evidence"]["verdict"] == "verified"
    assert a["evidence"]["stages"] == {s: st["checks"] for s, st in first["evidence"]["stages"].items()}
    assert a["packages"] == first["packages"]
    assert (a["started_at"], a["ended_at"], a["counts"]) == (first["started_at"], first["ended_at"], first["counts"])
    assert a["items"] == 2
    assert again["items_by_attempt"] == [
        {"run_id": first["run_id"], "items": 2, "status": "completed", "git": first["git"], "evidence": "verified"},
        {"run_id": again["run_id"], "current": True, "items": 0, "status": "completed", "git": again["git"],
         "evidence": "not_collected"}]
    # the report's evidence cell says it too, as the console's last line does
    from runner.tools.report import load_jobs, render

    commit = first["git"]["commit"][:7]
    said = f"items by attempt: 2 by {first['run_id'][:8]} (verified, git {commit}), 0 by this attempt (not_collected)"
    assert said in render(load_jobs([d]))


def test_partial_resumes_record_which_attempt_wrote_each_item(checkout, subprocess_env, tmp_path):
    """``dataset.limit=1`` on a clean tree, then ``limit=2`` and ``limit=3`` on a dirty one: each item names the
    attempt that wrote it, and the third attempt's ``resumed_from.attempts`` holds both earlier ones, in order, the
    first with its clean tree. Kills: an attempts chain of the last run only, or none; items without run_id."""
    d = tmp_path / "run"
    a1 = _run(checkout, d, subprocess_env, "dataset.limit=1")
    _dirty(checkout)
    a2 = _run(checkout, d, subprocess_env, "dataset.limit=2")
    assert (a2["counts"]["ok"], a2["counts"]["reused"]) == (1, 1)
    assert [r["run_id"] for r in _items(d)] == [a1["run_id"], a2["run_id"]]
    assert [(a["run_id"], a["git"], a["evidence"]["verdict"]) for a in a2["resumed_from"]["attempts"]] == [
        (a1["run_id"], {"commit": a1["git"]["commit"], "dirty": False}, "verified")]

    a3 = _run(checkout, d, subprocess_env, "dataset.limit=3")
    assert (a3["counts"]["ok"], a3["counts"]["reused"]) == (1, 2)
    assert [r["run_id"] for r in _items(d)] == [a1["run_id"], a2["run_id"], a3["run_id"]]
    chain = a3["resumed_from"]["attempts"]
    assert [a["run_id"] for a in chain] == [a1["run_id"], a2["run_id"]]  # oldest first
    assert chain[0]["git"] == a1["git"] and a1["git"]["dirty"] is False
    assert chain[1]["git"] == a2["git"] and a2["git"]["dirty"] is True
    assert [a["evidence"]["verdict"] for a in chain] == [a1["evidence"]["verdict"], a2["evidence"]["verdict"]]
    assert [a["counts"] for a in chain] == [a1["counts"], a2["counts"]]
    assert [a["items"] for a in chain] == [1, 1]
    assert a3["resumed_from"]["run_id"] == a2["run_id"]  # the existing keys: the last attempt
    assert [(e["run_id"], e["items"]) for e in a3["items_by_attempt"]] == [
        (a1["run_id"], 1), (a2["run_id"], 1), (a3["run_id"], 1)]


def test_a_dir_written_before_items_carried_run_ids_still_resumes(subprocess_env, tmp_path):
    """An earlier run whose records have no ``run_id`` and whose manifest resumed a run without keeping its
    attempts: reused all the same, its items counted under ``run_id: null`` (unknown), and the run it had resumed
    kept as an attempt with what it recorded. Kills: a resume that drops or miscounts such records."""
    d = tmp_path / "run"
    env = dict(subprocess_env, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "runner", f"hydra.run.dir={d}", "dataset.limit=2"]
    assert subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=600).returncode == 0
    old = json.loads((d / "manifest.json").read_text())
    (d / "items.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "run_id"}) + "\n"
                                           for r in _items(d)))
    old["resumed_from"] = {"run_id": "0" * 32, "status": "interrupted", "reused_items": 0, "forced": False}
    old.pop("items_by_attempt", None)
    (d / "manifest.json").write_text(json.dumps(old))
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"]["reused"] == 2
    assert all("run_id" not in r for r in _items(d))  # reused as they were, nothing claimed for them
    assert [(a["run_id"], a["status"]) for a in m["resumed_from"]["attempts"]] == [
        ("0" * 32, "interrupted"), (old["run_id"], "completed")]
    assert "note" in m["resumed_from"]["attempts"][0] and m["resumed_from"]["attempts"][1]["items"] == 0
    assert [(e["run_id"], e["items"]) for e in m["items_by_attempt"]] == [(m["run_id"], 0), (None, 2)]
    assert "items by attempt: 0 by this attempt (not_collected), 2 by an unknown attempt" in p.stderr + p.stdout


def test_a_data_parallel_resume_keeps_the_attempts_and_each_workers_run_id(subprocess_env, tmp_path):
    """Two torchrun ranks, ``dataset.limit=2`` then ``limit=4`` into the same dir: each merged item names the
    worker (run_id) that wrote it, the merged manifest keeps the first attempt with both its workers and its
    merged evidence and counts, and ``items_by_attempt`` counts both attempts. Kills: a merge that drops the
    attempts chain, worker run_ids missing from ``workers[]``, items counted to no attempt."""
    d = tmp_path / "dp"
    env = dict(subprocess_env, PYTHONPATH=str(REPO_ROOT))
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "RUNNER_TEST_SLOW_WORKER"):
        env.pop(k, None)
    merged = []
    for limit in (2, 4):
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner",
                            "parallelism=data", f"dataset.limit={limit}", f"hydra.run.dir={d}"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        merged.append(json.loads((d / "manifest.json").read_text()))
    first, second = merged
    w1 = [w["run_id"] for w in first["workers"]]
    w2 = [w["run_id"] for w in second["workers"]]
    assert len(set(w1 + w2)) == 4 and w1[0] == first["run_id"] and w2[0] == second["run_id"]
    writers = [r["run_id"] for r in _items(d)]
    assert set(writers[:2]) == set(w1) and set(writers[2:]) == set(w2)  # dealt over the ranks, one item each
    [a] = second["resumed_from"]["attempts"]
    assert a["run_id"] == first["run_id"] and [w["run_id"] for w in a["workers"]] == w1
    assert a["evidence"]["verdict"] == first["evidence"]["verdict"] == "verified"
    assert a["counts"] == first["counts"] and a["status"] == first["status"] == "completed"
    assert a["git"] == first["git"] and a["items"] == 2
    assert [(e["run_id"], e["items"], e.get("current", False)) for e in second["items_by_attempt"]] == [
        (first["run_id"], 2, False), (second["run_id"], 2, True)]
