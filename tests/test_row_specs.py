"""Engine-owned row specs (``runner.core.dataset.RowSpec``): one validation driver for the diffusion image row, the
video row and the AR row; a field an engine adds to its spec reaches validation, the item identity
(``inputs_sha256``), ``items.jsonl`` and resume through the spec alone (no edit of the driver, the loop, the
journal or the resume rules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import pytest

from models.flux import FluxEngine
from models.registry import register_engine, unregister_engine
from runner.core import dataset as ds
from runner.core import resume as rs
from runner.core.dataset import DatasetError, Field

pytestmark = pytest.mark.cpu

DEFAULTS = {"width": 64, "height": 48, "num_inference_steps": 4, "guidance_scale": 3.5, "num_images_per_prompt": 1,
            "negative_prompt": None}


def check_strength(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """A toy engine's per-row field: an img2img-like strength in [0, 1]."""
    return "must be in [0, 1]" if v is not None and not 0 <= v <= 1 else None


#: A toy engine's row: the diffusion row plus ``strength`` (a default from ``model.generation.strength``, part of
#: the item identity when set).
STRENGTH_ROW = ds.VIDEO_ROW.extend("strength", Field("strength", float, check=check_strength, default="strength",
                                                     identity="set"))


def _jsonl(tmp_path: Path, rows: List[Dict[str, Any]], name: str = "rows.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p


def _load(p: Path, spec: ds.RowSpec = STRENGTH_ROW, fmt: str = "jsonl", **defaults: Any):
    return ds.load_rows(fmt, str(p), defaults={**DEFAULTS, **defaults}, size_multiple=16, max_pixels=1 << 20,
                        spec=spec)[0]


def _problems(p: Path, **kw: Any) -> List[str]:
    with pytest.raises(DatasetError) as e:
        _load(p, **kw)
    return e.value.problems


# ------------------------------------------------------------------------------------------------ validation
def test_an_added_field_is_typed_checked_defaulted_and_spelled(tmp_path):
    p = _jsonl(tmp_path, [{"id": "a", "prompt": "p", "strength": 0.25}, {"id": "b", "prompt": "q"}])
    a, b = _load(p, strength=0.5)
    assert (a.strength, b.strength) == (0.25, 0.5)  # the row's value, else the default
    assert a.set_fields == ("strength",) and b.set_fields == ()
    assert _load(p)[1].strength is None  # no default: None, and not in Row.values
    bad = _jsonl(tmp_path, [{"prompt": "p", "strength": 2}, {"prompt": "q", "strength": "lots"},
                            {"prompt": "r", "strenght": 0.1}], "bad.jsonl")
    assert _problems(bad) == [
        f"{bad}:1: field 'strength' = 2.0 must be in [0, 1]; fix: set strength to a value in [0, 1]",
        f"{bad}:2: field 'strength' = 'lots' is not a number; fix: write it as a number (no quotes)",
        f"{bad}:3: unknown field 'strenght'; fix: did you mean 'strength'? (a column of that name under another "
        "spelling: dataset.columns={strength: strenght})"]
    # the image row does not know the field: an extra field there
    assert "unknown field 'strength'" in _problems(p, spec=ds.IMAGE_ROW)[0]


def test_an_added_field_reaches_the_item_identity_and_the_batching_key_only_by_its_spec(tmp_path):
    p = _jsonl(tmp_path, [{"id": "a", "prompt": "p", "strength": 0.25}, {"id": "b", "prompt": "p", "strength": 0.75},
                          {"id": "c", "prompt": "p"}])
    items = ds.expand_items(_load(p), 0)
    inputs = [rs.item_inputs(it) for it in items]
    assert [i.get("strength") for i in inputs] == [0.25, 0.75, None] and "strength" not in inputs[2]
    assert len({rs.inputs_sha256("run", it) for it in items}) == 3
    same = ds.expand_items(_load(_jsonl(tmp_path, [{"id": "c", "prompt": "p"}], "plain.jsonl"), spec=ds.VIDEO_ROW), 0)
    assert rs.item_inputs(same[0]) == inputs[2]  # a row without the field keeps its identity under either spec
    assert len(ds.batches(items, 4)) == 1  # not a batching key: one batch
    keyed = ds.VIDEO_ROW.extend("keyed", Field("strength", float, batch_key=True))
    assert len(ds.batches(ds.expand_items(_load(p, spec=keyed), 0), 4)) == 3


def test_the_three_rows_are_specs_of_one_driver():
    from models.vllm.rows import AR_ROW

    assert set(ds.IMAGE_ROW.by_name) < set(ds.VIDEO_ROW.by_name)
    assert set(ds.VIDEO_ROW.by_name) - set(ds.IMAGE_ROW.by_name) == {"num_frames", "fps"}
    assert {"prompt_token_ids", "max_tokens", "stop"} <= set(AR_ROW.by_name)
    raw = [(1, {"id": "x", "prompt": "hi", "max_tokens": 0}), (2, {"id": "x", "prompt_token_ids": [1, 2]})]
    with pytest.raises(DatasetError) as e:
        ds.validate_rows(raw, AR_ROW, "rows.jsonl", context={"sampling": {}, "max_model_len": 64, "run_seed": 0})
    assert e.value.problems == ["rows.jsonl:1: field 'max_tokens' = 0 must be >= 1; fix: set max_tokens to a value >= 1",
                                "rows.jsonl:2: duplicate id 'x' (first on line 1); fix: ids must be unique"]
    with pytest.raises(ValueError, match="declares a field twice"):
        ds.IMAGE_ROW.extend("twice", Field("width", int))


def test_engines_declare_their_row_spec():
    from models.vllm.engine import VLLMEngine
    from models.vllm.rows import AR_ROW

    assert VLLMEngine.row_spec(None) is AR_ROW
    # the video row, conditioning (issue 30) and LoRA (32); FLUX declares no row fields of its own (FamilySpec.row_fields)
    assert FluxEngine.row_spec(object.__new__(FluxEngine)) is ds.DIFFUSION_ROW
    assert set(ds.DIFFUSION_ROW.by_name) - set(ds.VIDEO_ROW.by_name) == {"image", "mask_image", "last_image",
                                                                          "strength", "lora", "lora_scale"}


# ------------------------------------------------------------------------------------------------ a whole run
class StrengthFlux(FluxEngine):
    """FLUX with one more row field (recorded and part of the identity; not passed to the pipeline)."""

    def row_spec(self) -> ds.RowSpec:
        return STRENGTH_ROW


@pytest.fixture
def strength_engine():
    register_engine("flux_strength", StrengthFlux)
    yield StrengthFlux
    unregister_engine("flux_strength")


def test_an_added_field_reaches_items_jsonl_and_resume(strength_engine, execute, tmp_path):
    rows = [{"id": "a", "prompt": "a red fox", "strength": 0.25}, {"id": "b", "prompt": "a blue bird", "strength": 0.5}]
    data = _jsonl(tmp_path, rows)
    ov = ["model.engine=flux_strength", "dataset=jsonl", f"dataset.path={data}",
          "model.generation.num_inference_steps=1", "batch_size=1"]
    d = tmp_path / "run"
    first = execute(ov, d)
    assert first.code == 0
    by = {r["key"]: r for r in first.items}
    assert (by["a"]["params"]["strength"], by["b"]["params"]["strength"]) == (0.25, 0.5)
    rows[1]["strength"] = 0.75  # b's inputs change, a's do not
    _jsonl(tmp_path, rows)
    again = execute([*ov, "run.force=true"], d)  # the dataset's sha256 changed: a forced resume
    assert again.code == 0
    assert (again.manifest["counts"]["reused"], again.manifest["counts"]["ok"]) == (1, 1)
    by2 = {r["key"]: r for r in again.items}
    assert by2["a"]["inputs_sha256"] == by["a"]["inputs_sha256"]
    assert by2["b"]["inputs_sha256"] != by["b"]["inputs_sha256"] and by2["b"]["params"]["strength"] == 0.75


# ------------------------------------------------------------------------------------------------ identities kept
#: ``inputs_sha256`` (under the run hash ``"x"``) of the rows below as the closed ``Row`` of main at d6c0ce0
#: computed them (image rows, video rows, an ignored negative prompt and fps recorded): the run dirs written before
#: row specs must still resume.
KEPT = {"a": "568a0f0f94a47c66f189fae13d7fb0e213eff9fd67aa135fa088385bfe59d259",
        "b": "343acebf91b73f605250ebaa9843cdf57f276b1972988b78f14e1a59de36f9cd",
        "c": "ff37d820a2d0960f9897b2780a04a9ec88c802e73653971d6d288c4ba23e9338",
        "d-0": "b32aa47fc2fa2dee9bfefcc139b6ee1993313435a3384261bc1f085bdb4b175c",
        "d-1": "97b47d619a35eee8838a7ac7b79d2cb9dfea45ddd7957298b8a6aacc336ed4a7",
        "e": "e56e97ead89682c63e05c81f98c71c61ba52cacbe1e346f5967838afbc5a78ab"}
KEPT_VIDEO = {"a": "5c8f4e5f0ddf3767d964eb8433123e3a59049ba3977de0fd44aaec9472bb5aab",
              "c": "e8a7e7e01c528cc7832edf280d0d944547f6b9b738d8871dcf0745be2808fdfb",
              "e": "30bf992b2859d335de0f9b5df017808f41ed6020530028df8ab8204252279827"}


def test_item_identities_of_earlier_run_dirs_are_kept(tmp_path):
    rows = [{"id": "a", "prompt": "a fox"}, {"id": "b", "prompt": "q", "seed": 5, "width": 32, "guidance_scale": 2},
            {"id": "c", "prompt": "v", "num_frames": 5, "fps": 12, "negative_prompt": "ugly"},
            {"id": "d", "prompt": "w", "num_frames": 9, "expect": {"color": "red"}, "num_images_per_prompt": 2},
            {"id": "e", "prompt": "x", "guidance_scale": 4.0, "negative_prompt": "n"}]
    p = _jsonl(tmp_path, rows)
    ignored = {"negative_prompt": ("why", "fix"), "fps": ("w", "f")}
    for defaults, want in (({}, KEPT), ({"guidance_scale": None, "num_frames": 9, "fps": 8}, KEPT_VIDEO)):
        # the recorded ``ignored.from`` names the file the hashes were computed with
        got = ds.apply_ignored(_load(p, spec=ds.VIDEO_ROW, **defaults), Path("/tmp/idrows.jsonl"), ignored, "record",
                               "m")
        hashes = {it.key: rs.inputs_sha256("x", it) for it in ds.expand_items(got, 3)}
        assert {k: hashes[k] for k in want} == want
