"""Issue #42: the rules of ``models.diffusion_rows``, ``models.prompt_tokens`` and ``models.flux2`` asserted function
by function from hand-computed values, on engines of the tiny configs (``conf/model/tiny_*.yaml``) built without
loading weights, so that a wrong rule fails a fast test (``benchmarks/mutation.py``, groups
``core_m_diffusion_rows_*``, ``core_m_prompt_tokens_*``, ``core_m_flux2_*``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.core.dataset import MAX_FRAMES, DatasetError, Row
from runner.core.errors import ConfigValueError


def _engine(compose, *overrides):
    import torch

    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    cfg = compose(["platform=cpu", *overrides])
    return engine_class(cfg.model.engine)(StageContext(
        cfg=cfg, overrides=list(overrides), stage="denoise", plat=detect(cfg.platform.name, cfg.platform.device),
        dtype=torch.float32))


def _row(line=1, set_fields=(), guidance_scale=4.0, prompt="a cat", **values):
    return Row(id=f"r{line}", prompt=prompt, negative_prompt=None, seed=0, width=64, height=64,
               num_inference_steps=3, guidance_scale=guidance_scale, num_images_per_prompt=1, line=line,
               set_fields=tuple(set_fields), values=values)


@pytest.fixture(scope="module")
def wan(compose):
    return _engine(compose, "model=tiny_wan")


@pytest.fixture(scope="module")
def flux(compose):
    return _engine(compose, "model=tiny_flux")


# ------------------------------------------------------------------------------------- check_frame_counts


def test_frame_counts_of_the_form_t_k_plus_1_pass(wan):
    wan.check_frame_counts([_row(1, num_frames=1), _row(2, num_frames=5), _row(3, num_frames=9)], "rows.jsonl", 4)


def test_a_rows_bad_frame_count_is_refused_with_its_line_and_the_counts_around_it(wan):
    rows = [_row(1, ("num_frames",), num_frames=9), _row(2, ("num_frames",), num_frames=10),
            _row(3, ("num_frames",), num_frames=0), _row(4, num_frames=6)]
    with pytest.raises(DatasetError) as e:
        wan.check_frame_counts(rows, "rows.jsonl", 4)
    msg = str(e.value)
    # 10: (10 - 1) // 4 * 4 + 1 = 9, then 13; 0: lo = max(1, ...) from n=1 -> 1, then 5; 6 -> 5 or 9
    assert "rows.jsonl:2: num_frames=10 is not 4k+1" in msg and "fix: num_frames=9 or 13" in msg
    assert "rows.jsonl:3: num_frames=0 is not 4k+1" in msg and "fix: num_frames=1 or 5" in msg
    assert "rows.jsonl:4: num_frames=6 is not 4k+1" in msg and "fix: num_frames=5 or 9" in msg
    assert "rows.jsonl:1:" not in msg
    assert "temporal factor 4" in msg and "WanPipeline would round it down" in msg and "model=tiny_wan" in msg
    assert "writing fewer frames than recorded" in msg


def test_a_frame_count_at_the_ceiling_names_one_fix(wan):
    with pytest.raises(DatasetError) as e:  # 99999, t=10: lo = 99998 // 10 * 10 + 1 = 99991; 99991 + 10 > MAX_FRAMES
        wan.check_frame_counts([_row(1, ("num_frames",), num_frames=MAX_FRAMES - 1)], "p", 10)
    assert str(e.value).endswith("fix: num_frames=99991")
    with pytest.raises(DatasetError) as e:  # 99990: lo = 99981, and 99991 is within the rows' range
        wan.check_frame_counts([_row(1, ("num_frames",), num_frames=99990)], "p", 10)
    assert str(e.value).endswith("fix: num_frames=99981 or 99991")
    with pytest.raises(DatasetError) as e:  # 99998, t=3: lo = 99997, lo + t == MAX_FRAMES exactly: still offered
        wan.check_frame_counts([_row(1, ("num_frames",), num_frames=99998)], "p", 3)
    assert str(e.value).endswith("fix: num_frames=99997 or 100000")


def test_a_missing_frame_count_is_refused(wan):
    with pytest.raises(DatasetError, match="num_frames=None"):
        wan.check_frame_counts([_row(1, ("num_frames",))], "p", 4)


def test_a_bad_default_frame_count_is_the_config_keys(wan):
    with pytest.raises(ConfigValueError) as e:
        wan.check_frame_counts([_row(1, num_frames=10), _row(2, num_frames=10)], "p", 4)
    msg = str(e.value)
    assert msg.startswith("model.generation.num_frames=10 is not 4k+1")
    assert msg.endswith("fix: model.generation.num_frames=9")
    # one row set the bad count itself: the rows' error, naming both
    with pytest.raises(DatasetError) as e:
        wan.check_frame_counts([_row(1, num_frames=10), _row(2, ("num_frames",), num_frames=7)], "p", 4)
    assert "p:1: num_frames=10" in str(e.value) and "p:2: num_frames=7" in str(e.value)


# -------------------------------------------------------------------------------- check_generation_defaults


def _ctx(e):
    return {"size_multiple": e.model_cfg.size_multiple, "max_pixels": e.ctx.run.max_pixels, **e.row_context()}


def test_generation_defaults_are_checked_as_the_config_key(compose, wan):
    wan.check_generation_defaults(wan.row_spec(), _ctx(wan))  # the shipped defaults pass
    bad = _engine(compose, "model=tiny_wan", "model.generation.fps=0")
    with pytest.raises(ConfigValueError) as e:
        bad.check_generation_defaults(bad.row_spec(), _ctx(bad))
    assert str(e.value) == ("model.generation.fps=0 must be an integer from 1 to 100000 (the value of 'fps' in every "
                            "row that does not set it); fix: model.generation.fps=1")


def test_a_default_without_a_suggested_value_names_the_rule(compose, wan):
    from dataclasses import replace

    spec = wan.row_spec()
    fps = spec.by_name["fps"]
    no_fix = replace(fps, check=lambda v, ctx: None if v == 16 else "must be sixteen")
    with_fix = replace(fps, check=lambda v, ctx: None if v == 16 else "is odd; fix: set it to 16")
    plain = replace(fps, check=lambda v, ctx: None if v == 16 else "is odd")
    g = wan.model_cfg.generation.fps
    assert g != 16
    for f, fix in [(no_fix, "model.generation.fps=<sixteen>"), (with_fix, "set it to 16"),
                   (plain, "model.generation.fps=<a valid value>")]:
        s = replace(spec, fields=(f,))
        with pytest.raises(ConfigValueError) as e:
            wan.check_generation_defaults(s, {})
        assert str(e.value).endswith(f"(the value of 'fps' in every row that does not set it); fix: {fix}")
