"""The batch identity of an item retried alone after its batch failed (``runner.app.execute``'s loop).

When a batch raises, the loop retries its items one by one. An item that then succeeds ran in a batch of one: its
record must say so (``batch: {size: 1, position: 0}``, ``params.batch_size: 1``), because batched GEMMs may round
a row differently at another batch size. A resume at the original batch size therefore does not reuse it: it
regenerates the batch, and the run dir then equals a run that never failed. Real tiny_flux runs on CPU; the
failure is a transient one of the whole batch (as an out-of-memory error of a large batch is), injected by a
forward pre-hook on the text encoder that raises on the first call with more than one prompt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest

from runner.app.execute import run

pytestmark = pytest.mark.cpu

ROWS = [{"id": "a", "prompt": "a red circle on white"}, {"id": "b", "prompt": "a blue square on black"},
        {"id": "c", "prompt": "a green triangle"}]
OV = ["platform=cpu", "dataset=jsonl", "model.generation.num_inference_steps=2", "model.generation.width=64",
      "model.generation.height=64"]


def _journal(d: Path) -> Dict[str, Dict[str, Any]]:
    return {r["key"]: r for r in map(json.loads, (d / "items.jsonl").read_text().splitlines())}


def _pngs(d: Path) -> Dict[str, str]:
    return {k: hashlib.sha256((d / r["file"]).read_bytes()).hexdigest() for k, r in _journal(d).items()
            if r["status"] == "ok"}


def _fail_first_batch(adapter: Any) -> None:
    state = {"failed": False}

    def hook(mod, args):
        if args[0].shape[0] > 1 and not state["failed"]:
            state["failed"] = True
            raise RuntimeError("injected failure of a whole batch")

    adapter.pipe.text_encoder.register_forward_pre_hook(hook)


@pytest.fixture(scope="module")
def runs(compose, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_retry")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ov = [*OV, f"dataset.path={data}"]
    out = {}
    for name, extra, hook in (("retried", ["batch_size=2"], _fail_first_batch), ("clean", ["batch_size=2"], None),
                              ("bs1", ["batch_size=1"], None)):
        assert run(compose([*ov, *extra]), root / name, [*ov, *extra], on_loaded=hook) == 0, name
        out[name] = root / name
    out["ov"] = ov
    return out


def test_items_retried_alone_record_a_batch_of_one(runs):
    retried, clean = _journal(runs["retried"]), _journal(runs["clean"])
    assert [r["status"] for r in retried.values()] == ["ok", "ok", "ok"]
    for k in ("a", "b"):
        assert retried[k]["batch"] == {"size": 1, "position": 0}, k
        assert retried[k]["params"]["batch_size"] == 1, k
        assert retried[k]["inputs_sha256"] == clean[k]["inputs_sha256"], k  # same inputs, another batch
    assert clean["a"]["batch"] == {"size": 2, "position": 0} and clean["b"]["batch"] == {"size": 2, "position": 1}
    assert clean["a"]["params"]["batch_size"] == 2
    # c's batch (of one) did not fail: recorded as it ran, like the clean run's
    assert retried["c"]["batch"] == clean["c"]["batch"] == {"size": 1, "position": 0}
    # the retried items are the batch-of-one images, with their own seeds
    bs1 = _pngs(runs["bs1"])
    assert {k: v for k, v in _pngs(runs["retried"]).items() if k in ("a", "b")} == {k: bs1[k] for k in ("a", "b")}
    assert [retried[k]["seed"] for k in "abc"] == [clean[k]["seed"] for k in "abc"]
    man = json.loads((runs["retried"] / "manifest.json").read_text())
    assert man["status"] == "completed" and man["counts"] == {"ok": 3, "failed": 0, "reused": 0}


def test_a_resume_at_the_batch_size_regenerates_the_retried_batch(runs, compose, tmp_path):
    d = tmp_path / "resume"
    shutil.copytree(runs["retried"], d)
    ov = [*runs["ov"], "batch_size=2"]
    assert run(compose(ov), d, ov) == 0
    man = json.loads((d / "manifest.json").read_text())
    assert (man["counts"]["ok"], man["counts"]["reused"]) == (2, 1)  # a and b again, together; c reused
    recs = _journal(d)
    assert recs["a"]["batch"] == {"size": 2, "position": 0} and recs["b"]["batch"] == {"size": 2, "position": 1}
    assert _pngs(d) == _pngs(runs["clean"])
    # and a resume at batch_size=1 reuses them as they are (they ran in batches of one)
    d1 = tmp_path / "resume_bs1"
    shutil.copytree(runs["retried"], d1)
    ov1 = [*runs["ov"], "batch_size=1"]
    assert run(compose(ov1), d1, ov1) == 0
    assert json.loads((d1 / "manifest.json").read_text())["counts"]["reused"] == 3
