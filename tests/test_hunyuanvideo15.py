"""HunyuanVideo-1.5 (``model.engine=hunyuanvideo15``, diffusers ``HunyuanVideo15Pipeline``) on CPU: the tiny model
end to end to ``verified`` (the guider's forwards per row, glyph tokens, the video's geometry against its record),
repro and resume; the refiner's dispatching processor against diffusers' own; the local tokenizer's template crop;
the refusals of what the pipeline would change silently (frames, guidance below 1, text length, a step-skipping
guider)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_families import _engine
from test_report import _tail, run_module

ROWS = [{"id": "sign", "prompt": 'a shop sign that reads "OPEN" at night', "negative_prompt": "blurry", "seed": 1,
         "guidance_scale": 6.0},
        {"id": "plain", "prompt": "a blue sphere in the sky", "seed": 2, "guidance_scale": 1.0, "num_frames": 5,
         "width": 48, "height": 32}]


@pytest.fixture(scope="module")
def hy_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hy15")
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    p = run_module("runner", ["model=tiny_hunyuanvideo15", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}",
                              f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert p.returncode == 0, _tail(p)
    (root / "console.txt").write_text(p.stdout + p.stderr)
    return root / "run"


def test_console_has_no_library_line(hy_run):
    """Issue #38: no transformers warning that the tiny Qwen encoder's bos/eos ids (Qwen's 151643/151645) lie
    outside its vocabulary, no diffusers "Guiders are currently an experimental feature" on the guider's load."""
    from _helpers import library_noise

    console = (hy_run.parent / "console.txt").read_text()
    assert "run completed: 2 ok" in console, console[-2000:]
    assert not library_noise(console), library_noise(console)


def test_tiny_runs_verified_with_the_guiders_forwards(hy_run):
    """Row ``sign`` (guidance 6) makes 2 forwards per step, row ``plain`` (guidance 1: the guider's single
    condition) 1: 4 x 2 + 4 x 1 observed; every attention site (the refiner's too) ran through the dispatcher."""
    man = json.loads((hy_run / "manifest.json").read_text())
    assert man["evidence"]["verdict"] == "verified", man["evidence"]["mismatches"]
    st = man["evidence"]["stages"]["denoise"]
    assert st["denoiser_forwards"] == st["expected_forwards"] == 4 * 2 + 4 * 1
    layers = st["attention"]["layers"]
    assert {l["layer"] for l in layers} == {"context_embedder.token_refiner.refiner_blocks.0.attn",
                                            "transformer_blocks.0.attn", "transformer_blocks.1.attn"}
    assert all(l["ok"] and l["observed"] == {"TORCH_SDPA": l["calls"]} and l["calls"] == 12 for l in layers)


def test_video_geometry_equals_the_record(hy_run):
    """Each MP4's frames, height and width are the record's params (the 48x32, 5-frame row included), and the glyph
    encoder's token count is the quoted text's bytes (``Text "OPEN". `` + ``</s>``), 0 without quotes."""
    from runner.core.video import decode_mp4

    items = {i["id"]: i for i in map(json.loads, (hy_run / "items.jsonl").read_text().splitlines())}
    assert [i["status"] for i in items.values()] == ["ok", "ok"]
    for it in items.values():
        frames = decode_mp4(hy_run / it["file"])
        p = it["params"]
        assert frames.shape[:3] == (p["num_frames"], p["height"], p["width"]), (it["id"], frames.shape, p)
    assert items["plain"]["params"]["num_frames"] == 5 and items["plain"]["params"]["width"] == 48
    assert items["sign"]["tokens"]["byt5"]["count"] == len('Text "OPEN". '.encode()) + 1
    assert items["plain"]["tokens"]["byt5"]["count"] == 0
    assert items["sign"]["params"]["guidance_scale"] == 6.0 and items["plain"]["params"]["guidance_scale"] == 1.0


def test_repro_and_resume(hy_run, tmp_path):
    p = run_module("runner.tools.repro", [hy_run, "--out", tmp_path / "rerun"], cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    check = json.loads((tmp_path / "rerun" / "repro_check.json").read_text())
    assert check["ok"] and check["problems"] == [], check
    assert [r["verdict"] for r in check["items"]] == ["ok", "ok"]
    copy = tmp_path / "copy"
    shutil.copytree(hy_run, copy)
    before = {f.name: f.read_bytes() for f in copy.rglob("*.mp4")}
    overrides = json.loads((hy_run / "manifest.json").read_text())["overrides"]
    p = run_module("runner", [*[o for o in overrides if not o.startswith("hydra.")], f"run.resume={copy}"],
                   cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    man = json.loads((copy / "manifest.json").read_text())
    assert man["resumed_from"]["reused_items"] == 2
    assert {f.name: f.read_bytes() for f in copy.rglob("*.mp4")} == before


@pytest.mark.parametrize("fused", [False, True])
def test_refiner_dispatch_processor_matches_diffusers(fused):
    """RefinerDispatchAttnProcessor against diffusers' AttnProcessor2_0 on the refiner's own Attention module, with a
    padding mask as the refiner builds it: the same output (fp32, CPU)."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    from models.hunyuanvideo15 import RefinerDispatchAttnProcessor

    torch.manual_seed(0)
    attn = Attention(query_dim=32, cross_attention_dim=None, heads=2, dim_head=16, bias=True).eval()
    x = torch.randn(2, 7, 32)
    keep = torch.tensor([[1] * 7, [1] * 4 + [0] * 3]).bool()
    m1 = keep.view(2, 1, 1, 7).repeat(1, 1, 7, 1)
    mask = m1 & m1.transpose(2, 3)
    with torch.no_grad():
        attn.set_processor(AttnProcessor2_0())
        want = attn(x, attention_mask=mask)
        if fused:
            attn.fuse_projections()
        attn.set_processor(RefinerDispatchAttnProcessor())
        got = attn(x, attention_mask=mask)
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(attn(x)[1], got[1])  # the mask matters: a processor ignoring it would differ


def test_tokenizer_template_prefix_is_the_108_tokens_the_pipeline_drops():
    from models.hunyuanvideo15 import TEMPLATE_TOKENS, HunyuanVideo15Engine, chat, template_prefix

    tok = HunyuanVideo15Engine.build_tokenizers({"tokenizer": {"vocab_size": 512}})["tokenizer"]
    assert len(tok(template_prefix())["input_ids"]) == TEMPLATE_TOKENS == 108
    ids = tok.apply_chat_template([chat("a zebra on ice")], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"][0]
    assert tok.decode(ids[:TEMPLATE_TOKENS]) == template_prefix()
    assert tok.decode(ids[TEMPLATE_TOKENS:]).startswith("a zebra on ice<|im_end|>")


@pytest.mark.parametrize("row,match", [({"num_frames": 10}, r"4k\+1"), ({"guidance_scale": 0.5}, "below 1"),
                                       ({"num_frames": 9, "guidance_scale": 1.0}, None)])
def test_rows_the_pipeline_would_change_are_refused(compose, tmp_path, write_jsonl, row, match):
    from runner.core.dataset import DatasetError

    rows = write_jsonl([{"prompt": "a cat", **row}])
    eng = _engine(compose(["model=tiny_hunyuanvideo15", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]))
    if match is None:
        got, _ = eng.read_rows()
        assert got[0].guidance_scale == row["guidance_scale"]
        return
    with pytest.raises(DatasetError, match=match) as e:
        eng.read_rows()
    assert f"{rows}:1" in e.value.problems[0]


def test_max_sequence_length_other_than_the_fixed_length_is_refused(compose):
    from runner.core.errors import ConfigValueError

    eng = _engine(compose(["model=tiny_hunyuanvideo15", "platform=cpu", "model.generation.max_sequence_length=512"]))
    with pytest.raises(ConfigValueError, match="max_sequence_length=512.*=1000"):
        eng.check_config()


@pytest.mark.parametrize("key,value", [("stop", 0.5), ("use_original_formulation", True)])
def test_guider_the_forward_rule_does_not_fit_is_refused(hy_run, compose, tmp_path, key, value):
    """A snapshot whose guider guides only part of the steps (``stop`` 0.5), or turns guidance off at 0 instead of 1
    (``use_original_formulation``), is refused before loading; the published guider passes the layout check."""
    from models.pipelines import ModelPathError

    snap = Path(json.loads((hy_run / "manifest.json").read_text())["model"]["source"]["path"])
    eng = _engine(compose(["model=tiny_hunyuanvideo15", "platform=cpu"]))
    eng.check_layout(snap)
    copy = tmp_path / "snap"
    shutil.copytree(snap, copy)
    f = copy / "guider" / "guider_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), key: value}))
    with pytest.raises(ModelPathError, match=f"'{key}': {value}"):
        eng.check_layout(copy)


def test_full_size_config_is_the_published_one():
    """conf/model/hunyuanvideo15.yaml carries models/reference/families_configs.json's entry (every component with
    a source) and builds, on the meta device, the 8.3B transformer (tencent/HunyuanVideo-1.5's published size) and
    Qwen2.5-VL-7B's language model; its size rule and frame rule are the pipeline's (16 px, 4k+1)."""
    from omegaconf import OmegaConf

    from models.hunyuanvideo15 import HunyuanVideo15Engine

    root = Path(__file__).resolve().parent.parent
    ref = json.loads((root / "models" / "reference" / "families_configs.json").read_text())["hunyuanvideo15"]
    conf = OmegaConf.to_container(OmegaConf.load(root / "conf" / "model" / "hunyuanvideo15.yaml"))
    arch = conf["architecture"]
    for comp in HunyuanVideo15Engine.components:
        assert arch[comp] == ref[comp], comp
        assert comp in ref["sources"]
    comps = HunyuanVideo15Engine.build_components(arch, device="meta", dtype=torch.bfloat16)
    n = {k: sum(p.numel() for p in v.parameters()) for k, v in comps.items() if isinstance(v, torch.nn.Module)}
    assert 8.2e9 < n["transformer"] < 8.4e9, n
    assert 6.9e9 < n["text_encoder"] < 7.2e9, n
    assert HunyuanVideo15Engine.spec.size_need(arch["vae"], arch["transformer"]) == 16
    assert (conf["generation"]["num_frames"] - 1) % arch["vae"]["temporal_compression_ratio"] == 0


def test_guider_override_that_the_snapshot_contradicts_is_refused(hy_run, compose):
    """With ``model.path`` the snapshot's ``guider/guider_config.json`` decides (it is not ``config.json``, which the
    check read before): an architecture value it contradicts is refused, the value it holds passes."""
    from runner.core.errors import ConfigValueError

    snap = Path(json.loads((hy_run / "manifest.json").read_text())["model"]["source"]["path"])
    eng = _engine(compose(["model=tiny_hunyuanvideo15", "platform=cpu"]))
    eng.check_architecture_matches_snapshot({"guider": {"guidance_scale": 6.0}}, snap)
    with pytest.raises(ConfigValueError, match=r"guider.guidance_scale=3.0: the snapshot's guider/guider_config.json"):
        eng.check_architecture_matches_snapshot({"guider": {"guidance_scale": 3.0}}, snap)


def test_a_batch_of_videos_needs_vae_slicing_and_runs_with_it(tmp_path, caplog):
    """diffusers 0.42.1's HunyuanVideo-1.5 VAE decode fails on a batch of two videos (its attention mask): the run
    found out after the batch's denoising and redid its items one by one. Refused at startup now, naming the fix;
    with ``memory.vae_slicing=true`` the batch of 2 runs as one batch (no retry) and is verified."""
    import logging

    from _helpers import execute
    from runner.core.errors import ConfigValueError

    r = execute(tmp_path / "refused", ["model=tiny_hunyuanvideo15", "batch_size=2", "dataset.limit=2"],
                catch=(ConfigValueError,))
    assert r.error is not None and "fix: memory.vae_slicing=true" in str(r.error), r.error
    assert not (tmp_path / "refused" / "items.jsonl").exists()
    with caplog.at_level(logging.WARNING):
        ok = execute(tmp_path / "sliced", ["model=tiny_hunyuanvideo15", "batch_size=2", "dataset.limit=2",
                                           "memory.vae_slicing=true"])
    assert ok.code == 0, ok.error
    recs = [json.loads(x) for x in (tmp_path / "sliced" / "items.jsonl").read_text().splitlines()]
    assert [r["params"]["batch_size"] for r in recs] == [2, 2] and all(r["status"] == "ok" for r in recs)
    assert "retrying its items one by one" not in caplog.text
    assert json.loads((tmp_path / "sliced" / "manifest.json").read_text())["evidence"]["verdict"] == "verified"
