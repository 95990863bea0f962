"""The engine seam: an engine registered from a test alone (no edit elsewhere) runs through the one run loop
(``runner.app.execute.run``) and writes text records with the text-record sink, with the loop's guarantees: every
stage prepared before anything loads, one bad row fails alone, the journal in dataset order, evidence from the
engine, and a refusal of a dir that already holds a run for a non-resumable engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from models.base import EngineBase, StageResult, TextOutput
from models.registry import ENGINES, engine_class, register_engine, unregister_engine
from runner.core.errors import UserInputError


class EchoEngine(EngineBase):
    """A toy text engine: the output of a row is its prompt reversed. A prompt containing ``boom`` raises, which
    fails a whole batch; the loop must then retry the batch's rows alone so only that row fails."""

    output = "text"
    unit = "row"
    resumable = False
    default_stage = "echo"
    events: List[str] = []

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.stage = ctx.stage
        self.source: Dict[str, Any] = {"kind": "toy"}
        self.calls = 0

    def prepare(self) -> Dict[str, Any]:
        EchoEngine.events.append("prepare")
        return self.source

    def read_rows(self) -> Tuple[List[Any], Path]:
        from runner.core import dataset as ds

        g = dict(width=8, height=8, num_inference_steps=1, guidance_scale=0.0, num_images_per_prompt=1)
        return ds.load_rows(self.ctx.cfg.dataset.format, self.ctx.cfg.dataset.path, defaults=g, size_multiple=8,
                            max_pixels=64, limit=self.ctx.cfg.dataset.limit)

    def items(self, rows: Sequence[Any], run_seed: int) -> List[Any]:
        from runner.core import dataset as ds

        return ds.expand_items(rows, run_seed)

    def batches(self, items: Sequence[Any], batch_size: int) -> List[List[Any]]:
        return [list(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]

    def backends_section(self) -> Dict[str, Any]:
        return {}

    def load(self, on_loaded: Any = None) -> Dict[str, Any]:
        EchoEngine.events.append("load")
        return {"model": {"load_s": 0.0}}

    def generate(self, batch: Sequence[Any]) -> List[TextOutput]:
        self.calls += 1
        if any("boom" in it.row.prompt for it in batch):
            raise RuntimeError("boom in the batch")
        return [TextOutput({"text": it.row.prompt[::-1], "output_token_ids": [len(it.row.prompt)]}) for it in batch]

    def record(self, item: Any, output: Any, batch_len: int, generate_s: float) -> Dict[str, Any]:
        rec = {"id": item.row.id, "key": item.key, "prompt": item.row.prompt, "batch_size": batch_len}
        if isinstance(output, TextOutput):
            rec.update(output.record)
        return rec

    def evidence(self, result: StageResult) -> Tuple[Dict[str, Any], List[str]]:
        ok = [r for r in result.records if r["text"] != r["prompt"][::-1]]
        return {"engine_calls": self.calls, "records": len(result.records)}, [f"bad text for {r['id']}" for r in ok]


@pytest.fixture
def echo_engine():
    EchoEngine.events = []
    register_engine("echo", EchoEngine)
    yield EchoEngine
    unregister_engine("echo")
    assert "echo" not in ENGINES


def _rows(tmp_path: Path, prompts: Dict[str, str]) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in prompts.items()))
    return p


def _run(compose, run_dir: Path, data: Path, extra: Sequence[str] = ()) -> int:
    from runner.app.execute import run

    ov = ["platform=cpu", "model.engine=echo", "dataset=jsonl", f"dataset.path={data}", "batch_size=2", *extra]
    return run(compose(ov), run_dir, ov)


def test_registered_toy_engine_writes_text_records_through_the_loop(echo_engine, compose, tmp_path):
    data = _rows(tmp_path, {"a": "one", "b": "two boom", "c": "three", "d": "four", "e": "five"})
    code = _run(compose, tmp_path / "run", data)
    assert code == 1  # one row failed, the others were written
    assert echo_engine.events == ["prepare", "load"]  # prepared before it loaded, loaded once
    recs = [json.loads(line) for line in (tmp_path / "run" / "items.jsonl").read_text().splitlines()]
    assert [r["key"] for r in recs] == ["a", "b", "c", "d", "e"]  # dataset order
    by = {r["key"]: r for r in recs}
    assert by["b"]["status"] == "failed" and "boom in the batch" in by["b"]["reason"]
    for k, prompt in (("a", "one"), ("c", "three"), ("d", "four"), ("e", "five")):
        assert by[k]["status"] == "ok" and by[k]["text"] == prompt[::-1]
    assert by["a"]["batch_size"] == 1  # a was retried alone after its batch with b raised
    assert by["c"]["batch_size"] == 2
    assert not (tmp_path / "run" / "images").exists()  # the text sink writes no image dir
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["status"] == "completed_with_failures"
    assert m["counts"] == {"ok": 4, "failed": 1, "reused": 0}
    assert m["model"]["engine"] == "echo"
    st = m["evidence"]["stages"]["echo"]
    assert m["evidence"]["verdict"] == "verified"
    assert st == {"engine_calls": 3 + 2, "records": 4}  # 3 batches, the failing one retried as 2 single calls


def test_toy_engine_evidence_mismatch_is_exit_3(echo_engine, compose, tmp_path):
    from runner.core.errors import EvidenceError

    original = EchoEngine.generate

    def wrong(self, batch):
        return [TextOutput({"text": "x", "output_token_ids": [0]}) for _ in batch]

    EchoEngine.generate = wrong
    try:
        with pytest.raises(EvidenceError) as e:
            _run(compose, tmp_path / "run", _rows(tmp_path, {"a": "one"}))
    finally:
        EchoEngine.generate = original
    assert e.value.exit_code == 3
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["status"] == "evidence_mismatch" and m["evidence"]["mismatches"] == ["bad text for a"]


def test_non_resumable_engine_refuses_a_dir_holding_a_run(echo_engine, compose, tmp_path):
    from runner.core.resume import ResumeConflictError

    data = _rows(tmp_path, {"a": "one"})
    assert _run(compose, tmp_path / "run", data) == 0
    before = (tmp_path / "run" / "items.jsonl").read_bytes()
    echo_engine.events.clear()
    with pytest.raises(ResumeConflictError, match="already holds a run"):
        _run(compose, tmp_path / "run", data)
    assert echo_engine.events == []  # refused before prepare
    assert (tmp_path / "run" / "items.jsonl").read_bytes() == before


def test_non_resumable_engine_takes_the_dir_of_a_run_refused_at_startup(echo_engine, compose, tmp_path):
    """A run refused at startup (its manifest says ``invalid``: nothing was produced) is not a run: the corrected
    command into the same dir proceeds (a new user's vLLM run with a missing dataset file, then the fixed command,
    was refused with 'already holds a run ... do not resume'); a dir whose run produced records is still refused."""
    from runner.app.jobs import run_job
    from runner.core.resume import ResumeConflictError

    d = tmp_path / "run"
    ov = ["platform=cpu", "model.engine=echo", "dataset=jsonl", f"dataset.path={tmp_path / 'missing.jsonl'}"]
    assert run_job(compose(ov), d, ov, reraise=False) == 2  # what `python -m runner` runs: the refusal recorded
    assert json.loads((d / "manifest.json").read_text())["status"] in ("refused", "invalid")
    assert _run(compose, d, _rows(tmp_path, {"a": "one"})) == 0
    assert json.loads((d / "items.jsonl").read_text())["text"] == "eno"
    with pytest.raises(ResumeConflictError, match="already holds a run"):  # now it holds one
        _run(compose, d, _rows(tmp_path, {"a": "one"}))


def test_unknown_engine_name_is_a_user_error_naming_the_closest():
    with pytest.raises(UserInputError, match=r"model.engine='flx' is not a registered engine.*did you mean 'flux'"):
        engine_class("flx")


def test_registry_imports_engines_lazily():
    """Registered engines are import paths until used: vLLM's engine module stays unimported by a lookup of the
    registry itself (``import vllm`` costs 13-30 s)."""
    import subprocess
    import sys

    code = ("import sys; import models.registry as r; r.engine_class('flux'); "
            "print('models.vllm.engine' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


# regression: bug: `model=prompt_expand_flux model.stages.denoise.template=x` was accepted: every image was
# rendered from "x" and the expand stage's output went unused
@pytest.mark.parametrize("template", ["x", "{prompt}"])
def test_pipeline_template_without_the_upstream_text_is_refused(compose, template):
    from runner.app.stages import stage_graph

    cfg = compose(["platform=cpu", "model=prompt_expand_flux", f"model.stages.denoise.template='{template}'"])
    with pytest.raises(UserInputError, match=r"does not use \{text\}.*fix"):
        stage_graph(cfg)
