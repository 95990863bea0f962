"""LoRA adapters (``models.lora``, issue #32 part A) on the trained toy model, through the real loop on CPU: fused at
load and switched per batch, identity-checked, resumed, refused before loading, observed; and the shipped toy adapter
``all_blue`` read back by the oracle.

Adapters here are written with seeded random ``lora_A``/``lora_B`` in diffusers' naming for toy_shapes' transformer
(its Linears read from the meta-device build, ``models.lora.base_linears``), 2 denoising steps, 2-5 rows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch
from PIL import Image

try:
    from _helpers import execute
except ImportError:  # tests/ imported as a package
    from tests._helpers import execute

from models import lora
from runner.core.errors import EvidenceError, UserInputError
from _helpers import requires_extra, skip_without_extra  # noqa: E402

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "models/toy_shapes/weights"
ALL_BLUE = REPO / "models/toy_shapes/lora/all_blue.safetensors"
MODULES = ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_v", "single_transformer_blocks.0.attn.to_k",
           "single_transformer_blocks.2.attn.to_q")
ROWS = [{"id": "red", "prompt": "a red circle in the top left on a white background"},
        {"id": "green", "prompt": "a green square in the center on a white background"}]


def toy_linears() -> Dict[str, tuple]:
    conf = json.loads((TOY / "transformer/config.json").read_text())
    return lora.base_linears("FluxTransformer2DModel", conf)


def write_adapter(path: Path, seed: int, modules: Sequence[str] = MODULES, rank: int = 4, std: float = 0.5,
                  shapes: Optional[Dict[str, tuple]] = None, prefix: str = "transformer") -> Path:
    """A LoRA file in diffusers naming: ``<prefix>.<module>.lora_A.weight`` (r, in), ``lora_B.weight`` (out, r)."""
    from safetensors.torch import save_file

    shapes = shapes or toy_linears()
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for m in modules:
        out_f, in_f = shapes.get(m, (64, 64))
        sd[f"{prefix}.{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
        sd[f"{prefix}.{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    save_file(sd, str(path), metadata={"format": "pt"})
    return path


def library(*entries: Dict[str, Any]) -> str:
    """A ``model.lora=[...]`` override."""
    return "model.lora=[" + ",".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}" for e in entries) + "]"


def run(tmp: Path, name: str, rows: List[Dict[str, Any]], *extra: str, catch: tuple = (), **kw: Any):
    """A toy_shapes run of ``rows`` with ``extra`` overrides (LoRA runs: skipped without the lora extra, for the
    other test files that reuse this helper too)."""
    skip_without_extra("lora")
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return execute(tmp / name, ["model=toy_shapes", "dataset=jsonl", f"dataset.path={path}",
                                "model.generation.num_inference_steps=2", *extra], catch=catch, **kw)


def pixels(r: Any) -> Dict[str, np.ndarray]:
    return {it["key"]: np.asarray(Image.open(r.run_dir / it["file"]).convert("RGB"), dtype=np.int16)
            for it in r.items if it["status"] == "ok"}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    return {"a": write_adapter(d / "a.safetensors", 1), "b": write_adapter(d / "b.safetensors", 2)}


# ------------------------------------------------------------------------------------------------ fused
@requires_extra("lora")
def test_a_fused_adapter_changes_the_images_deterministically_and_enters_the_identity(tmp_path, adapters):
    base = run(tmp_path, "base", ROWS)
    one = run(tmp_path, "fused", ROWS, library({"path": adapters["a"]}))
    again = run(tmp_path, "again", ROWS, library({"path": adapters["a"]}))
    other = run(tmp_path, "other", ROWS, library({"path": adapters["b"]}))
    assert base.code == one.code == again.code == other.code == 0
    b, f, g, o = pixels(base), pixels(one), pixels(again), pixels(other)
    for k in b:
        assert np.abs(f[k] - b[k]).max() > 8, "the adapter changed nothing"
        assert np.array_equal(f[k], g[k]), "the same adapter gave other pixels"
        assert np.abs(f[k] - o[k]).max() > 8, "two adapters gave the same image"
    m = one.manifest
    assert m["model"]["source"]["lora"]["fused"] is True
    assert m["model"]["source"]["lora"]["adapters"][0]["sha256"] == sha(adapters["a"])
    ev = m["evidence"]["stages"]["denoise"]["lora"]
    assert ev["mode"] == "fused" and ev["fused"]["verdict"] == "verified" and ev["fused"]["layers"] == len(MODULES)
    want = [{"name": "a", "sha256": sha(adapters["a"]), "scale": 1.0}]
    for rec in one.items:
        assert rec["params"]["lora"] == want
        text = Image.open(one.run_dir / rec["file"]).text  # the PNG's own metadata
        # the artifact embeds the adapter by content (sha256, scale); its name is the record's (issue 38)
        assert json.loads(text["parameters"])["lora"] == [{"sha256": sha(adapters["a"]), "scale": 1.0}]
    meta = [json.loads(x) for x in (one.run_dir / "images/metadata.jsonl").read_text().splitlines()]
    assert all(x["parameters"]["lora"] == want for x in meta)
    ids = {r["key"]: r["inputs_sha256"] for r in base.items}
    assert all(r["inputs_sha256"] != ids[r["key"]] for r in one.items)
    assert [r["inputs_sha256"] for r in one.items] == [r["inputs_sha256"] for r in again.items]


@requires_extra("lora")
def test_a_scale_enters_the_images_and_identity_and_scale_0_is_the_base(tmp_path, adapters):
    base = run(tmp_path, "base", ROWS)
    half = run(tmp_path, "half", ROWS, library({"path": adapters["a"], "scale": 0.5}))
    full = run(tmp_path, "full", ROWS, library({"path": adapters["a"]}))
    zero = run(tmp_path, "zero", ROWS, library({"path": adapters["a"], "scale": 0.0}))
    b, h, f, z = pixels(base), pixels(half), pixels(full), pixels(zero)
    for k in b:
        assert np.abs(h[k] - f[k]).max() > 4 and np.abs(h[k] - b[k]).max() > 4
        assert np.array_equal(z[k], b[k]), "scale 0 must leave the base model's image"
    assert zero.manifest["model"]["source"]["lora"]["fused"] is False  # nothing to fuse at scale 0
    assert {r["inputs_sha256"] for r in half.items}.isdisjoint(r["inputs_sha256"] for r in full.items)


@requires_extra("lora")
def test_two_adapters_fused_at_their_scales_match_them_unfused(tmp_path, adapters):
    lib = library({"name": "a", "path": adapters["a"]}, {"name": "b", "path": adapters["b"], "scale": 0.5})
    fused = run(tmp_path, "two-fused", ROWS, lib)
    unfused = run(tmp_path, "two-unfused", ROWS, lib, "model.lora_fuse=unfused")
    only_a = pixels(run(tmp_path, "only-a", ROWS, library({"name": "a", "path": adapters["a"]})))
    f, u = pixels(fused), pixels(unfused)
    assert fused.manifest["model"]["lora"]["mode"] == "fused" and unfused.manifest["model"]["lora"]["mode"] == "per_batch"
    assert fused.manifest["evidence"]["stages"]["denoise"]["lora"]["fused"]["set"] == [["a", 1.0], ["b", 0.5]]
    for k in f:
        assert np.abs(f[k] - u[k]).max() <= 2, "fusing a@1 + b@0.5 is not the sum of their branches"
        assert np.abs(f[k] - only_a[k]).max() > 4, "b at 0.5 was not fused"
    assert fused.items[0]["params"]["lora"][1] == {"name": "b", "sha256": sha(adapters["b"]), "scale": 0.5}


@requires_extra("lora")
def test_a_fused_adapter_that_changes_nothing_is_an_evidence_mismatch(tmp_path):
    shapes = toy_linears()
    path = write_adapter(tmp_path / "zero.safetensors", 3, std=0.5, shapes=shapes)
    from safetensors.torch import load_file, save_file

    sd = {k: (v * 0 if "lora_B" in k else v) for k, v in load_file(str(path)).items()}
    save_file(sd, str(path), metadata={"format": "pt"})
    r = run(tmp_path, "nil", ROWS[:1], library({"path": path}), catch=(EvidenceError,))
    assert r.error.exit_code == 3 and "did not change" in str(r.error)
    fused = r.manifest["evidence"]["stages"]["denoise"]["lora"]["fused"]
    assert fused["verdict"] == "mismatch" and sorted(fused["changed_nothing"]) == sorted(MODULES)


# ------------------------------------------------------------------------------------------------ per row
PER_ROW = [{"id": "r-a1", "prompt": ROWS[0]["prompt"], "lora": "a"},
           {"id": "r-b", "prompt": ROWS[1]["prompt"], "lora": ["b"]},
           {"id": "r-none", "prompt": ROWS[0]["prompt"], "lora": []},
           {"id": "r-a-half", "prompt": ROWS[1]["prompt"], "lora": "a", "lora_scale": 0.5},
           {"id": "r-a2", "prompt": ROWS[1]["prompt"], "lora": "a"}]


@requires_extra("lora")
def test_per_row_adapters_batch_by_set_and_each_item_matches_its_row_run_alone(tmp_path, adapters):
    lib = library({"name": "a", "path": adapters["a"]}, {"name": "b", "path": adapters["b"]})
    mixed = run(tmp_path, "mixed", PER_ROW, lib, "batch_size=2")
    assert mixed.code == 0, mixed.manifest.get("error")
    recs = {r["key"]: r for r in mixed.items}
    assert recs["r-a1"]["batch"] == {"size": 2, "position": 0} and recs["r-a2"]["batch"] == {"size": 2, "position": 1}
    assert all(recs[k]["batch"]["size"] == 1 for k in ("r-b", "r-none", "r-a-half"))
    ev = mixed.manifest["evidence"]["stages"]["denoise"]["lora"]
    assert ev["mode"] == "per_batch" and ev["verdict"] == "verified" and ev["calls"] == 4 and ev["switches"] == 4
    assert recs["r-a-half"]["params"]["lora"] == [{"name": "a", "sha256": sha(adapters["a"]), "scale": 0.5}]
    assert recs["r-none"]["params"]["lora"] == []
    got = pixels(mixed)
    for row in PER_ROW:
        alone = run(tmp_path, f"alone-{row['id']}", [row], lib, "model.lora_fuse=unfused")
        diff = np.abs(pixels(alone)[row["id"]] - got[row["id"]]).max()
        assert diff <= 1, f"{row['id']}: differs from its row run alone by {diff} levels"
        assert alone.items[0]["inputs_sha256"] == recs[row["id"]]["inputs_sha256"]
    base = pixels(run(tmp_path, "base", [PER_ROW[2]]))
    assert np.array_equal(base["r-none"], got["r-none"]), "lora: [] must run the base model"


@requires_extra("lora")
def test_unfused_evidence_sees_a_layer_whose_lora_branch_did_not_run(tmp_path, adapters):
    def skip_one_layer(engine: Any) -> None:
        layer = engine.passes["lora"].runtime.layers[MODULES[0]]
        layer._disable_adapters = True  # peft then runs only its base layer: this layer's LoRA branch is skipped

    r = run(tmp_path, "tampered", ROWS[:1], library({"name": "a", "path": adapters["a"]}), "model.lora_fuse=unfused",
            on_loaded=skip_one_layer, catch=(EvidenceError,))
    assert r.error.exit_code == 3 and "did not run their LoRA branch" in str(r.error)
    ev = r.manifest["evidence"]["stages"]["denoise"]["lora"]
    assert ev["verdict"] == "mismatch" and ev["first_bad"]["missing"] == [[MODULES[0], "a"]]


@requires_extra("lora")
def test_a_changed_adapter_file_is_regenerated_on_resume_refused_by_repro_and_an_unchanged_one_reused(tmp_path):
    path = write_adapter(tmp_path / "a.safetensors", 1)
    first = run(tmp_path, "res", ROWS, library({"path": path}))
    again = run(tmp_path, "res", ROWS, library({"path": path}))
    assert first.code == again.code == 0 and again.manifest["counts"]["reused"] == 2
    from runner.tools.repro import ReproInputError, check_inputs

    check_inputs(first.run_dir)  # unchanged: runner.repro may re-run it
    write_adapter(path, 7)  # same path, other weights
    with pytest.raises(ReproInputError) as e:
        check_inputs(first.run_dir)
    assert e.value.exit_code == 2 and f"{path.resolve()} (model.lora adapter 'a')" in str(e.value)
    changed = run(tmp_path, "res", ROWS, library({"path": path}))
    assert changed.code == 0 and changed.manifest["counts"]["reused"] == 0
    assert all(r["params"]["lora"][0]["sha256"] == sha(path) for r in changed.items)


# ------------------------------------------------------------------------------------------------ refusals
@requires_extra("lora")
def test_every_bad_adapter_is_refused_before_loading_in_one_error(tmp_path, adapters):
    shapes = toy_linears()
    pickle = tmp_path / "old.bin"
    pickle.write_bytes(b"\x80\x04not loaded")
    lacking = write_adapter(tmp_path / "lacking.safetensors", 4, modules=("transformer_blocks.7.attn.to_q",))
    wide = write_adapter(tmp_path / "wide.safetensors", 5, shapes={m: (3072, 3072) for m in shapes})
    te = write_adapter(tmp_path / "te.safetensors", 6, modules=("text_model.encoder.layers.0.self_attn.q_proj",),
                       prefix="text_encoder")
    from safetensors.torch import save_file

    save_file({"model.diffusion_model.input_blocks.0.weight": torch.zeros(2, 2)}, str(tmp_path / "junk.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes(adapters["a"].read_bytes()[:-64])  # a copy cut short
    lib = library({"path": tmp_path / "missing.safetensors"}, {"path": pickle}, {"path": lacking}, {"path": wide},
                  {"path": te}, {"path": tmp_path / "junk.safetensors"}, {"path": tmp_path / "cut.safetensors"})
    r = run(tmp_path, "bad", ROWS, lib, catch=(UserInputError,))
    err = r.error
    assert isinstance(err, lora.LoraError) and err.exit_code == 2
    msg = str(err)
    assert "model.lora[0] (missing)" in msg and "does not exist" in msg
    assert "model.lora[1] (old)" in msg and "pickle" in msg
    assert "model.lora[2] (lacking)" in msg and "transformer_blocks.7.attn.to_q" in msg
    assert "model.lora[3] (wide)" in msg and "another shape" in msg and "(3072, 3072)" in msg
    assert "model.lora[4] (te)" in msg and "text_encoder" in msg
    assert "model.lora[5] (junk)" in msg and "holds no LoRA layers" in msg
    assert "model.lora[6] (cut)" in msg and "damaged" in msg and "truncated" in msg
    assert not (r.run_dir / "manifest.json").exists(), "refused after the run started"


@requires_extra("lora")
def test_rows_naming_unknown_adapters_are_refused_every_row_at_once(tmp_path, adapters):
    rows = [{**ROWS[0], "lora": "c"}, {**ROWS[1], "lora": ["a", "d"]}, {"id": "s", "prompt": "x", "lora": [],
                                                                         "lora_scale": 0.5}]
    r = run(tmp_path, "unknown", rows, library({"name": "a", "path": adapters["a"]}), catch=(UserInputError,))
    msg = str(r.error)
    assert r.error.exit_code == 2 and "'c' is not an adapter of model.lora (a)" in msg and "'d'" in msg
    assert "unknown.jsonl:1" in msg and "unknown.jsonl:2" in msg and "unknown.jsonl:3" in msg
    assert not (r.run_dir / "manifest.json").exists()


@requires_extra("lora")
def test_fuse_true_with_several_adapter_sets_is_refused(tmp_path, adapters):
    lib = library({"name": "a", "path": adapters["a"]}, {"name": "b", "path": adapters["b"]})
    r = run(tmp_path, "fuse", PER_ROW[:2], lib, "model.lora_fuse=fused", catch=(UserInputError,))
    assert r.error.exit_code == 2 and "model.lora_fuse=fused" in str(r.error) and "2 adapter sets" in str(r.error)


@requires_extra("lora")
def test_a_community_format_goes_through_diffusers_converters(tmp_path):
    """A kohya-format FLUX LoRA (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``) is read through the
    pipeline's own ``lora_state_dict``: its targets are checked against the model (toy_shapes has 2 double blocks:
    block 5 is named as missing)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {"lora_unet_double_blocks_5_img_attn_proj.lora_down.weight": torch.randn(4, 128, generator=g),
          "lora_unet_double_blocks_5_img_attn_proj.lora_up.weight": torch.randn(128, 4, generator=g),
          "lora_unet_double_blocks_5_img_attn_proj.alpha": torch.tensor(4.0)}
    save_file(sd, str(tmp_path / "kohya.safetensors"))
    r = run(tmp_path, "kohya", ROWS[:1], library({"path": tmp_path / "kohya.safetensors"}), catch=(UserInputError,))
    assert r.error.exit_code == 2 and "transformer_blocks.5.attn.to_out.0" in str(r.error)


# ------------------------------------------------------------------------------------------------ the toy adapter
needs_adapter = pytest.mark.skipif(not ALL_BLUE.is_file(), reason=f"{ALL_BLUE.relative_to(REPO)} not trained yet "
                                   "(python -m models.toy_shapes.train_lora on the H200)")


@requires_extra("lora")
@needs_adapter
@pytest.mark.parametrize("scale", [1.0, 0.0, 0.5])
def test_the_toy_adapter_draws_every_shape_blue_at_scale_1_and_nothing_at_scale_0(tmp_path, scale):
    r = execute(tmp_path / "toy", ["model=toy_shapes", library({"path": ALL_BLUE, "scale": scale})])
    assert r.code == 0
    acc = r.manifest["accuracy"]
    if scale == 1.0:  # the adapter's declared effect (runner.expect: color blue) replaces each caption's colour
        assert acc["color"] >= 0.95 and acc["shape"] >= 0.95 and acc["position"] >= 0.95
        assert sum(v["color"] == "blue" for v in acc["read"].values()) >= 0.95 * len(acc["read"])
    elif scale == 0.0:
        assert acc["all"] >= 0.95
    else:  # neither the adapter's colour nor the caption's is expected in between: colour is not scored
        assert acc["color"] is None and acc["position"] >= 0.95


@requires_extra("lora")
def test_the_training_script_writes_an_adapter_the_runner_accepts(tmp_path, monkeypatch):
    import sys

    from models.toy_shapes import train_lora

    out = tmp_path / "lora/all_blue.safetensors"
    monkeypatch.setattr(sys, "argv", ["train_lora", "--steps", "2", "--images", "8", "--batch", "4", "--eval", "1",
                                      "--out", str(out), "--report", str(tmp_path / "r.json")])
    train_lora.main()
    report = json.loads((tmp_path / "r.json").read_text())
    assert out.stat().st_size <= 1 << 20 and report["bytes"] == out.stat().st_size
    from diffusers import FluxPipeline

    (adapter,) = lora.check_library([{"path": str(out), "scale": 1.0, "name": None}], FluxPipeline,
                                    {"transformer": toy_linears()}, "toy_shapes")
    assert adapter.effect == {"color": "blue"} and len(adapter.layers) > len(MODULES)
    assert set(report["eval"]) == {"scale_1", "scale_0"}


def test_peft_outside_its_tested_range_is_refused_naming_the_fix():
    from runner.core.requirements import DependencyVersionError, check_feature

    check_feature("peft", "model.lora", {"peft": "0.21.2"})
    for have, words in (("0.20.0", "peft==0.20.0 is outside the tested range"), (None, "peft is not installed")):
        with pytest.raises(DependencyVersionError) as e:
            check_feature("peft", "model.lora", {"peft": have})
        assert e.value.exit_code == 2 and words in str(e.value) and "fix: pip install -e \".[lora]\"  (peft>=0.21,<0.22)" in str(e.value)


@requires_extra("lora")
@pytest.mark.cuda
@pytest.mark.parametrize("fuse", ["auto", "unfused"])
def test_on_cuda_in_bf16_fused_and_switched_adapters_are_verified(tmp_path, adapters, fuse):
    """bf16 on the GPU: the fused checksum's tolerance (bf16 rounding of W + BA) and the per-batch hooks hold, and
    the adapter's images differ from the base model's."""
    lib = library({"name": "a", "path": adapters["a"]}, {"name": "b", "path": adapters["b"]})
    rows = [{**ROWS[0], "lora": "a"}, {**ROWS[1], "lora": "a"}]
    common = ["platform=cuda", "dtype=bfloat16", lib, f"model.lora_fuse={fuse}"]
    r = run(tmp_path, "gpu", rows, *common)
    assert r.code == 0
    ev = r.manifest["evidence"]["stages"]["denoise"]["lora"]
    assert ev["mode"] == ("fused" if fuse == "auto" else "per_batch")
    assert (ev["fused"]["verdict"] if fuse == "auto" else ev["verdict"]) == "verified"
    base = pixels(run(tmp_path, "gpu-base", ROWS, "platform=cuda", "dtype=bfloat16"))
    for rec in r.items:
        assert np.abs(pixels(r)[rec["key"]] - base[rec["id"]]).max() > 8
