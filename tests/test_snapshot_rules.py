"""Issue #42: the snapshot-reading rules of ``models.snapshot`` (``read_index``, ``check_snapshot``,
``missing_weights``, ``snapshot_complete``, ``embedded_target``, ``component_config``) asserted on small hand-written
snapshot folders, so that a wrong rule fails a test (``benchmarks/mutation.py``, group ``core_m_snapshot_1``).
Nothing here loads or builds a model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from models import snapshot as snap
from runner.core.weights import ModelPathError


def write_snapshot(root: Path, index, files=()) -> Path:
    """``root`` with ``model_index.json`` = ``index`` (a dict, or raw text) and each of ``files`` (relative paths,
    ``{path: text}`` or a list of paths written empty)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    items = files.items() if isinstance(files, dict) else ((f, "") for f in files)
    for rel, text in items:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# ------------------------------------------------------------------------------------------------ read_index


def test_read_index_returns_the_json_and_names_a_missing_or_broken_file(tmp_path):
    good = write_snapshot(tmp_path / "good", {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]})
    assert snap.read_index(good) == {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]}
    with pytest.raises(ModelPathError) as e:
        snap.read_index(tmp_path)  # a folder without model_index.json
    assert str(e.value) == (f"model.path={str(tmp_path)!r} has no model_index.json, so it is not a diffusers "
                            "pipeline layout; fix: point at the snapshot root written by save_pretrained / hf download")
    (tmp_path / "dir" / "model_index.json").mkdir(parents=True)  # exists, but not a file
    with pytest.raises(ModelPathError, match="has no model_index.json"):
        snap.read_index(tmp_path / "dir")
    bad = write_snapshot(tmp_path / "bad", "{not json")
    with pytest.raises(ModelPathError) as e:
        snap.read_index(bad)
    assert str(e.value).startswith(f"model.path={str(bad)!r}: model_index.json is not valid JSON (")
    assert str(e.value).endswith("); fix: download the snapshot again")
    assert e.value.__cause__ is None and e.value.__suppress_context__


# ------------------------------------------------------------------------------------------------ check_snapshot


def test_check_snapshot_refuses_a_missing_path_and_expands_the_home(tmp_path, monkeypatch):
    with pytest.raises(ModelPathError) as e:
        snap.check_snapshot(str(tmp_path / "nowhere"))
    assert str(e.value) == (f"model.path={str(tmp_path / 'nowhere')!r} does not exist; fix: pass a local diffusers "
                            "snapshot directory (the folder with model_index.json)")
    write_snapshot(tmp_path / "home" / "s", {"_class_name": "FluxPipeline"})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    got = snap.check_snapshot("~/s")
    assert isinstance(got, Path) and got == tmp_path / "home" / "s"
    with pytest.raises(ModelPathError, match="has no model_index.json"):
        snap.check_snapshot(str(tmp_path))  # exists, no index


def test_check_snapshot_refuses_a_component_with_pickle_weights_only(tmp_path):
    index = {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]}
    ok = write_snapshot(tmp_path / "ok", index, ["vae/config.json", "vae/model.bin", "vae/model.safetensors"])
    assert snap.check_snapshot(str(ok)) == ok  # a .bin next to safetensors is never loaded: fine
    bad = write_snapshot(tmp_path / "bad", index, ["vae/config.json", "vae/model.bin"])
    with pytest.raises(ModelPathError) as e:
        snap.check_snapshot(str(bad))
    msg = str(e.value)
    assert msg == (f"model.path={str(bad)!r}: vae/model.bin is a pickle checkpoint and vae/ has no .safetensors "
                   "weights; the runner never loads pickle files (unpickling can run code); fix: use a snapshot with "
                   "safetensors weights (hf download <repo> --include '*.safetensors' '*.json' '*.txt' "
                   "'*.model'), or convert it once where you trust the file: load it with diffusers/transformers and "
                   "save_pretrained(..., safe_serialization=True)")


def test_check_snapshot_looks_only_at_component_entries(tmp_path):
    """A key starting with ``_`` or a non-list value is not a component: its folder's pickle files are not checked."""
    s = write_snapshot(tmp_path / "s", {"_class_name": "FluxPipeline", "_extra": ["x", "y"], "notes": "text"},
                       ["_extra/model.bin", "notes/model.bin"])
    assert snap.check_snapshot(str(s)) == s
    t = write_snapshot(tmp_path / "t", {"_class_name": "FluxPipeline", "extra": ["x", "y"]}, ["extra/model.bin"])
    with pytest.raises(ModelPathError, match="extra/model.bin is a pickle checkpoint"):
        snap.check_snapshot(str(t))


# ------------------------------------------------------------------------------------------------ missing_weights


def test_missing_weights_lists_model_components_without_safetensors_sorted(tmp_path):
    index = {
        "_class_name": "FluxPipeline",
        "vae": ["diffusers", "AutoencoderKL"],                 # a torch module, no weights: missing
        "transformer": ["diffusers", "FluxTransformer2DModel"],  # has weights
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],  # not a module: never missing
        "custom": ["no_such_library_xyz", "Thing"],            # cannot be imported: counts as a model
        "absent": ["diffusers", "NoSuchClassXyz"],             # no such class: counts as a model
        "expert": [None, None],                                 # a null entry: not there
        "half": ["diffusers", None],                            # None in it: skipped
        "long": ["diffusers", "AutoencoderKL", "x"],            # not a pair: skipped
        "_hidden": ["diffusers", "AutoencoderKL"],              # private key: skipped
        "text": "AutoencoderKL",                                # not a list: skipped
    }
    s = write_snapshot(tmp_path / "s", index, ["transformer/diffusion_pytorch_model.safetensors",
                                               "vae/diffusion_pytorch_model.bin"])
    assert snap.missing_weights(s) == ["absent", "custom", "vae"]
    (s / "vae" / "w.safetensors").write_text("")
    assert snap.missing_weights(str(s)) == ["absent", "custom"]  # a str path works too
    assert not snap.snapshot_complete(s)


def test_snapshot_complete_needs_the_index_and_every_weight(tmp_path):
    s = write_snapshot(tmp_path / "s", {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]})
    assert snap.snapshot_complete(s) is False
    (s / "vae").mkdir()
    (s / "vae" / "m.safetensors").write_text("")
    assert snap.snapshot_complete(s) is True and snap.snapshot_complete(str(s)) is True
    (s / "model_index.json").unlink()
    assert snap.snapshot_complete(s) is False  # and no exception from missing_weights
    assert snap.snapshot_complete(tmp_path / "none") is False


# ------------------------------------------------------------------------------------------------ embedded_target


def test_embedded_target_root_is_the_cache_dir_else_runner_cache_else_home(tmp_path, monkeypatch):
    arch = {"transformer": {"num_layers": 1}}
    a = snap.embedded_target("tiny", arch, str(tmp_path / "c"))
    assert a.parent == tmp_path / "c" and a.name.startswith("tiny-")
    key = a.name[len("tiny-"):]
    assert len(key) == 12 and all(ch in "0123456789abcdef" for ch in key)
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "env"))
    assert snap.embedded_target("tiny", arch, None) == tmp_path / "env" / a.name
    assert snap.embedded_target("tiny", arch, "") == tmp_path / "env" / a.name  # an empty cache dir: the default
    monkeypatch.delenv("RUNNER_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert snap.embedded_target("tiny", arch, None) == tmp_path / "home" / ".cache" / "runner" / a.name
    monkeypatch.setenv("RUNNER_CACHE", "~/rc")
    assert snap.embedded_target("tiny", arch, None) == tmp_path / "home" / "rc" / a.name
    assert snap.embedded_target("tiny", arch, "~/cd") == tmp_path / "home" / "cd" / a.name


def test_embedded_target_key_is_a_hash_of_arch_recipe_diffusers_and_task(tmp_path, monkeypatch):
    import diffusers

    arch = {"transformer": {"num_layers": 1, "a": 2}}
    base = snap.embedded_target("m", arch, "/c")
    # the key hashes exactly {arch, recipe, diffusers} (sorted keys): computed here from the documented contents
    what = {"arch": arch, "recipe": snap.EMBEDDED_RECIPE, "diffusers": diffusers.__version__}
    assert base.name == "m-" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    assert snap.embedded_target("m", {"transformer": {"a": 2, "num_layers": 1}}, "/c") == base  # key order
    assert snap.embedded_target("m", {"transformer": {"num_layers": 2, "a": 2}}, "/c") != base
    assert snap.embedded_target("m", arch, "/c", task=None) == base
    with_task = snap.embedded_target("m", arch, "/c", task="edit")
    what["task"] = "edit"
    assert with_task.name == "m-" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    assert with_task != base and with_task != snap.embedded_target("m", arch, "/c", task="image_to_video")
    monkeypatch.setattr(snap, "EMBEDDED_RECIPE", snap.EMBEDDED_RECIPE + 1)
    assert snap.embedded_target("m", arch, "/c") != base
    monkeypatch.undo()
    monkeypatch.setattr(diffusers, "__version__", "0.0.1")
    assert snap.embedded_target("m", arch, "/c") != base


# ------------------------------------------------------------------------------------------------ component_config


def test_component_config_reads_the_snapshot_for_a_path_source(tmp_path):
    s = write_snapshot(tmp_path / "s", {"_class_name": "FluxPipeline"},
                       {"vae/config.json": '{"latent_channels": 4}',
                        "scheduler/scheduler_config.json": '{"shift": 3.0}',
                        "scheduler/config.json": '{"shift": 1.0}'})
    src = {"kind": "path", "path": str(s)}
    assert snap.component_config(src, {"vae": {"latent_channels": 16}}, "vae") == {"latent_channels": 4}
    assert snap.component_config(src, {}, "scheduler") == {"shift": 3.0}
    with pytest.raises(ModelPathError) as e:
        snap.component_config(src, {}, "transformer")
    assert f"model.path={str(s)!r}: transformer/config.json cannot be read" in str(e.value)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    (s / "text_encoder").mkdir()
    (s / "text_encoder" / "config.json").write_text("{broken")
    with pytest.raises(ModelPathError, match="text_encoder/config.json cannot be read"):
        snap.component_config(src, {}, "text_encoder")


def test_component_config_is_a_copy_of_the_architecture_otherwise():
    arch = {"vae": {"latent_channels": 16}}
    for kind in ("dummy", "embedded"):
        got = snap.component_config({"kind": kind}, arch, "vae")
        assert got == {"latent_channels": 16}
        got["latent_channels"] = 1
        assert arch["vae"] == {"latent_channels": 16}  # the caller's architecture is untouched
    with pytest.raises(KeyError):
        snap.component_config({}, arch, "transformer")


# ------------------------------------------------------------------------------------------------ tokenizers


def test_task_components_follow_the_spec_and_copy_without_one():
    from models.registry import engine_class
    from models.pipelines import PipelineEngine

    wan = engine_class("wan")
    assert wan.task_components("image_to_video") == wan.spec.components_for("image_to_video")
    assert "image_encoder" in wan.task_components("image_to_video") and "image_encoder" not in \
        wan.task_components(None)
    assert PipelineEngine.spec is None and PipelineEngine.task_components("edit") == dict(PipelineEngine.components)
    got = PipelineEngine.task_components(None)
    got["x"] = 1
    assert "x" not in PipelineEngine.components


def test_corpus_is_the_named_toy_corpus_else_the_builtin_prompts():
    from models.registry import engine_class
    from models.tokenizers import corpus_from
    from models.toy_motion.data import captions
    from models.toy_shapes.data import caption, combos
    from runner.core.dataset import BUILTIN_PROMPTS

    flux = engine_class("flux")
    builtin = corpus_from(BUILTIN_PROMPTS)
    assert flux.corpus({}) == builtin and flux.corpus({"tokenizer": None}) == builtin
    assert flux.corpus({"tokenizer": {"corpus": "other"}}) == builtin
    shapes = flux.corpus({"tokenizer": {"corpus": "toy_shapes"}})
    assert shapes == [caption(*c) for c in combos()] and shapes != builtin
    motion = flux.corpus({"tokenizer": {"corpus": "toy_motion"}})
    assert motion == captions() and motion != builtin and motion != shapes


def test_build_tokenizers_vocab_size_and_snapshot_tokenizers(tmp_path):
    import transformers

    from models.registry import engine_class

    flux = engine_class("flux")
    small = flux.build_tokenizers({"tokenizer": {"vocab_size": 300}})
    default = flux.build_tokenizers({})
    assert set(small) == {"tokenizer", "tokenizer_2"} == set(default)
    assert len(small["tokenizer_2"]) <= 300 < len(default["tokenizer_2"]) <= 512
    assert flux.build_tokenizers({}, task="edit")["tokenizer"].get_vocab() == default["tokenizer"].get_vocab()
    # snapshot_tokenizers loads them back with the classes model_index.json names
    for comp, tok in default.items():
        tok.save_pretrained(str(tmp_path / comp))
    index = {"_class_name": "FluxPipeline", "tokenizer": ["transformers", type(default["tokenizer"]).__name__],
             "tokenizer_2": ["transformers", "NoSuchTokenizerXyz"]}  # unknown class: AutoTokenizer
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    got = snap.snapshot_tokenizers(tmp_path, flux.tokenizers_spec, "FluxPipeline")
    assert set(got) == {"tokenizer", "tokenizer_2"}
    assert type(got["tokenizer"]) is type(default["tokenizer"])
    assert got["tokenizer_2"].get_vocab() == default["tokenizer_2"].get_vocab()
    assert isinstance(got["tokenizer_2"], transformers.PreTrainedTokenizerBase)
    # a missing entry, a null class or a missing folder is refused, naming the pipeline
    for idx, drop in ((dict(index, tokenizer_2=[None, None]), None), ({k: v for k, v in index.items()
                                                                      if k != "tokenizer_2"}, None),
                      (index, "tokenizer_2")):
        (tmp_path / "model_index.json").write_text(json.dumps(idx))
        if drop:
            (tmp_path / drop).rename(tmp_path / "moved")
        with pytest.raises(ModelPathError) as e:
            snap.snapshot_tokenizers(tmp_path, flux.tokenizers_spec, "P")
        assert str(e.value) == (f"model.path={str(tmp_path)!r} has no tokenizer_2 (model_index.json / tokenizer_2/), "
                                "which P needs; fix: point at a complete snapshot")
    (tmp_path / "tokenizer_2").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps(dict(index, tokenizer_2=["transformers",
                                                                                    "T5TokenizerFast"])))
    (tmp_path / "tokenizer_2" / "tokenizer_config.json").write_text("{}")  # no vocabulary: transformers would make
    with pytest.raises(ModelPathError) as e:  # a T5 tokenizer of 104 special tokens from it
        snap.snapshot_tokenizers(tmp_path, flux.tokenizers_spec, "P")
    assert str(e.value) == (f"model.path={str(tmp_path)!r}: tokenizer_2/ has none of a T5TokenizerFast's vocabulary "
                            "files (spiece.model, tokenizer.json); fix: re-download the snapshot's tokenizer files")
    (tmp_path / "tokenizer_2" / "tokenizer.json").write_text("{broken")  # not JSON
    (tmp_path / "model_index.json").write_text(json.dumps(dict(index, tokenizer_2=["transformers",
                                                                                    "T5TokenizerFast"])))
    with pytest.raises(ModelPathError) as e:
        snap.snapshot_tokenizers(tmp_path, flux.tokenizers_spec, "P")
    assert str(e.value).startswith(f"model.path={str(tmp_path)!r}: tokenizer_2/ cannot be read as a T5TokenizerFast (")
    assert str(e.value).endswith("); fix: re-download the snapshot's tokenizer files")


def test_encoder_config_is_the_kind_record():
    from models import tokenizer_kinds
    from models.registry import engine_class

    flux = engine_class("flux")
    tok = flux.build_tokenizers({})["tokenizer"]
    kw = {"hidden_size": 32}
    got = flux.encoder_config("clip", tok, kw)
    assert got == tokenizer_kinds.get("clip").encoder(tok, {"hidden_size": 32}) and kw == {"hidden_size": 32}
    assert got["vocab_size"] == len(tok) and got["hidden_size"] == 32


# ------------------------------------------------------------------------------------------------ build_components


def _arch(model: str):
    from omegaconf import OmegaConf

    from _helpers import compose

    return OmegaConf.to_container(compose([f"model={model}", "platform=cpu"]).model.architecture, resolve=True)


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_build_components_seeded_eval_typed_and_the_default_dtype_restored():
    from models.registry import engine_class

    flux = engine_class("flux")
    arch = _arch("tiny_flux")
    prev = torch.get_default_dtype()
    a = flux.build_components(arch)
    assert torch.get_default_dtype() == prev
    assert set(a) >= {"transformer", "vae", "text_encoder", "text_encoder_2", "scheduler", "tokenizer",
                      "tokenizer_2"}
    assert type(a["transformer"]).__name__ == "FluxTransformer2DModel" and not a["transformer"].training
    assert not any(m.training for m in a["text_encoder"].modules())
    # the text encoder's vocabulary is its tokenizer's (the kind's encoder record)
    assert a["text_encoder"].config.vocab_size == len(a["tokenizer"])
    assert a["scheduler"].config.shift == arch["scheduler"]["shift"] == 3.0
    b = flux.build_components(arch)
    pa, pb = _params(a["transformer"]), _params(b["transformer"])
    assert all(torch.equal(pa[k], pb[k]) for k in pa)  # same seed, same weights
    c = flux.build_components(dict(arch, weights_seed=1))
    pc = _params(c["transformer"])
    assert not all(torch.equal(pa[k], pc[k]) for k in pa)
    h = flux.build_components(arch, dtype=torch.bfloat16)
    assert {p.dtype for p in h["transformer"].parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == prev
    i = flux.build_components(arch, dtype=torch.int8)  # not a floating type: float32
    assert {p.dtype for p in i["transformer"].parameters()} == {torch.float32}
    m = flux.build_components(arch, device="meta")
    assert all(p.is_meta for p in m["transformer"].parameters())
    # on_meta: those components on the meta device (no memory), the others built as asked, typed and scaled
    part = flux.build_components(dict(arch, dummy_weight_scale=2.0), dtype=torch.bfloat16,
                                 on_meta=("transformer", "text_encoder_2"))
    assert all(p.is_meta for c in ("transformer", "text_encoder_2") for p in part[c].parameters())
    assert not any(p.is_meta for c in ("vae", "text_encoder") for p in part[c].parameters())
    assert {p.dtype for c in ("vae", "text_encoder", "transformer") for p in part[c].parameters()} == {torch.bfloat16}
    assert type(part["transformer"]) is type(a["transformer"]) and not part["transformer"].training
    assert torch.get_default_dtype() == prev


def test_build_components_weight_scale_multiplies_the_experts_matrices_only():
    from models.registry import engine_class

    flux = engine_class("flux")
    arch = _arch("tiny_flux")
    one = flux.build_components(arch)
    two = flux.build_components(dict(arch, dummy_weight_scale=2.0))
    p1, p2 = dict(one["transformer"].named_parameters()), dict(two["transformer"].named_parameters())
    mats = [k for k in p1 if p1[k].dim() >= 2]
    vecs = [k for k in p1 if p1[k].dim() < 2]
    assert mats and vecs
    assert all(torch.equal(p2[k], p1[k] * 2) for k in mats)
    assert all(torch.equal(p2[k], p1[k]) for k in vecs)
    v1, v2 = _params(one["vae"]), _params(two["vae"])
    assert all(torch.equal(v1[k], v2[k]) for k in v1)  # not an expert: unscaled
    meta = flux.build_components(dict(arch, dummy_weight_scale=2.0), device="meta")
    assert all(p.is_meta for p in meta["transformer"].parameters())


def test_build_components_skip_an_absent_optional_expert_and_add_the_pipeline_settings():
    from models.registry import engine_class

    wan = engine_class("wan")
    arch = _arch("tiny_wan")
    assert arch.get("transformer_2") is None
    got = wan.build_components(dict(arch, pipeline={"boundary_ratio": 0.5}))
    assert "transformer_2" not in got and got["boundary_ratio"] == 0.5
    assert type(got["scheduler"]).__name__ == "UniPCMultistepScheduler"
    assert wan.build_processors(arch, {}, None) == {}
