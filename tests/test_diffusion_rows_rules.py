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


def _row(line=1, set_fields=(), guidance_scale=4.0, prompt="a cat", negative_prompt=None, **values):
    return Row(id=f"r{line}", prompt=prompt, negative_prompt=negative_prompt, seed=0, width=64, height=64,
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


def test_a_zero_frame_count_with_factor_1_offers_1_or_2(wan):
    with pytest.raises(DatasetError) as e:  # lo = max(1, (1 - 1) // 1 * 1 + 1) = 1
        wan.check_frame_counts([_row(1, ("num_frames",), num_frames=0)], "p", 1)
    assert str(e.value).endswith("fix: num_frames=1 or 2")


def test_a_missing_frame_count_is_refused(wan):
    with pytest.raises(DatasetError, match="num_frames=None"):
        wan.check_frame_counts([_row(1, ("num_frames",))], "p", 4)


def test_a_bad_default_frame_count_is_the_config_keys(wan):
    with pytest.raises(ConfigValueError) as e:
        wan.check_frame_counts([_row(1, num_frames=10), _row(2, num_frames=10)], "p", 4)
    msg = str(e.value)
    assert msg.startswith("model.generation.num_frames=10 is not 4k+1")
    assert msg.endswith("fix: model.generation.num_frames=9")
    with pytest.raises(ConfigValueError, match=r"num_frames=6 is not 4k\+1.*fix: model.generation.num_frames=5$"):
        wan.check_frame_counts([_row(1, num_frames=6)], "p", 4)
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


# --------------------------------------------------------------------------------------- FamilyRows.check_rows


def test_an_image_model_refuses_fps_naming_the_row_or_the_default(flux):
    flux.check_rows([_row(1), _row(2)], "p")  # no video field set: accepted
    with pytest.raises(ConfigValueError) as e:
        flux.check_rows([_row(1), _row(2, ("fps",), fps=8), _row(3, ("fps",), fps=12)], "p")
    assert str(e.value) == ("fps=8 (p:2 (row 'r2'), 2 row(s)): model=tiny_flux writes images, and fps applies to "
                            "video output only; fix: remove fps from the rows (and model.generation)")
    with pytest.raises(ConfigValueError) as e:
        flux.check_rows([_row(1, fps=8)], "p")  # the default's value: no row set it
    assert str(e.value).startswith("fps=8 (model.generation.fps, 1 row(s))")


def test_a_field_the_pipeline_does_not_take_is_refused(flux):
    assert "num_frames" not in flux.call_params()
    with pytest.raises(ConfigValueError) as e:
        flux.check_rows([_row(1), _row(2, ("num_frames",), num_frames=9)], "p")
    assert str(e.value).startswith("num_frames=9 (p:2 (row 'r2'), 1 row(s)): FluxPipeline (model=tiny_flux) takes no "
                                   "num_frames argument, so it cannot be applied; fix: remove num_frames")
    with pytest.raises(ConfigValueError) as e:
        flux.check_rows([_row(1, num_frames=5), _row(2, num_frames=5)], "p")
    assert str(e.value).startswith("num_frames=5 (model.generation.num_frames, 2 row(s)): FluxPipeline")


def test_a_video_model_takes_its_video_fields(wan):
    wan.check_rows([_row(1, ("num_frames", "fps"), num_frames=5, fps=8)], "p")


def test_true_cfg_scale_is_ignored_by_a_pipeline_without_it(compose, wan, flux):
    assert "true_cfg_scale" not in _engine(compose, "model=tiny_wan").ignored_fields([_row(1)])
    w = _engine(compose, "model=tiny_wan", "model.generation.true_cfg_scale=2.0")
    why, fix = w.ignored_fields([_row(1)])["true_cfg_scale"]
    assert why.startswith("WanPipeline takes no true_cfg_scale") and fix == "set guidance_scale instead"
    # FluxPipeline takes true_cfg_scale: not ignored where a row has a negative prompt for its true CFG
    assert _engine(compose, "model=tiny_flux", "model.generation.true_cfg_scale=2.0").ignored_fields(
        [_row(1, negative_prompt="blurry")]) == {}
    assert "negative_prompt" in flux.ignored_fields([_row(1)])  # true_cfg_scale 1.0: no negative prompt


# ------------------------------------------------------------------------------------------- prompt tokens


@pytest.fixture(scope="module")
def flux8(compose):
    return _engine(compose, "model=tiny_flux", "model.generation.max_sequence_length=8")


def test_prompt_tokens_count_limit_and_dropped_per_encoder(flux8):
    toks = flux8.tokenizers()
    short, long = "a cat", "a red cat and a blue dog on a green sofa under a lamp"
    out = flux8.prompt_tokens([long, short, long])
    for p, rec in zip([long, short, long], out):
        clip, t5 = (len(toks[k](p)["input_ids"]) for k in ("clip", "t5"))
        assert rec == {"clip": {"count": clip, "limit": 77, "dropped": 0},
                       "t5": {"count": t5, "limit": 8, "dropped": max(0, t5 - 8)}}
    assert out[0]["t5"]["dropped"] > 0 and out[1]["t5"]["dropped"] == 0
    assert flux8.prompt_tokens([short])[0] == out[1]  # from the cache, the same counts


def test_token_limit_is_the_tokenizers_for_clip_and_max_sequence_length_for_t5(flux8):
    toks = flux8.tokenizers()
    assert flux8.token_limit("clip", toks["clip"]) == 77
    assert flux8.token_limit("t5", toks["t5"]) == 8


def test_sequence_limit_is_the_lower_of_the_pipeline_ceiling_and_the_tokenizer(compose, flux8):
    assert flux8.sequence_limit() == 512  # FluxPipeline's 512, T5's model_max_length 512
    flux8.max_sequence_length_limit = 300
    try:
        assert flux8.sequence_limit() == 300
        flux8.max_sequence_length_limit = 600
        assert flux8.sequence_limit() == 512
    finally:
        flux8.max_sequence_length_limit = 512
    k = _engine(compose, "model=tiny_flux2_klein")  # no pipeline ceiling: the Qwen tokenizer's
    assert k.max_sequence_length_limit is None
    assert k.sequence_limit() == int(k.tokenizers()["qwen3"].model_max_length) == 131072


def test_truncation_fix_only_for_a_sequence_encoder_below_its_ceiling(compose, flux8):
    assert flux8.truncation_fix({"t5": {"dropped": 3}}) == \
        ", raise model.generation.max_sequence_length (now 8, at most 512)"
    assert flux8.truncation_fix({"clip": {"dropped": 3}, "t5": {"dropped": 0}}) == ""
    assert flux8.truncation_fix({"clip": {"dropped": 3}}) == ""  # counts without the sequence encoder
    assert _engine(compose, "model=tiny_flux", "model.generation.max_sequence_length=512").truncation_fix(
        {"t5": {"dropped": 3}}) == ""


def test_describe_lists_the_truncated_encoders_only():
    from models.prompt_tokens import describe

    assert describe({"clip": {"count": 80, "limit": 77, "dropped": 3}, "t5": {"count": 5, "limit": 8, "dropped": 0},
                     "x": {"count": 9, "limit": 8, "dropped": 1}}) == \
        "clip 80 tokens, 3 over its limit of 77, x 9 tokens, 1 over its limit of 8"


LONG = "a red cat and a blue dog on a green sofa under a lamp"


def _truncation(e):
    return next(p for p in e.passes if p.name == "truncation")


def test_truncated_dataset_prompts_are_refused_under_error(compose):
    e = _engine(compose, "model=tiny_flux", "model.generation.max_sequence_length=8", "dataset.on_truncation=error")
    rows = [_row(1, prompt="a cat"), _row(2, prompt=LONG), _row(3, prompt="a dog")]
    assert _truncation(e).prepare_rows([rows[0], rows[2]], "p") == [rows[0], rows[2]]
    with pytest.raises(DatasetError) as ex:
        _truncation(e).prepare_rows(rows, "p")
    t5 = e.prompt_tokens([LONG])[0]["t5"]
    assert str(ex.value).count("is truncated") == 1
    assert (f"p:2: prompt of row 'r2' is truncated: t5 {t5['count']} tokens, {t5['count'] - 8} over its limit of 8; "
            "the image would be that of its first tokens only; fix: shorten the prompt, raise "
            "model.generation.max_sequence_length (now 8, at most 512), or dataset.on_truncation=record") in str(ex.value)


def test_truncated_dataset_prompts_are_counted_under_record(flux8, caplog):
    rows = [_row(1, prompt="a cat"), _row(2, prompt=LONG), _row(3, prompt=LONG + " again")]
    with caplog.at_level("WARNING", logger="runner"):
        assert _truncation(flux8).prepare_rows(rows, "p") == rows
    assert "2 of 3 rows have prompts longer than a text encoder takes (t5: 2 over 8)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="runner"):
        assert _truncation(flux8).prepare_rows(rows[1:2], "p") == rows[1:2]
    assert caplog.messages == [
        "1 of 1 rows have prompts longer than a text encoder takes (t5: 1 over 8); the encoder sees their first "
        "tokens, and each item records its token counts and the tokens dropped (dataset.on_truncation=error refuses "
        "them)"]


def test_counts_are_untruncated_past_the_clip_limit(flux8):
    per_word = len(flux8.tokenizers()["clip"]("cat")["input_ids"]) - 2  # BOS and EOS around the word's tokens
    n = 100 * per_word + 2  # 100 words: past CLIP's 77
    rec = flux8.prompt_tokens([" ".join(["cat"] * 100)])[0]["clip"]
    assert rec == {"count": n, "limit": 77, "dropped": n - 77} and n > 77


def test_each_encoder_counts_with_its_own_label(compose):
    # HunyuanVideo 1.5: the ByT5 encoder counts the bytes of the quoted glyph text, none without quotes
    e = _engine(compose, "model=tiny_hunyuanvideo15")
    plain, quoted = e.prompt_tokens(["a cat", 'a sign saying "hi"'])
    assert plain["byt5"]["count"] == 0 and quoted["byt5"]["count"] > 0


# ---------------------------------------------------------------------------------------------------- flux2


class _Pipe:
    def __call__(self, prompt=None, text_encoder_out_layers=(3, 6, 9)):
        pass


def test_text_layer_problems_name_too_few_layers_and_a_wrong_joint_dim():
    from models.flux2 import text_layer_problems

    assert text_layer_problems(_Pipe, {"num_hidden_layers": 9, "hidden_size": 16}, {"joint_attention_dim": 48}) == []
    assert text_layer_problems(_Pipe, {"num_hidden_layers": 8, "hidden_size": 16}, {"joint_attention_dim": 48}) == [
        "text_encoder num_hidden_layers=8, and _Pipe reads hidden states (3, 6, 9) (at least 9 layers)"]
    assert text_layer_problems(_Pipe, {"text_config": {"num_hidden_layers": 9, "hidden_size": 16}},
                               {"joint_attention_dim": 32}) == [
        "transformer joint_attention_dim=32, and _Pipe stacks 3 hidden states of 16 (48)"]
    assert text_layer_problems(_Pipe, {}, {"joint_attention_dim": 32}) == []  # nothing known: nothing refused
    assert text_layer_problems(_Pipe, {"hidden_size": 16}, {}) == []


def test_a_tiny_flux2_with_too_few_text_layers_is_refused(compose):
    e = _engine(compose, "model=tiny_flux2_klein", "model.architecture.text_encoder.num_hidden_layers=26")
    with pytest.raises(ConfigValueError) as ex:
        e.check_text_layers()
    assert str(ex.value).startswith("model=tiny_flux2_klein: text_encoder num_hidden_layers=26, and "
                                    "Flux2KleinPipeline reads hidden states (9, 18, 27)")
    _engine(compose, "model=tiny_flux2_klein").check_text_layers()  # the shipped config: 27 layers


def test_neither_flux2_pipeline_takes_a_negative_prompt(compose):
    for model, pipe in [("tiny_flux2", "Flux2Pipeline"), ("tiny_flux2_klein", "Flux2KleinPipeline")]:
        why, fix = _engine(compose, f"model={model}").ignored_fields([_row(1)])["negative_prompt"]
        assert why.startswith(f"{pipe} takes no negative prompt") and fix == "remove negative_prompt from the rows"


def test_klein_distillation_sets_forwards_guidance_and_null_guidance(compose):
    from types import SimpleNamespace

    base = _engine(compose, "model=tiny_flux2_klein")
    dist = _engine(compose, "model=tiny_flux2_klein", "model.architecture.pipeline.is_distilled=true")
    assert (base.is_distilled, dist.is_distilled) == (False, True)
    batch = [SimpleNamespace(row=SimpleNamespace(num_inference_steps=3, guidance_scale=4.0, negative_prompt=None))]
    assert dist.expected_forwards(batch) == 3
    assert base.expected_forwards(batch) == 6  # CFG: two forwards per step
    assert "guidance_scale" in dist.ignored_fields([_row(1)]) and "guidance_scale" not in base.ignored_fields([_row(1)])
    base.check_family_rows([_row(1)], "p")
    dist.check_family_rows([_row(1, guidance_scale=None)], "p")
    with pytest.raises(ConfigValueError) as ex:
        base.check_family_rows([_row(1), _row(2, guidance_scale=None)], "p")
    assert str(ex.value) == (
        "model.generation.guidance_scale=null, but model=tiny_flux2_klein is not step-distilled (is_distilled=false): "
        "Flux2KleinPipeline would apply its default 4.0 (CFG, two forwards per step) unrecorded; fix: "
        "model.generation.guidance_scale=4.0 (or 1.0 for no CFG), or a guidance_scale in every row")
    comps = type(dist).build_components(dist.arch_copy())
    assert comps["is_distilled"] is True


def test_klein_components_carry_is_distilled_false_by_default_on_the_device_and_dtype_asked(compose):
    import torch

    e = _engine(compose, "model=tiny_flux2_klein")
    arch = {k: v for k, v in e.arch_copy().items() if k != "pipeline"}
    comps = type(e).build_components(arch, device="meta", dtype=torch.bfloat16)
    assert comps["is_distilled"] is False  # Flux2KleinPipeline's default, written to model_index.json
    p = next(comps["transformer"].parameters())
    assert p.device.type == "meta" and p.dtype == torch.bfloat16


# ------------------------------------------------------------------------------- read_rows, ignored, records


def _jsonl(tmp_path, *rows):
    import json

    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_read_rows_fills_the_models_defaults(compose, tmp_path):
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "a dog", "width": 64, "seed": 5})
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "num_images_per_prompt=2")
    rows, path = e.read_rows()
    g = e.model_cfg.generation
    assert str(path) == p and [r.id for r in rows] == ["a", "b"]
    assert (rows[0].width, rows[0].height, rows[0].num_inference_steps, rows[0].guidance_scale) == (
        g.width, g.height, g.num_inference_steps, g.guidance_scale)
    assert (rows[1].width, rows[1].seed, rows[0].seed) == (64, 5, None)
    assert rows[0].negative_prompt is None and rows[0].num_images_per_prompt == 2
    assert rows[1].set_fields and "width" in rows[1].set_fields and "width" not in rows[0].set_fields


def test_read_rows_refuses_a_negative_prompt_flux_ignores(compose, tmp_path):
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "a dog", "negative_prompt": "blur"})
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "dataset.on_ignored=error")
    with pytest.raises(DatasetError, match=r"rows.jsonl:2: field 'negative_prompt' = .*is ignored by model=tiny_flux"):
        e.read_rows()


def test_an_ignored_value_is_stripped_and_recorded_under_record(compose, tmp_path, caplog):
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "a dog", "negative_prompt": "blur"})
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "dataset.on_ignored=record")
    with caplog.at_level("WARNING", logger="runner"):
        rows, _ = e.read_rows()
    assert rows[0].ignored is None and rows[1].negative_prompt is None
    assert rows[1].ignored["negative_prompt"]["value"] == "blur"
    assert rows[1].ignored["negative_prompt"]["from"].endswith("rows.jsonl:2")
    assert "1 of 2 rows set or take a value that model=tiny_flux ignores (negative_prompt)" in caplog.text


def test_a_chosen_default_the_model_ignores_is_refused_its_own_is_recorded(compose, tmp_path):
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat"})
    # tiny_wan: WanPipeline takes no true_cfg_scale; the user chose 2.0 on the command line
    over = ["model=tiny_wan", "dataset=jsonl", f"dataset.path={p}", "dataset.on_ignored=error",
            "model.generation.true_cfg_scale=2.0"]
    e = _engine(compose, *over)
    with pytest.raises(ConfigValueError) as ex:
        e.check_ignored([_row(1)], p)
    assert str(ex.value).startswith("model.generation.true_cfg_scale=2.0 is ignored by model=tiny_wan: WanPipeline "
                                    "takes no true_cfg_scale")
    assert e.chosen("model.generation.true_cfg_scale", 2.0)
    rec = _engine(compose, *over[:-2], "dataset.on_ignored=record", over[-1])  # accepted: recorded in each row
    out = rec.check_ignored([_row(1), _row(2)], p)
    assert [r.ignored["true_cfg_scale"]["value"] for r in out] == [2.0, 2.0]
    assert {r.ignored["true_cfg_scale"]["from"] for r in out} == {"model.generation.true_cfg_scale"}
    assert all(r.ignored["true_cfg_scale"]["why"].startswith("WanPipeline takes no true_cfg_scale") for r in out)


def test_items_and_batches_keep_seeds_and_shapes(flux):
    rows = [_row(1), _row(2), _row(3)]
    rows[1] = Row(**{**rows[1].__dict__, "width": 128, "seed": 7, "num_images_per_prompt": 2})
    items = flux.items(rows, 0)
    assert [it.seed for it in items][1:3] == [7, 8]
    assert [[it.row.id for it in b] for b in flux.batches(items, 2)] == [["r1", "r3"], ["r2", "r2"]]
    assert [[it.row.id for it in b] for b in flux.batches(items, 1)] == [["r1"], ["r3"], ["r2"], ["r2"]]


def test_record_carries_the_parameters_as_applied(flux8):
    import hashlib

    row = Row(**{**_row(4, prompt=LONG).__dict__, "meta": {"k": 1}, "ignored": {"x": {"value": 1}}})
    item = flux8.items([row], 0)[0]
    rec = flux8.record(item, None, 3, 1.234567)
    assert rec["id"] == "r4" and rec["index"] == item.index and rec["key"] == item.key and rec["seed"] == 0
    assert rec["prompt"] == LONG and rec["prompt_sha256"] == hashlib.sha256(LONG.encode()).hexdigest()
    assert rec["params"]["width"] == 64 and rec["params"]["height"] == 64 and rec["params"]["batch_size"] == 3
    assert rec["params"]["num_inference_steps"] == 3 and rec["params"]["guidance_scale"] == 4.0
    assert rec["tokens"] == flux8.prompt_tokens([LONG])[0] and rec["timing"] == {"generate_s": 1.2346}
    assert rec["meta"] == {"k": 1} and rec["ignored"] == {"x": {"value": 1}} and "inputs" not in rec
    plain = flux8.record(flux8.items([_row(5)], 0)[0], None, 1, 0.0)
    assert "meta" not in plain and "ignored" not in plain


def test_prompts_section_counts_truncated_items(flux, caplog):
    recs = [{"status": "ok", "tokens": {"t5": {"dropped": 2}, "clip": {"dropped": 0}}},
            {"status": "ok", "tokens": {"t5": {"dropped": 0}, "clip": {"dropped": 0}}}]
    with caplog.at_level("WARNING", logger="runner"):
        out = flux.prompts_section(recs)
    assert out["items"] == 2 and out["truncated_items"] == 1 and out["truncated_by_encoder"]["t5"] == 1
    assert (out["on_truncation"], out["on_ignored"]) == ("record", "error")
    assert "1 of 2 items had prompts truncated by a text encoder (t5: 1)" in caplog.text


def test_row_context_and_builtin_rows(compose, flux):
    assert flux.row_context() == {"task": "text_to_image", "multi_image": False,
                                  "tasks": ("text_to_image", "image_to_image", "inpaint", "edit")}
    q = _engine(compose, "model=tiny_qwen_image_edit")  # QwenImageEditPlus: a list of references for edit
    assert q.row_context()["task"] == "edit" and q.row_context()["multi_image"] is True
    assert flux.builtin_rows() == str(flux.cfg.builtin_prompts)


def _fed(e, pipeline):
    e.ctx.run.model.pipeline = pipeline  # the run's model: a pipeline of stages whose last one this engine runs
    return _truncation(e).fed()


def test_a_stage_is_fed_when_it_is_the_last_of_a_pipeline_of_several(compose):
    from types import SimpleNamespace

    e = _engine(compose, "model=tiny_flux", "model.generation.max_sequence_length=8", "dataset.on_truncation=error")
    assert e.stage == "denoise"
    assert _fed(e, ["upstream", "denoise"]) is True
    assert _fed(e, ["denoise"]) is False
    assert _fed(e, ["denoise", "upstream"]) is False
    assert _fed(e, []) is False
    rows = [_row(1, prompt=LONG)]
    _fed(e, ["upstream", "denoise"])
    assert _truncation(e).prepare_rows(rows, "p") == rows  # fed prompts are checked per batch instead
    batch = [SimpleNamespace(row=_row(1)), SimpleNamespace(row=_row(7, prompt=LONG))]
    with pytest.raises(DatasetError) as ex:
        _truncation(e).before_call(batch)
    t5 = e.prompt_tokens([LONG])[0]["t5"]
    assert str(ex.value).count("truncated") == 1
    assert (f"row 'r7' (line 7): the prompt fed by the upstream stage is truncated: t5 {t5['count']} tokens, "
            f"{t5['count'] - 8} over its limit of 8 (dataset.on_truncation=error)") in str(ex.value)
    _truncation(e).before_call(batch[:1])
    _fed(e, ["denoise"])
    _truncation(e).before_call(batch)  # not fed: the dataset's prompts were checked at startup


def test_tokenizers_are_the_loaded_pipelines_once_loaded(compose):
    from diffusers import FluxPipeline

    e = _engine(compose, "model=tiny_flux", "model.generation.max_sequence_length=8")
    comps = type(e).build_components(e.arch_copy(), device="meta")
    comps["tokenizer_2"].model_max_length = 300  # differs from the built one's 512
    built = e.tokenizers()
    assert built["t5"].model_max_length == 512 and e.sequence_limit() == 512
    e.pipe, e._toks = FluxPipeline(**comps), None
    toks = e.tokenizers()
    assert toks == {"clip": comps["tokenizer"], "t5": comps["tokenizer_2"]}
    assert e.sequence_limit() == 300


def test_tokenizers_are_the_snapshots_with_model_path(compose, tmp_path):
    import json

    e = _engine(compose, "model=tiny_flux")
    toks = e.build_tokenizers(e.arch_copy())
    toks["tokenizer_2"].model_max_length = 200
    for comp, tok in toks.items():
        tok.save_pretrained(tmp_path / comp)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                           "tokenizer": ["transformers", type(toks["tokenizer"]).__name__],
                                                           "tokenizer_2": ["transformers", type(toks["tokenizer_2"]).__name__]}))
    s = _engine(compose, "model=tiny_flux")
    s.source = {"kind": "path", "path": str(tmp_path)}  # resolved: the snapshot's folders (its weights not needed)
    assert s.tokenizers()["t5"].model_max_length == 200 and s.sequence_limit() == 200


@pytest.mark.parametrize("m, limit", [(10 ** 9, None), (2 * 10 ** 9, None), (int(1e30), None), (None, None),
                                      (10 ** 9 - 1, 10 ** 9 - 1), (300, 300)])
def test_a_tokenizer_length_of_a_billion_or_more_is_no_ceiling(compose, m, limit):
    # klein: no pipeline ceiling; HF's "no limit" is int(1e30), and anything from 10**9 up is taken for it
    k = _engine(compose, "model=tiny_flux2_klein")
    k.tokenizers()["qwen3"].model_max_length = m
    assert k.sequence_limit() == limit


# ------------------------------------------------------------------ check_ignored: messages, records, the log


WAN_TC = ("WanPipeline takes no true_cfg_scale (its classifier-free guidance is guidance_scale)",
          "set guidance_scale instead")
WAN_NEG = "guidance_scale <= 1 turns classifier-free guidance off, and WanPipeline uses the negative prompt only with it"


def test_a_chosen_ignored_default_is_refused_with_key_why_and_every_fix(compose):
    e = _engine(compose, "model=tiny_wan", "dataset.on_ignored=error", "model.generation.true_cfg_scale=2.0")
    with pytest.raises(ConfigValueError) as ex:
        e.check_ignored([_row(1)], "p")
    assert str(ex.value) == (
        f"model.generation.true_cfg_scale=2.0 is ignored by model=tiny_wan: {WAN_TC[0]}; fix: "
        f"model.generation.true_cfg_scale=null, {WAN_TC[1]}, or dataset.on_ignored=record to run it and record the "
        "value as ignored")


def test_a_rows_ignored_value_is_refused_in_error_mode_with_file_line_and_model(compose):
    e = _engine(compose, "model=tiny_wan", "dataset.on_ignored=error")
    rows = [_row(1, ("negative_prompt",), guidance_scale=4.0, negative_prompt="blur"),
            _row(2, ("negative_prompt",), guidance_scale=1.0, negative_prompt="ugly")]
    with pytest.raises(DatasetError) as ex:
        e.check_ignored(rows, "rows.jsonl")
    assert ex.value.problems == [
        f"rows.jsonl:2: field 'negative_prompt' = 'ugly' is ignored by model=tiny_wan: {WAN_NEG}; fix: remove "
        "'negative_prompt' from the row, guidance_scale > 1 in that row (Wan 2.1: 5.0), or dataset.on_ignored=record "
        "to run it and record the value as ignored"]  # the family's usual guidance (WAN's guidance_hint) in the fix
    assert e.check_ignored(rows[:1], "rows.jsonl") == rows[:1]  # guidance on: the negative prompt acts


def test_ignored_values_are_stripped_recorded_and_logged_under_record(compose, caplog):
    e = _engine(compose, "model=tiny_wan", "dataset.on_ignored=record", "model.generation.true_cfg_scale=2.0")
    rows = [_row(1, ("negative_prompt",), guidance_scale=1.0, negative_prompt="blur"),
            _row(2, ("negative_prompt",), guidance_scale=4.0, negative_prompt="ugly"), _row(3)]
    with caplog.at_level("WARNING", logger="runner"):
        out = e.check_ignored(rows, "rows.jsonl")
    tc = {"value": 2.0, "why": WAN_TC[0], "from": "model.generation.true_cfg_scale"}
    assert [r.ignored for r in out] == [
        {"negative_prompt": {"value": "blur", "why": WAN_NEG, "from": "rows.jsonl:1"}, "true_cfg_scale": tc},
        {"true_cfg_scale": tc}, {"true_cfg_scale": tc}]
    assert [r.negative_prompt for r in out] == [None, "ugly", None]
    assert caplog.messages == [
        "3 of 3 rows set or take a value that model=tiny_wan ignores (negative_prompt, true_cfg_scale); it is not "
        "applied, and their records list it under 'ignored' (a row's value under dataset.on_ignored=record, or a "
        "default of the model that does not act on them)"]
    caplog.clear()
    plain = _engine(compose, "model=tiny_wan", "dataset.on_ignored=record")
    with caplog.at_level("WARNING", logger="runner"):
        out = plain.check_ignored(rows, "rows.jsonl")
    assert [r.ignored is None for r in out] == [False, True, True]
    assert caplog.messages[0].startswith("1 of 3 rows set or take a value that model=tiny_wan ignores "
                                         "(negative_prompt); it is not applied")
    caplog.clear()
    with caplog.at_level("WARNING", logger="runner"):
        assert plain.check_ignored(rows[1:], "rows.jsonl") == rows[1:]  # nothing ignored: no record, no log
    assert caplog.messages == []


def test_the_ignored_rules_read_the_rows(compose):
    # FLUX's true CFG: true_cfg_scale > 1 is ignored only when no row has a negative prompt
    e = _engine(compose, "model=tiny_flux", "dataset.on_ignored=record", "model.generation.true_cfg_scale=2.0")
    assert e.check_ignored([_row(1)], "p")[0].ignored["true_cfg_scale"]["value"] == 2.0
    with_neg = [_row(1), _row(2, ("negative_prompt",), negative_prompt="blur")]
    assert [r.ignored for r in e.check_ignored(with_neg, "p")] == [None, None]


def test_the_models_own_ignored_default_is_recorded_not_refused(compose):
    # qwen_image's YAML sets true_cfg_scale: 4.0 (the model card's) and the rows have no negative prompt
    e = _engine(compose, "model=qwen_image", "model.load_format=dummy", "dataset.on_ignored=error")
    out = e.check_ignored([_row(1), _row(2)], "p")
    assert [r.ignored["true_cfg_scale"]["value"] for r in out] == [4.0, 4.0]
    assert {r.ignored["true_cfg_scale"]["from"] for r in out} == {"model.generation.true_cfg_scale"}
    assert e.chosen("model.generation.true_cfg_scale", 4.0) is False  # the YAML's own value
    assert e.chosen("model.generation.true_cfg_scale", 3.0) is True  # another value: the user's (an experiment)


def _wan22_rows(e, *rows):
    from dataclasses import replace

    return [replace(r, spec=e.row_spec()) for r in rows]


def test_a_default_ignored_in_some_rows_is_recorded_there_even_in_error_mode(compose):
    # tiny_wan22's guidance_scale_2: 3.0 acts only under classifier-free guidance (guidance_scale > 1)
    e = _engine(compose, "model=tiny_wan22", "dataset.on_ignored=error")
    out = e.check_ignored(_wan22_rows(e, _row(1, guidance_scale=1.0), _row(2, guidance_scale=4.0)), "p")
    assert out[0].ignored == {"guidance_scale_2": {
        "value": 3.0, "why": "guidance_scale <= 1 turns classifier-free guidance off for both experts",
        "from": "model.generation.guidance_scale_2"}}
    assert out[1].ignored is None


def test_a_partly_ignored_default_does_not_end_the_check_of_the_next_fields(compose):
    # the rules after a rule that applies to some rows only are still checked: a chosen default they ignore is refused
    e = _engine(compose, "model=tiny_wan22", "dataset.on_ignored=error", "model.generation.true_cfg_scale=2.0")
    rules = e.ignored_fields([])
    assert list(rules) == ["true_cfg_scale", "negative_prompt", "guidance_scale_2"]

    class Later(type(e)):  # the same rules, the one that applies to some rows first
        def ignored_fields(self, rows):
            out = super().ignored_fields(rows)
            return {"guidance_scale_2": out["guidance_scale_2"], "true_cfg_scale": out["true_cfg_scale"]}

    e.__class__ = Later
    with pytest.raises(ConfigValueError, match=r"^model.generation.true_cfg_scale=2.0 is ignored by model=tiny_wan22"):
        e.check_ignored(_wan22_rows(e, _row(1, guidance_scale=1.0)), "p")


# ------------------------------------------------------------------------- read_rows: the run's dataset options


def test_read_rows_checks_sizes_against_the_models_multiple_and_the_runs_max_pixels(compose, tmp_path):
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat", "width": 72})
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}")
    with pytest.raises(DatasetError, match="field 'width' = 72 is not a positive multiple of 16"):
        e.read_rows()  # tiny_flux: VAE factor 8 x patch 2
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat"})  # 128 x 128 from model.generation
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "max_pixels=16000")
    with pytest.raises(DatasetError, match="128x128 exceeds max_pixels=16000"):
        e.read_rows()
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "max_pixels=16384")
    assert [r.width * r.height for r in e.read_rows()[0]] == [16384]


def test_a_bad_size_default_is_the_config_keys_before_any_row_is_read(compose, tmp_path):
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat"})
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "model.generation.width=72")
    with pytest.raises(ConfigValueError) as ex:
        e.read_rows()
    # round(72 / 16) * 16 = 64 (round half to even)
    assert str(ex.value) == ("model.generation.width=72 is not a positive multiple of 16 (the value of 'width' in every "
                             "row that does not set it); fix: model.generation.width=64")


def test_read_rows_takes_the_runs_limit_columns_and_extra_fields(compose, tmp_path):
    p = _jsonl(tmp_path, {"id": "a", "text": "a cat", "mood": "calm"}, {"id": "b", "text": "a dog", "mood": "wild"})
    base = ["model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "dataset.columns={prompt: text}"]
    rows, _ = _engine(compose, *base, "dataset.extra_fields=keep").read_rows()
    assert [(r.prompt, r.meta) for r in rows] == [("a cat", {"mood": "calm"}), ("a dog", {"mood": "wild"})]
    rows, _ = _engine(compose, *base, "dataset.extra_fields=keep", "dataset.limit=1").read_rows()
    assert [r.id for r in rows] == ["a"]
    with pytest.raises(DatasetError, match="mood"):  # extra_fields=error (the default): a field no row has
        _engine(compose, *base).read_rows()
    with pytest.raises(DatasetError, match="prompt"):  # without the column mapping: no prompt
        _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "dataset.extra_fields=keep").read_rows()


def test_read_rows_of_builtin_reads_the_models_builtin_prompts(compose):
    from runner.core.dataset import BUILTIN_PROMPTS

    e = _engine(compose, "model=tiny_flux", "dataset=builtin", "model.builtin_prompts=shapes.jsonl")
    rows, path = e.read_rows()
    assert path == BUILTIN_PROMPTS.parent / "shapes.jsonl" != BUILTIN_PROMPTS  # not load_rows' default file
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) == len(lines) > 1


def test_read_rows_validates_by_the_engines_row_spec(compose, tmp_path):
    # WAN_ROW has guidance_scale_2 (the low-noise expert's scale); the plain diffusion row has not
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat", "guidance_scale_2": 2.0})
    rows, _ = _engine(compose, "model=tiny_wan22", "dataset=jsonl", f"dataset.path={p}").read_rows()
    assert rows[0].guidance_scale_2 == 2.0 and "guidance_scale_2" in rows[0].set_fields
    with pytest.raises(DatasetError, match="guidance_scale_2"):
        _engine(compose, "model=tiny_wan", "dataset=jsonl", f"dataset.path={p}").read_rows()


def test_read_rows_names_the_rows_file_in_the_engines_checks(compose, tmp_path):
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat"}, {"id": "b", "prompt": "a dog", "num_frames": 9})
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}")
    with pytest.raises(ConfigValueError, match=f"^num_frames=9 \\({p}:2 \\(row 'b'\\), 1 row\\(s\\)\\)"):
        e.read_rows()  # FamilyRows.check_rows
    p = _jsonl(tmp_path, {"id": "a", "prompt": LONG})
    e = _engine(compose, "model=tiny_flux", "dataset=jsonl", f"dataset.path={p}", "dataset.on_truncation=error",
                "model.generation.max_sequence_length=8")
    with pytest.raises(DatasetError) as ex:
        e.read_rows()  # the truncation pass
    assert [x.split(": prompt of")[0] for x in ex.value.problems] == [f"{p}:1"]


def _png(path, size):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    return path


def test_read_rows_of_an_edit_model_takes_references_beside_the_rows_or_under_media_root(compose, tmp_path):
    # tiny_qwen_image_edit: model.task=edit, a list of references (multi_image), each sized by the pipeline from
    # a pixel area (input_sizing: area), so a 48x80 input is taken for a 64x64 row
    _png(tmp_path / "rows" / "a.png", (48, 80))
    _png(tmp_path / "media" / "b.png", (48, 80))
    p = _jsonl(tmp_path / "rows", {"id": "a", "prompt": "make it blue", "image": ["a.png", "a.png"]})
    e = _engine(compose, "model=tiny_qwen_image_edit", "dataset=jsonl", f"dataset.path={p}")
    rows, _ = e.read_rows()
    assert rows[0].inputs and len(rows[0].inputs["image"]) == 2
    assert rows[0].inputs["image"][0].path == str(tmp_path / "rows" / "a.png")
    q = _jsonl(tmp_path / "rows", {"id": "b", "prompt": "make it blue", "image": "b.png"})
    with pytest.raises(DatasetError, match="b.png"):  # not beside the rows file
        _engine(compose, "model=tiny_qwen_image_edit", "dataset=jsonl", f"dataset.path={q}").read_rows()
    rows, _ = _engine(compose, "model=tiny_qwen_image_edit", "dataset=jsonl", f"dataset.path={q}",
                      f"dataset.media_root={tmp_path / 'media'}").read_rows()
    assert rows[0].inputs["image"].path == str(tmp_path / "media" / "b.png")


# ------------------------------------------------------------------------------------- builtin rows of a task


def test_builtin_rows_of_a_conditioning_task_are_the_stems_task_file(compose):
    def rows(*o):
        return _engine(compose, "model=tiny_flux", *o).builtin_rows()

    assert rows("dataset=builtin") == "prompts.jsonl"  # the generation task: builtin_prompts itself
    assert rows("dataset=builtin", "model.task=image_to_image") == "prompts.image_to_image.jsonl"
    assert rows("dataset=builtin", "model.task=inpaint", "model.builtin_prompts=shapes.jsonl") == \
        "shapes.inpaint.jsonl"
    assert rows("dataset=jsonl", "dataset.path=x.jsonl", "model.task=image_to_image") == "prompts.jsonl"  # not read
    with pytest.raises(ConfigValueError) as ex:
        rows("dataset=builtin", "model.task=edit", "model.builtin_prompts=shapes.jsonl")
    assert str(ex.value) == ("model=tiny_flux ships no builtin rows for model.task=edit (no runner/data/shapes.edit.jsonl)"
                             "; fix: dataset=jsonl dataset.path=<rows with image paths>")
    # a video family's generation task reads builtin_prompts itself (no motion.text_to_video.jsonl)
    assert _engine(compose, "model=tiny_wan", "dataset=builtin", "model.builtin_prompts=motion.jsonl").builtin_rows() \
        == "motion.jsonl"


def test_builtin_rows_may_be_a_models_own_file(compose, tmp_path):
    own = tmp_path / "edits.jsonl"
    own.write_text('{"id": "a", "prompt": "x"}\n')
    assert _engine(compose, "model=tiny_flux", "dataset=builtin", "model.task=edit",
                   f"model.builtin_prompts={own}").builtin_rows() == str(own)
    with pytest.raises(ConfigValueError) as ex:
        _engine(compose, "model=tiny_flux", "dataset=builtin", "model.task=edit",
                f"model.builtin_prompts={tmp_path / 'none.jsonl'}").builtin_rows()
    assert str(ex.value) == (f"model.builtin_prompts={str(tmp_path / 'none.jsonl')!r} (model=tiny_flux) is not a file; "
                             "fix: the path of the model's rows file, or a name under runner/data")


# ------------------------------------------------------------------------- row specs: passes' and family fields


def _tag_pass(pass_name, field_name):
    from models.passes import Pass
    from runner.core.dataset import Field

    return type(f"_{pass_name}", (Pass,), {"name": pass_name, "row_fields": (Field(field_name, str),)})


def test_the_passes_row_fields_extend_the_diffusion_row_in_pass_order(compose):
    from runner.core.dataset import DIFFUSION_ROW

    e = _engine(compose, "model=tiny_flux")
    assert e.row_spec().name == DIFFUSION_ROW.name and e.row_spec().fields == DIFFUSION_ROW.fields
    tag, mood = _tag_pass("tag", "tag"), _tag_pass("mood", "mood")
    e.__class__ = type("WithRows", (type(e),), {"PASSES": (*type(e).PASSES, tag, type(e).PASSES[0], mood)})
    spec = e.row_spec()
    assert spec.name == f"{DIFFUSION_ROW.name}+tag+mood"
    assert spec.fields == DIFFUSION_ROW.fields + tag.row_fields + mood.row_fields


def test_a_familys_row_fields_follow_the_diffusion_row_under_its_name(compose):
    from dataclasses import replace

    from runner.core.dataset import DIFFUSION_ROW, Field

    e = _engine(compose, "model=tiny_flux")
    mood = Field("mood", str)
    e.spec = replace(e.spec, row_fields=(mood,))
    spec = e.row_spec()
    assert spec.name == f"{DIFFUSION_ROW.name}+flux" and spec.fields == DIFFUSION_ROW.fields + (mood,)
    e.spec = None  # model.engine=diffusers: no family spec, the diffusion row
    assert e.row_spec().fields == DIFFUSION_ROW.fields and e.row_spec().name == DIFFUSION_ROW.name
    assert e.row_context() == {"task": "text_to_image", "multi_image": False, "tasks": ()}


def test_the_base_row_context_is_a_text_to_image_row():
    from models.diffusion_rows import DiffusionRows

    assert DiffusionRows().row_context() == {"task": "text_to_image", "multi_image": False}


# ------------------------------------------------------------------------------ tokenizers of an embedded model


def _save_tokenizers(e, root, t5_length):
    import json

    toks = e.build_tokenizers(e.arch_copy())
    toks["tokenizer_2"].model_max_length = t5_length
    for comp, tok in toks.items():
        tok.save_pretrained(root / comp)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline", **{
        comp: ["transformers", type(tok).__name__] for comp, tok in toks.items()}}))


def test_tokenizers_of_an_embedded_model_in_the_cache_are_its_snapshots(compose, tmp_path):
    e = _engine(compose, "model=tiny_flux")
    e.cache_dir = str(tmp_path / "cache")
    target = e.embedded_target(e.arch_copy())
    _save_tokenizers(e, target, 200)
    assert e.tokenizers()["t5"].model_max_length == 200 and e.source == {"kind": "embedded"}
    # not yet in the cache (no model_index.json in its folder): built from the architecture
    f = _engine(compose, "model=tiny_flux")
    f.cache_dir = str(tmp_path / "cache")
    f.resolve_source()
    d = _engine(compose, "model=tiny_flux", "model.load_format=dummy")  # dummy weights never read the cache
    d.cache_dir = str(tmp_path / "cache")
    assert d.embedded_target(d.arch_copy()) == target and d.tokenizers()["t5"].model_max_length == 512
    (target / "model_index.json").unlink()
    assert f.tokenizers()["t5"].model_max_length == 512


def test_tokenizers_are_built_for_the_task(compose):
    # Qwen-Image-Edit's tokenizer has Qwen2-VL's vision tokens, the text-to-image one has not
    e = _engine(compose, "model=tiny_qwen_image_edit")
    assert e.task == "edit"
    tok = e.tokenizers()["qwen2_5_vl"]
    assert len(tok) == len(e.build_tokenizers(e.arch_copy(), "edit")["tokenizer"]) \
        > len(e.build_tokenizers(e.arch_copy())["tokenizer"])


# ------------------------------------------------------------------------------------ FLUX.2's token counts


def test_flux2_counts_the_system_message_and_the_mistral_chat_markers(compose):
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE

    e = _engine(compose, "model=tiny_flux2")
    tok = e.tokenizers()["mistral3"]
    prompts = ["a cat", "a red dog on a sofa"]
    # Mistral's template: <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]prompt[/INST]
    expected = [len(tok(f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]{p}[/INST]",
                        add_special_tokens=False)["input_ids"]) for p in prompts]
    assert e.count_tokens("mistral3", tok, prompts) == expected
    assert expected[0] > len(tok(SYSTEM_MESSAGE, add_special_tokens=False)["input_ids"]) + 5  # the system message counts
    assert e.prompt_tokens(prompts[:1])[0]["mistral3"]["count"] == expected[0]


def test_flux2_klein_counts_qwen3s_chat_template_without_thinking(compose):
    e = _engine(compose, "model=tiny_flux2_klein")
    tok = e.tokenizers()["qwen3"]
    prompts = ["a cat", "a red dog on a sofa"]
    # Qwen3's template with enable_thinking=False: the user turn, then an empty think block opening the answer
    expected = [len(tok(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
                        add_special_tokens=False)["input_ids"]) for p in prompts]
    assert e.count_tokens("qwen3", tok, prompts) == expected


# ---------------------------------------------------------------------- FamilyRows.check_rows: the other rules


def test_a_video_pipeline_under_an_image_engine_is_refused(compose):
    e = _engine(compose, "model=tiny_wan")
    e.video = False  # WanPipeline (it takes num_frames) driven as an image family
    with pytest.raises(ConfigValueError) as ex:
        e.check_rows([_row(1)], "p")
    assert str(ex.value) == ("model=tiny_wan: WanPipeline generates video, and model.engine=wan writes images; fix: the "
                             "video family's engine (model.engine=wan for WanPipeline snapshots)")


def test_rows_of_a_spec_without_video_fields_pass_an_image_models_check(flux):
    from dataclasses import replace

    from runner.core.dataset import IMAGE_ROW

    row = replace(_row(1), spec=IMAGE_ROW)  # no fps, no num_frames: reading them raises
    with pytest.raises(AttributeError):
        row.fps
    flux.check_rows([row], "p")


def test_a_field_the_pipeline_does_not_take_names_every_fix(flux):
    with pytest.raises(ConfigValueError) as ex:
        flux.check_rows([_row(2, ("num_frames",), num_frames=9)], "p")
    assert str(ex.value) == ("num_frames=9 (p:2 (row 'r2'), 1 row(s)): FluxPipeline (model=tiny_flux) takes no num_frames "
                             "argument, so it cannot be applied; fix: remove num_frames from the rows (and "
                             "model.generation), or use a model that takes it")


def test_check_rows_runs_the_familys_rules_and_the_oracles_with_the_rows_file(compose, wan):
    with pytest.raises(DatasetError) as ex:  # WAN's frame rule, through check_family_rows
        wan.check_rows([_row(1, ("num_frames",), num_frames=10)], "rows.jsonl")
    assert ex.value.problems[0].startswith("rows.jsonl:1: num_frames=10 is not 4k+1")
    toy = _engine(compose, "model=toy_shapes")
    good, bad = (Row(**{**_row(n).__dict__, "expect": x}) for n, x in ((1, {"color": "red"}), (2, {"colour": "red"})))
    toy.check_rows([good], "rows.jsonl")
    with pytest.raises(DatasetError) as ex:  # toy_shapes' oracle: expect names what it reads
        toy.check_rows([good, bad], "rows.jsonl")
    assert [x.split(": ")[0] for x in ex.value.problems] == ["rows.jsonl:2"]
    assert "expect.colour is not an attribute the toy_shapes oracle reads" in ex.value.problems[0]


def test_the_familys_cfg_threshold_decides_where_a_negative_prompt_acts(compose):
    # Z-Image: classifier-free guidance where guidance_scale > 0 (not > 1)
    z = _engine(compose, "model=tiny_zimage")
    why, fix, applies = z.ignored_fields([_row(1)])["negative_prompt"]
    assert why.startswith("guidance_scale <= 0 turns classifier-free guidance off")
    assert [applies(_row(1, guidance_scale=g)) for g in (0.0, 0.5, 1.0)] == [True, False, False]


# ----------------------------------------------------------------------------------------- FLUX.2's messages


def test_flux2_negative_prompt_rules_say_why_per_pipeline(compose):
    assert _engine(compose, "model=tiny_flux2").negative_prompt_rule() == (
        "Flux2Pipeline takes no negative prompt (guidance-distilled: guidance_scale feeds its guidance embedding, "
        "there is no unconditional branch)", "remove negative_prompt from the rows")
    assert _engine(compose, "model=tiny_flux2_klein").negative_prompt_rule() == (
        "Flux2KleinPipeline takes no negative prompt (its CFG's unconditional branch is the empty prompt)",
        "remove negative_prompt from the rows")


def test_a_distilled_klein_ignores_guidance_scale_saying_why(compose):
    dist = _engine(compose, "model=tiny_flux2_klein", "model.architecture.pipeline.is_distilled=true")
    assert dist.ignored_fields([_row(1)])["guidance_scale"] == (
        "its pipeline config says is_distilled=true: Flux2KleinPipeline runs no classifier-free guidance, whatever "
        "guidance_scale", "guidance_scale: null")


def test_text_layer_problems_are_all_named_with_the_fix(compose):
    e = _engine(compose, "model=tiny_flux2_klein", "model.architecture.text_encoder.num_hidden_layers=26",
                "model.architecture.transformer.joint_attention_dim=24")
    with pytest.raises(ConfigValueError) as ex:
        e.check_text_layers()
    hidden = e.component_config("text_encoder")["hidden_size"]
    assert str(ex.value) == (
        "model=tiny_flux2_klein: text_encoder num_hidden_layers=26, and Flux2KleinPipeline reads hidden states "
        f"(9, 18, 27) (at least 27 layers); transformer joint_attention_dim=24, and Flux2KleinPipeline stacks 3 hidden "
        f"states of {hidden} ({3 * hidden}); the pipeline would fail at the first prompt; fix: "
        "model.architecture.text_encoder / transformer consistent with it (see conf/model/tiny_flux2*.yaml)")


# ----------------------------------------------------------------------------- records, items, the logs' counts


def test_record_keeps_input_files_under_inputs_and_other_values_under_params(compose, tmp_path):
    import hashlib

    img = _png(tmp_path / "a.png", (128, 128))
    p = _jsonl(tmp_path, {"id": "a", "prompt": "a cat", "image": "a.png", "strength": 0.6})
    e = _engine(compose, "model=tiny_flux", "model.task=image_to_image", "dataset=jsonl", f"dataset.path={p}")
    rows, _ = e.read_rows()
    rec = e.record(e.items(rows, 0)[0], None, 1, 0.0)
    assert rec["params"]["strength"] == 0.6 and "image" not in rec["params"]
    assert rec["inputs"]["image"]["sha256"] == hashlib.sha256(img.read_bytes()).hexdigest()
    assert rec["inputs"]["image"]["path"] == str(img)


def test_record_carries_the_negative_prompt_as_given(flux8):
    rec = flux8.record(flux8.items([_row(1, negative_prompt="blurry")], 0)[0], None, 1, 0.0)
    assert rec["negative_prompt"] == "blurry" and rec["params"]["negative_prompt"] == "blurry"


def test_items_of_rows_without_a_seed_take_it_from_the_run_seed(flux):
    row = Row(**{**_row(1).__dict__, "seed": None})
    a, b = flux.items([row], 1)[0].seed, flux.items([row], 2)[0].seed
    assert a != b and flux.items([row], 1)[0].seed == a


def test_prompts_section_logs_each_truncating_encoder(flux, caplog):
    recs = [{"status": "ok", "tokens": {"t5": {"dropped": 2}, "clip": {"dropped": 5}}},
            {"status": "ok", "tokens": {"t5": {"dropped": 1}, "clip": {"dropped": 0}}},
            {"status": "ok", "tokens": {"t5": {"dropped": 0}, "clip": {"dropped": 0}}}]
    with caplog.at_level("WARNING", logger="runner"):
        flux.prompts_section(recs)
    assert caplog.messages == ["2 of 3 items had prompts truncated by a text encoder (t5: 2, clip: 1); their records "
                               "say how many tokens were dropped"]


def test_the_truncation_log_names_every_encoder_that_drops_tokens(flux8, caplog):
    long = " ".join(["cat"] * 100)  # past CLIP's 77 and T5's 8
    rows = [_row(1, prompt=long), _row(2, prompt=LONG)]
    with caplog.at_level("WARNING", logger="runner"):
        _truncation(flux8).prepare_rows(rows, "p")
    assert caplog.messages[0].startswith("2 of 2 rows have prompts longer than a text encoder takes (clip: 1 over 77, "
                                         "t5: 2 over 8);")


def test_counting_a_long_prompt_logs_no_tokenizer_warning(compose):
    import logging

    e = _engine(compose, "model=tiny_flux")
    tok = e.tokenizers()["clip"]
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        n = e.count_tokens("clip", tok, [" ".join(["cat"] * 100)])[0]
    finally:
        logger.removeHandler(handler)
    assert n > 77 and not [m for m in seen if "Token indices sequence length" in m]


def test_a_snapshot_without_a_tokenizer_is_refused_naming_the_pipeline(compose, tmp_path):
    import json

    from runner.core.weights import ModelPathError

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    e = _engine(compose, "model=tiny_flux")
    with pytest.raises(ModelPathError, match="which FluxPipeline needs"):
        e.snapshot_tokenizers(tmp_path)


def test_a_stage_without_a_run_config_is_not_fed(compose):
    e = _engine(compose, "model=tiny_flux")
    e.ctx.run = None
    assert _truncation(e).fed() is False


def test_read_rows_reads_the_runs_split_of_a_hf_dataset(compose, tmp_path):
    from _helpers import import_extra

    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a fox"}]),
                          "test": datasets.Dataset.from_list([{"prompt": "an owl"}, {"prompt": "a bee"}])}
                         ).save_to_disk(str(tmp_path / "d"))
    base = ["model=tiny_flux", "dataset=hf", f"dataset.path={tmp_path / 'd'}"]
    assert [r.prompt for r in _engine(compose, *base, "dataset.split=test").read_rows()[0]] == ["an owl", "a bee"]
    assert [r.prompt for r in _engine(compose, *base).read_rows()[0]] == ["a fox"]  # default: train


def test_record_params_carry_the_rows_further_values(flux8):
    # lora and lora_scale: row values no pass re-states in applied_params (strength, num_frames, fps are)
    rec = flux8.record(flux8.items([_row(1, ("lora", "lora_scale"), lora="style", lora_scale=0.8)], 0)[0], None, 1, 0.0)
    assert (rec["params"]["lora"], rec["params"]["lora_scale"]) == ("style", 0.8)
