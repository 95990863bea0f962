"""Engine features as passes (``models.passes``, issue #39): a feature is one module with its pass and one entry in
the engine's ``PASSES``; the engine names none.

* A test-only pass with a row field of its own (``tag``), added as one entry to ``DiffusersEngine.PASSES`` and
  nothing else, runs end to end on toy_shapes: its field is validated, enters the item identity and ``params``,
  its record field reaches ``items.jsonl``, its evidence (forwards it observed itself, against the engine's
  expected count) reaches the manifest, and a planted wrong run (the pass's observer removed) fails the evidence.
* The engine base names no feature (AST over its class body), and the pass order is the install contract.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

from models.passes import Pass, Passes
from runner.core.dataset import Field
from runner.core.errors import EvidenceError

ROOT = Path(__file__).resolve().parents[1]


class TagPass(Pass):
    """Test-only feature: a ``tag`` row field (identity), the denoiser forwards it observes with its own hook, per
    item in the record and in total in the evidence (a mismatch where they are not what the engine expected)."""

    name = "tag"
    row_fields = (Field("tag", str, identity="set", extra=True),)
    drop_hook = False  # planted wrong run: the observer removed after install

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.seen = 0
        self.calls: List[int] = []
        self.records: Dict[str, Dict[str, Any]] = {}
        self.hook = None
        self._before = 0

    def install(self, sections: Dict[str, Any]) -> None:
        def count(module: Any, args: Any) -> None:
            self.seen += 1

        self.hook = self.engine.denoiser.register_forward_pre_hook(count)
        sections["tag"] = {"installed_on": type(self.engine.denoiser).__name__}
        if self.drop_hook:
            self.hook.remove()

    def before_call(self, batch: Any) -> None:
        self._before = self.seen

    def after_call(self, batch: Any, want: Any) -> None:
        for it in batch:
            self.records[it.key] = {"tag": it.row.values.get("tag"), "forwards_seen": self.seen - self._before}

    def record(self, item: Any) -> Dict[str, Any]:
        return {"tag_pass": self.records.pop(item.key)}

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        want = self.engine.want_forwards
        section["tag"] = {"forwards_seen": self.seen, "expected": want}
        return [] if self.seen == want else [f"tag: saw {self.seen} denoiser forwards, expected {want}"]

    def close(self) -> None:
        if self.hook is not None:
            self.hook.remove()


ROWS = [{"id": "a", "prompt": "a red circle at the center", "tag": "x"},
        {"id": "b", "prompt": "a red circle at the center", "tag": "y"},
        {"id": "c", "prompt": "a blue square at the top left"}]


@pytest.fixture
def with_tag_pass(monkeypatch):
    from models.diffusers_engine import DiffusersEngine

    monkeypatch.setattr(DiffusersEngine, "PASSES", DiffusersEngine.PASSES + (TagPass,))  # the one entry


def _rows(tmp_path: Path, rows: List[Dict[str, Any]]) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_a_test_only_pass_with_a_row_field_runs_end_to_end(execute, tmp_path, with_tag_pass):
    data = _rows(tmp_path, ROWS)
    r = execute(["model=toy_shapes", "dataset=jsonl", f"dataset.path={data}", "model.generation.num_inference_steps=2"],
                tmp_path / "run")
    assert r.code == 0
    recs = {x["id"]: x for x in r.items}
    assert recs["a"]["params"]["tag"] == "x" and recs["b"]["params"]["tag"] == "y"
    assert recs["a"]["tag_pass"] == {"tag": "x", "forwards_seen": 2}  # 2 steps, toy_shapes without CFG batching
    assert recs["c"]["tag_pass"]["tag"] is None
    # rows that differ only in the pass's field are different items
    assert recs["a"]["inputs_sha256"] != recs["b"]["inputs_sha256"]
    m = r.manifest
    ev = m["evidence"]["stages"]["denoise"]
    assert ev["tag"] == {"forwards_seen": 6, "expected": 6} and m["evidence"]["verdict"] == "verified"


def test_the_pass_row_field_is_validated_and_its_wrong_run_fails_the_evidence(execute, tmp_path, with_tag_pass,
                                                                               monkeypatch):
    from runner.core.dataset import DatasetError

    with pytest.raises(DatasetError, match="tag"):
        execute(["model=toy_shapes", "dataset=jsonl", f"dataset.path={_rows(tmp_path, [{'prompt': 'p', 'tag': [3]}])}"],
                tmp_path / "bad")
    monkeypatch.setattr(TagPass, "drop_hook", True)
    with pytest.raises(EvidenceError, match="tag: saw 0 denoiser forwards"):
        execute(["model=toy_shapes", "dataset=jsonl", f"dataset.path={_rows(tmp_path, ROWS[:1])}",
                 "model.generation.num_inference_steps=2"], tmp_path / "planted")


FEATURE_WORDS = re.compile(r"lora|(?<!_)cache(?!_dir)|compil|memory|\bfit\b|context_parallel|condition|quantiz|offload")


def test_the_engine_base_names_no_feature():
    """Every identifier of ``DiffusersEngine``'s own class body (methods, attributes read or set) is free of the
    features' names: they are reached through ``self.passes`` only."""
    tree = ast.parse((ROOT / "models" / "diffusers_engine.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "DiffusersEngine")
    named = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Name):
            named.add(node.id)
        elif isinstance(node, ast.Attribute):
            named.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            named.add(node.name)
    assert sorted(x for x in named if FEATURE_WORDS.search(x)) == []
    probes = [n for n in ast.walk(cls) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr"
              and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "self"]
    assert probes == []  # no getattr(self, "...") for state only a subclass sets


def test_the_pass_order_is_the_install_contract():
    from models.diffusers_engine import DiffusersEngine

    names = [p.rsplit(":", 1)[1] for p in DiffusersEngine.PASSES]
    order = {n: i for i, n in enumerate(names)}
    assert order["LoraPass"] < order["AttentionPass"] < order["MoePass"] < order["LinearPass"]  # fused weights first
    assert order["AttentionPass"] < order["ContextParallelPass"]  # diffusers checks each processor's backend
    assert order["LinearPass"] < order["FittingPass"] < order["CompileBeneathHooksPass"]  # placement after rewrites
    assert order["CompileBeneathHooksPass"] < order["StepCachePass"] < order["CompilePass"]
    assert order["TruncationPass"] == 0  # a fed batch is refused before any pass acts


def test_passes_need_distinct_names_and_close_in_reverse_even_after_an_error():
    closed: List[str] = []

    def make(n: str, fail: bool = False) -> type:
        def close(self: Any) -> None:
            closed.append(n)
            if fail:
                raise RuntimeError(n)
        return type(f"P{n}", (Pass,), {"name": n, "close": close})

    with pytest.raises(ValueError, match="distinct"):
        Passes(None, [make("a"), make("a")])
    ps = Passes(None, [make("a"), make("b", fail=True), make("c")])
    with pytest.raises(RuntimeError, match="b"):
        ps.close()
    assert closed == ["c", "b", "a"]
    assert ps["c"].name == "c" and ps.get("z") is None
