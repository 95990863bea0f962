"""The mutation score on record (``benchmarks/results/mutation.json``) names commits of this history (issue 42): its
``commit`` and the commit of every group run must be ancestors of HEAD (``git merge-base --is-ancestor``), so a
rewritten history cannot leave a score that no tree of it has. CPU only, no mutation run; skipped (with the reason)
outside a git checkout, or in a shallow clone that lacks the commit."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULT = REPO / "benchmarks" / "results" / "mutation.json"


def _git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def not_ancestors(commits: List[str], cwd: Path = REPO) -> List[str]:
    """The commits of ``commits`` that are not ancestors of HEAD in the checkout at ``cwd``, each with why (not an
    ancestor; not in this repository). Skips the test where that cannot be told (no git, not a checkout, a shallow
    clone without the commit)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the ancestry of the mutation result cannot be checked")
    if _git("rev-parse", "--is-inside-work-tree", cwd=cwd).stdout.strip() != "true":
        pytest.skip(f"{cwd} is not a git checkout (an sdist or a copy): the ancestry cannot be checked")
    shallow = _git("rev-parse", "--is-shallow-repository", cwd=cwd).stdout.strip() == "true"
    bad = []
    for c in commits:
        if _git("cat-file", "-e", f"{c}^{{commit}}", cwd=cwd).returncode != 0:
            if shallow:
                pytest.skip(f"shallow clone: commit {c} is not fetched (git fetch --unshallow to check it)")
            bad.append(f"{c}: not a commit of this repository (history rewritten?)")
            continue
        rc = _git("merge-base", "--is-ancestor", c, "HEAD", cwd=cwd).returncode
        if rc == 1:
            bad.append(f"{c}: not an ancestor of HEAD")
        elif rc != 0:
            bad.append(f"{c}: git merge-base --is-ancestor exited {rc}")
    return bad


def test_the_mutation_results_commits_are_ancestors_of_head():
    doc = json.loads(RESULT.read_text())
    commits = [doc["commit"]] + [g["commit"] for g in (doc.get("group_runs") or {}).values() if g.get("commit")]
    bad = not_ancestors(list(dict.fromkeys(commits)))
    assert not bad, ("benchmarks/results/mutation.json names commits that are not in HEAD's history; fix: re-run "
                     "python benchmarks/mutation.py at a commit of this branch:\n  " + "\n  ".join(bad))


def test_the_ancestry_check_fails_a_commit_off_the_history(tmp_path):
    """The check itself, on a repository built here: a commit of HEAD's history passes; a commit of a branch HEAD
    does not contain fails, as does a hash no commit has (a rewritten history)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    env = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]

    def git(*a):
        p = _git(*env, *a, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    git("init", "-q", "-b", "main")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    git("checkout", "-qb", "side")
    (tmp_path / "f").write_text("side")
    git("commit", "-qam", "side")
    side = git("rev-parse", "HEAD")
    git("checkout", "-q", "main")
    (tmp_path / "f").write_text("2")
    git("commit", "-qam", "two")
    assert not_ancestors([first], tmp_path) == []
    assert not_ancestors([side, "0" * 40], tmp_path) == [
        f"{side}: not an ancestor of HEAD", f"{'0' * 40}: not a commit of this repository (history rewritten?)"]


def test_outside_a_git_checkout_the_check_skips_with_its_reason(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    with pytest.raises(pytest.skip.Exception, match="is not a git checkout"):
        not_ancestors(["0" * 40], tmp_path)


def _mutation_tool(monkeypatch, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_tool", REPO / "benchmarks" / "mutation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "GROUP_RESULTS", tmp_path / "groups")
    return mod


def test_the_whole_core_score_counts_a_group_only_on_the_files_it_mutated(monkeypatch, tmp_path):
    """benchmarks/mutation.py --whole-core rebuilds mutation.json from the committed group results: a group whose
    files are, blob for blob, those of the scoped commit counts (its killed and survivors add up, a survivor that
    mutation_equivalent.json names goes to equivalent); a group whose own file changed is left out, named stale
    with that file; a group with no result is listed as such. Real git of this checkout (skips outside one)."""
    if shutil.which("git") is None or _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("needs a git checkout of this repository")
    mt = _mutation_tool(monkeypatch, tmp_path)
    table = {n: mt.WHOLE_CORE[n] for n in list(mt.WHOLE_CORE)[:3]}
    (a, ga), (b, gb), (c, _) = table.items()
    commit = mt._git("log", "-1", "--format=%H", "--", *mt.SCOPED_DIRS)
    pa, pb = sorted(ga["scope"])[0], sorted(gb["scope"])[0]
    survivor = {"mutant": "x__mutmut_1", "where": f"{pa}:10", "function": "f", "original": "a < b",
                "mutated": "a <= b", "status": "survived"}
    equiv = {**survivor, "mutant": "x__mutmut_2", "where": f"{pa}:11", "original": "n = 1", "mutated": "n = 2"}
    monkeypatch.setattr(mt, "EQUIVALENT", [{"file": pa, "function": "f", "original": "n = 1", "mutated": "n = 2",
                                            "reason": "planted"}])
    tally = {f"{pa}:f": {"killed": 7, "survived": 0, "equivalent": 0}}
    mt.GROUP_RESULTS.mkdir()
    base = {"scoped_commit": commit, "scoped_dirty": False, "head": commit, "mode": "full", "date": "d",
            "wall_s": 1.0, "not_scored": {}}
    (mt.GROUP_RESULTS / f"{a}.json").write_text(json.dumps(
        {**base, "group": a, "scope_blobs": mt.scope_blobs(ga, commit), "killed": 7, "survivors": [survivor, equiv],
         "per_function": tally}))
    blobs_b = {**mt.scope_blobs(gb, commit), pb: "0" * 40}  # as if pb changed after the run
    (mt.GROUP_RESULTS / f"{b}.json").write_text(json.dumps(
        {**base, "group": b, "scope_blobs": blobs_b, "killed": 100, "survivors": [], "per_function": {}}))
    out = tmp_path / "mutation.json"
    assert mt.write_whole_core(out, table, ["--report-only"], 2) == 0
    doc = json.loads(out.read_text())
    assert doc["commit"] == commit and doc["complete"] is False
    assert doc["killed"] == 7 and doc["score"] == round(7 / 8, 4)  # b's 100 kills do not count
    assert [e["mutant"] for e in doc["survived"]] == ["x__mutmut_1"]
    assert [(e["mutant"], e["reason"]) for e in doc["equivalent"]] == [("x__mutmut_2", "planted")]
    assert doc["per_function"][f"{pa}:f"] == {"killed": 7, "survived": 1, "equivalent": 1}
    assert doc["groups_stale"] == {b: [pb]}
    assert doc["groups_without_results"] == [b, c]
    assert list(doc["group_runs"]) == [a] and doc["group_runs"][a]["commit"] == commit
    assert not not_ancestors([doc["commit"]])
