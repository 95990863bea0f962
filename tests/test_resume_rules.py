"""The rules of a resume (``runner.core.resume``), unit by unit: which config keys refuse a resume (every semantic key),
what the run identity holds, which finished items are reused, why the others are not, and what a killed run left.

A resume that is refused names the differing keys as ``key: old -> new``; these tests build the two configs from
the real composed config (``python -m runner``'s) and change one key at a time. The end-to-end refusal (the model
never loads, nothing is written) is in test_reliability.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
from omegaconf import OmegaConf

from runner.core import resume as rs
from runner.core.dataset import Item, Row

try:
    from _helpers import compose
except ImportError:  # tests/ imported as a package
    from tests._helpers import compose

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def cfg() -> Dict[str, Any]:
    return OmegaConf.to_container(compose([]), resolve=True)


def _set(d: Dict[str, Any], dotted: str, value: Any) -> Dict[str, Any]:
    d = copy.deepcopy(d)
    node = d
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


# ------------------------------------------------------------------------------------------ semantic keys


#: one change per semantic key: (key of SEMANTIC_KEYS, dotted path changed, new value, the line the refusal shows)
SEMANTIC_CHANGES = [
    ("model.name", "model.name", "tiny_flux_b", "model.name: 'tiny_flux' -> 'tiny_flux_b'"),
    ("model.engine", "model.engine", "sd3", "model.engine: 'flux' -> 'sd3'"),
    ("model.path", "model.path", "/w/snapshot", "model.path: None -> '/w/snapshot'"),
    ("model.revision", "model.revision", "abc123", "model.revision: None -> 'abc123'"),
    ("model.load_format", "model.load_format", "safetensors", "model.load_format: 'auto' -> 'safetensors'"),
    ("model.architecture", "model.architecture.transformer.num_layers", 2,
     "model.architecture.transformer.num_layers: 1 -> 2"),
    ("model.generation", "model.generation.num_inference_steps", 8, "model.generation.num_inference_steps: 4 -> 8"),
    ("model.backend", "model.backend.linear", "FP8", "model.backend.linear: None -> 'FP8'"),
    ("model.stages", "model.stages.denoise.backend.attention", "CUDNN_ATTN",
     "model.stages.denoise.backend.attention: None -> 'CUDNN_ATTN'"),
    ("backend", "backend.attention", "sdpa", "backend.attention: None -> 'sdpa'"),
    ("dtype", "dtype", "bfloat16", "dtype: 'auto' -> 'bfloat16'"),
    ("seed", "seed", 7, "seed: 0 -> 7"),
    ("num_images_per_prompt", "num_images_per_prompt", 2, "num_images_per_prompt: 1 -> 2"),
    ("compile", "compile", "default", "compile: 'none' -> 'default'"),
    ("optimize.fuse_qkv", "optimize.fuse_qkv", True, "optimize.fuse_qkv: False -> True"),
    ("optimize.vae_channels_last", "optimize.vae_channels_last", True, "optimize.vae_channels_last: False -> True"),
    ("optimize.deterministic_compile", "optimize.deterministic_compile", False,
     "optimize.deterministic_compile: True -> False"),
    ("model.lora", "model.lora", [{"path": "/a.safetensors", "scale": 1.0, "name": None}],
     "model.lora: [] -> [{'scale': 1.0}]"),  # an adapter's path and name are labels (its sha256 is in the identity)
    ("model.lora_fuse", "model.lora_fuse", "unfused", "model.lora_fuse: 'auto' -> 'unfused'"),
]


def test_every_semantic_key_has_a_change_below():
    assert sorted(k for k, *_ in SEMANTIC_CHANGES) == sorted(rs.SEMANTIC_KEYS)


@pytest.mark.parametrize("key,path,value,line", SEMANTIC_CHANGES, ids=[c[0] for c in SEMANTIC_CHANGES])
def test_a_change_of_each_semantic_key_refuses_the_resume(cfg, key, path, value, line):
    assert rs.semantic_diff(cfg, _set(cfg, path, value), "a" * 64, "a" * 64) == [line]


def test_same_config_resumes(cfg):
    assert rs.semantic_diff(cfg, copy.deepcopy(cfg), "a" * 64, "a" * 64) == []


@pytest.mark.parametrize("path,value", [("optimize.warmup", False), ("output.write_workers", 0), ("cpu_threads", 2),
                                        ("run.force", True), ("output.dir", "/elsewhere"), ("batch_size", 4)])
def test_keys_that_do_not_change_the_bytes_do_not_refuse(cfg, path, value):
    assert rs.semantic_diff(cfg, _set(cfg, path, value), None, "b" * 64) == []


def test_a_sinks_config_keys_count_only_when_given(cfg):
    new = _set(cfg, "output.video_codec", "h264_fast")
    assert rs.semantic_diff(cfg, new, None, "x") == []
    assert rs.semantic_diff(cfg, new, None, "x", keys=("output.video_codec",)) == [
        "output.video_codec: 'h264_lossless' -> 'h264_fast'"]


def test_several_differences_each_named_sorted_within_a_key(cfg):
    new = _set(_set(_set(cfg, "seed", 3), "model.generation.width", 64), "model.generation.height", 32)
    assert rs.semantic_diff(cfg, new, None, "x") == [
        "model.generation.height: 128 -> 32", "model.generation.width: 128 -> 64", "seed: 0 -> 3"]


def test_a_key_added_or_removed_inside_a_section(cfg):
    old = _set(cfg, "model.stages.denoise.engine_extras", {})
    new = _set(cfg, "model.stages.denoise.engine_extras", {"cache_blocks": 2})
    assert rs.semantic_diff(old, new, None, "x") == [
        "model.stages.denoise.engine_extras: {} -> None", "model.stages.denoise.engine_extras.cache_blocks: None -> 2"]
    gone = copy.deepcopy(cfg)
    del gone["model"]["generation"]["true_cfg_scale"]
    assert rs.semantic_diff(cfg, gone, None, "x") == ["model.generation.true_cfg_scale: 1.0 -> None"]


def test_a_section_replaced_by_a_value(cfg):
    assert rs.semantic_diff(cfg, _set(cfg, "backend", "sdpa"), None, "x") == ["backend: None -> 'sdpa'"]
    assert rs.semantic_diff(_set(cfg, "backend.linear", "fp8"), _set(cfg, "backend", "sdpa"), None, "x") == [
        "backend: None -> 'sdpa'", "backend.linear: 'fp8' -> None"]


def test_a_missing_parent_reads_as_none(cfg):
    no_opt = copy.deepcopy(cfg)
    del no_opt["optimize"]
    assert "optimize.fuse_qkv: None -> False" in rs.semantic_diff(no_opt, cfg, None, "x")
    scalar = _set(cfg, "model", "tiny_flux")  # a value where a section is expected: its keys read as None
    assert "model.name: None -> 'tiny_flux'" in rs.semantic_diff(scalar, cfg, None, "x")


def test_the_step_cache_counts_only_when_on(cfg):
    on = _set(cfg, "cache.method", "fbcache")
    assert rs.semantic_diff(cfg, _set(cfg, "cache.threshold", 0.2), None, "x") == []  # off: its settings are inert
    assert rs.semantic_diff(cfg, on, None, "x") == [f"cache: None -> {on['cache']!r}"]
    assert rs.semantic_diff(on, _set(on, "cache.threshold", 0.2), None, "x") == [
        f"cache: {on['cache']!r} -> {_set(on, 'cache.threshold', 0.2)['cache']!r}"]


@pytest.mark.parametrize("method", ["none", "None", " OFF ", "", "   ", None, "null"])
def test_cache_off_spellings(cfg, method):
    assert rs.cache_config(_set(cfg, "cache.method", method)) is None


def test_cache_config_when_on_or_absent(cfg):
    assert rs.cache_config(_set(cfg, "cache.method", "teacache"))["method"] == "teacache"
    assert rs.cache_config({}) is None
    assert rs.cache_config({"cache": "fbcache"}) is None  # not a section


def test_a_changed_dataset_refuses(cfg):
    assert rs.semantic_diff(cfg, cfg, "a" * 64, "b" * 64) == ["dataset.sha256: aaaaaaaaaaaa… -> bbbbbbbbbbbb…"]


def test_an_unrecorded_dataset_hash_is_not_compared(cfg):
    assert rs.semantic_diff(cfg, cfg, None, "b" * 64) == []


# --------------------------------------------------------------------------------------- previous run, temps


def _manifest(d: Path, name: str = "manifest.json", **doc: Any) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(doc))


def test_previous_run(tmp_path):
    assert rs.previous_run(tmp_path) is None
    _manifest(tmp_path, status="interrupted", seed=1)
    assert rs.previous_run(tmp_path) == {"status": "interrupted", "seed": 1}


@pytest.mark.parametrize("status", ["refused", "invalid"])
def test_a_run_refused_at_startup_is_nothing_to_resume(tmp_path, status):
    _manifest(tmp_path, status=status)
    assert rs.previous_run(tmp_path) is None


def test_previous_run_prefers_the_first_name(tmp_path):
    _manifest(tmp_path, "manifest.json", status="completed", who="merged")
    _manifest(tmp_path, "manifest.rank1.json", status="crashed", who="rank1")
    assert rs.previous_run(tmp_path, ("manifest.rank1.json", "manifest.json"))["who"] == "rank1"
    assert rs.previous_run(tmp_path, ("manifest.rank2.json", "manifest.json"))["who"] == "merged"


def test_remove_temp_files_only_touches_temp_names(tmp_path):
    for d in ("", "images", "videos", "other"):
        (tmp_path / d).mkdir(exist_ok=True)
    temps = [".manifest.json.tmp123", "images/.a.png.tmp9", "videos/.v.mp4.tmp42"]
    kept = ["images/a.png", "images/.a.png.tmp", "images/a.png.tmp9", "other/.x.png.tmp1", ".tmp7",
            "images/.b.png.tmpx"]
    for rel in temps + kept:
        (tmp_path / rel).write_text("x")
    (tmp_path / "images" / ".dir.tmp5").mkdir()
    gone = rs.remove_temp_files(tmp_path)
    assert sorted(gone) == sorted(Path(t).name for t in temps)
    for rel in temps:
        assert not (tmp_path / rel).exists()
    for rel in kept:
        assert (tmp_path / rel).exists(), rel
    assert (tmp_path / "images" / ".dir.tmp5").is_dir()


def test_remove_temp_files_sweeps_what_a_killed_claims_worker_was_renewing(tmp_path):
    # CI at c0fff1f: a Ray actor SIGKILLed while its lease renewer rewrote its claim left
    # claims/<token>/.b0000000.g0.tmp<pid>.<thread> behind after the merge
    ns = tmp_path / "claims" / "d0958c24"
    (ns / "workers").mkdir(parents=True)
    temps = [ns / ".b0000000.g0.tmp28857.140358912566976", ns / "workers" / ".1.json.tmp77.123",
             tmp_path / "claims" / "old" / ".b0000003.g1.tmp5.6"]
    kept = [ns / "b0000000.g0", ns / "b0000000.done", ns / "workers" / "1.json", ns / "fleet.json",
            ns / ".b0000000.g0.tmpx.1", ns / ".b0000000.g0.tmp1.2.3", tmp_path / ".x.tmp1.2"]
    for p in temps + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{}")
    gone = rs.remove_temp_files(tmp_path)
    assert sorted(gone) == sorted(p.name for p in temps)
    assert not any(p.exists() for p in temps) and all(p.exists() for p in kept)


def test_remove_temp_files_of_a_dir_without_artifact_folders(tmp_path):
    (tmp_path / ".items.jsonl.tmp1").write_text("x")
    assert rs.remove_temp_files(tmp_path) == [".items.jsonl.tmp1"]
    assert rs.remove_temp_files(tmp_path / "missing") == []


# --------------------------------------------------------------------------------------------- finished


def _artifact(d: Path, key: str, data: bytes, **rec: Any) -> Dict[str, Any]:
    (d / "images").mkdir(parents=True, exist_ok=True)
    (d / "images" / f"{key}.png").write_bytes(data)
    return {"key": key, "status": "ok", "file": f"images/{key}.png", "file_sha256": hashlib.sha256(data).hexdigest(),
            **rec}


def _journal(path: Path, records: List[Dict[str, Any]], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_finished_keeps_intact_artifacts_only(tmp_path):
    good = _artifact(tmp_path, "good", b"good")
    corrupt = _artifact(tmp_path, "corrupt", b"before")
    (tmp_path / "images" / "corrupt.png").write_bytes(b"after")
    missing = _artifact(tmp_path, "missing", b"m")
    (tmp_path / "images" / "missing.png").unlink()
    failed = {"key": "failed", "status": "failed", "file": None}
    nofile = {"key": "nofile", "status": "ok"}
    _journal(tmp_path / "items.jsonl", [failed, nofile, good, corrupt, missing], tail='{"key": "half')
    assert rs.finished(tmp_path) == {"good": good}


def test_finished_reads_every_workers_journal(tmp_path):
    a = _artifact(tmp_path, "a", b"a")
    b = _artifact(tmp_path, "b", b"b")
    _journal(tmp_path / "items.jsonl", [a])
    _journal(tmp_path / "items.rank1.jsonl", [b])
    _journal(tmp_path / "other.jsonl", [_artifact(tmp_path, "c", b"c")])
    assert sorted(rs.finished(tmp_path)) == ["a", "b"]


def test_finished_keeps_the_intact_record_of_a_key_written_twice(tmp_path):
    first = _artifact(tmp_path, "k", b"v1", seed=1)
    second = dict(first, seed=2, file_sha256="0" * 64)  # a later record whose file was replaced by another run
    _journal(tmp_path / "items.jsonl", [first, second])
    assert rs.finished(tmp_path) == {"k": first}
    third = _artifact(tmp_path, "k", b"v3", seed=3)
    _journal(tmp_path / "items.jsonl", [first, third])
    assert rs.finished(tmp_path) == {"k": third}


# ------------------------------------------------------------------------------------------------ identity


def _row(id="fox", prompt="a red fox", seed=None, **kw: Any) -> Row:
    base = dict(negative_prompt=None, width=64, height=64, num_inference_steps=4, guidance_scale=3.5,
                num_images_per_prompt=1, line=1)
    values = {k: kw.pop(k) for k in ("num_frames", "fps") if k in kw}  # the video fields: Row.values
    base.update(kw)
    return Row(id=id, prompt=prompt, seed=seed, values=values, **base)


def _item(row: Row = None, index: int = 0, seed: int = 11) -> Item:
    return Item(row=row or _row(), index=index, seed=seed)


def test_item_inputs_are_every_row_field_but_the_excluded_ones():
    row = _row(expect={"shape": "circle"}, meta={"source": "x"}, set_fields=("width",), num_images_per_prompt=2,
               line=9, negative_prompt="blurry")
    assert rs.item_inputs(_item(row, seed=5)) == {
        "prompt": "a red fox", "negative_prompt": "blurry", "seed": 5, "width": 64, "height": 64,
        "num_inference_steps": 4, "guidance_scale": 3.5, "set_fields": ("width",), "ignored": None}


def test_item_inputs_keep_video_fields_when_set():
    inp = rs.item_inputs(_item(_row(num_frames=9, fps=8)))
    assert (inp["num_frames"], inp["fps"]) == (9, 8)
    img = rs.item_inputs(_item(_row(num_frames=9)))
    assert img["num_frames"] == 9 and "fps" not in img
    assert "num_frames" not in rs.item_inputs(_item()) and "fps" not in rs.item_inputs(_item())


def test_item_inputs_of_a_plain_object_row():
    row = SimpleNamespace(id="r", prompt="p", line=3, expect=None, width=8, meta=None)
    assert rs.item_inputs(SimpleNamespace(row=row, seed=1)) == {"prompt": "p", "width": 8, "seed": 1}


def _platform(kind="cpu", capability=None, name="the device") -> Dict[str, Any]:
    return {"kind": kind, "capability": capability, "device": kind, "probes": {"device_name": name}}


BACKENDS = {"denoise": {"attention": {"requested": "auto", "selected": {"joint": {"backend": "TORCH_SDPA"}}},
                        "linear": {"requested": "torch", "selected": "TORCH"}, "moe": None}}
PACKAGES = {"torch": "2.13", "diffusers": "0.42", "python": "3.11", "hydra-core": "1.3", "omegaconf": "2.3",
            "pillow": "11"}


def test_run_identity(cfg):
    doc = rs.run_identity(cfg, "float32", _platform(), BACKENDS, PACKAGES)
    assert sorted(doc) == ["backends", "config", "dtype", "packages", "platform", "source"]
    assert doc["dtype"] == "float32"
    assert doc["platform"] == {"kind": "cpu", "capability": None, "device_name": None}  # a CPU's name: not the bytes
    assert doc["backends"] == {"denoise": {"attention": {"joint": {"backend": "TORCH_SDPA"}}, "linear": "TORCH",
                                           "moe": None}}
    assert doc["packages"] == {"torch": "2.13", "diffusers": "0.42", "pillow": "11"}
    assert doc["source"] == {}
    conf = doc["config"]
    assert sorted(conf) == sorted([k if k != "model.engine" else "model.adapter" for k in rs.SEMANTIC_KEYS
                                   if k not in ("seed", "num_images_per_prompt", "backend", "model.backend",
                                                "model.lora", "model.lora_fuse")]
                                  + ["cpu_threads"])
    assert conf["model.name"] == "tiny_flux" and conf["cpu_threads"] == 1 and conf["dtype"] == "auto"
    assert conf["model.adapter"] == "flux"  # model.engine under its former name: identities survive the rename
    # row defaults reach the bytes through the rows; backends through ``backends``; LoRA adapters through each
    # item's ``lora`` (sha256, scale) and the source (``source.lora``: the library, fused or not)
    assert conf["model.generation"] == {"max_sequence_length": 64, "true_cfg_scale": 1.0, "num_frames": None,
                                        "fps": None}
    assert conf["model.stages"] == {"denoise": {"engine_extras": {}, "attention": None, "linear": None, "moe": None}}
    assert conf["optimize.fuse_qkv"] is False


def test_run_identity_on_a_gpu_names_the_device():
    doc = rs.run_identity({}, "bfloat16", _platform("cuda", "sm90", "NVIDIA H200"), {}, {})
    assert doc["platform"] == {"kind": "cuda", "capability": "sm90", "device_name": "NVIDIA H200"}
    assert doc["backends"] == {} and doc["config"]["model.name"] is None
    assert rs.run_identity({}, "x", {"kind": "cuda"}, {}, {})["platform"]["device_name"] is None


def test_run_identity_selected_not_requested_counts(cfg):
    a = rs.run_identity(cfg, "float32", _platform(), BACKENDS, PACKAGES)
    explicit = copy.deepcopy(BACKENDS)
    explicit["denoise"]["attention"]["requested"] = "TORCH_SDPA"
    assert rs.run_identity(cfg, "float32", _platform(), explicit, PACKAGES) == a
    other = copy.deepcopy(BACKENDS)
    other["denoise"]["linear"]["selected"] = "FP8"
    assert rs.run_identity(cfg, "float32", _platform(), other, PACKAGES) != a


def test_run_identity_changes_with_what_changes_the_bytes(cfg):
    base = rs.identity_sha256(rs.run_identity(cfg, "float32", _platform(), BACKENDS, PACKAGES))
    same = [rs.run_identity(cfg, "float32", _platform(name="another CPU"), BACKENDS, PACKAGES),
            rs.run_identity(_set(cfg, "model.generation.width", 256), "float32", _platform(), BACKENDS, PACKAGES),
            rs.run_identity(_set(cfg, "seed", 5), "float32", _platform(), BACKENDS, PACKAGES),
            rs.run_identity(_set(cfg, "backend.attention", "sdpa"), "float32", _platform(), BACKENDS, PACKAGES),
            rs.run_identity(_set(cfg, "model.stages.denoise.backend.linear", "fp8"), "float32", _platform(), BACKENDS,
                            PACKAGES),
            rs.run_identity(cfg, "float32", _platform(), BACKENDS, dict(PACKAGES, python="3.12"))]
    for doc in same:
        assert rs.identity_sha256(doc) == base
    differ = [rs.run_identity(cfg, "bfloat16", _platform(), BACKENDS, PACKAGES),
              rs.run_identity(_set(cfg, "cpu_threads", 4), "float32", _platform(), BACKENDS, PACKAGES),
              rs.run_identity(_set(cfg, "model.generation.true_cfg_scale", 2.0), "float32", _platform(), BACKENDS,
                              PACKAGES),
              rs.run_identity(_set(cfg, "model.stages.denoise.engine_extras", {"x": 1}), "float32", _platform(),
                              BACKENDS, PACKAGES),
              rs.run_identity(cfg, "float32", _platform(), BACKENDS, dict(PACKAGES, torch="2.14")),
              rs.run_identity(cfg, "float32", _platform(), BACKENDS, PACKAGES, output={"codec": "x"}),
              rs.run_identity(cfg, "float32", _platform(), BACKENDS, PACKAGES,
                              context=SimpleNamespace(ulysses=2, ring=1)),
              rs.run_identity(_set(cfg, "cache.method", "fbcache"), "float32", _platform(), BACKENDS, PACKAGES)]
    assert len({rs.identity_sha256(d) for d in differ} | {base}) == len(differ) + 1


def test_run_identity_optional_sections(cfg):
    doc = rs.run_identity(_set(cfg, "cache.method", "fbcache"), "float32", _platform(), BACKENDS, PACKAGES,
                          output={"codec": "h264"}, context=SimpleNamespace(ulysses=2, ring=3))
    assert doc["output"] == {"codec": "h264"}
    assert doc["context_parallel"] == {"ulysses_degree": 2, "ring_degree": 3}
    assert doc["config"]["cache"]["method"] == "fbcache"
    plain = rs.run_identity(cfg, "float32", _platform(), BACKENDS, PACKAGES)
    assert "output" not in plain and "context_parallel" not in plain and "cache" not in plain["config"]


def test_run_identity_fingerprints_a_local_snapshot(tmp_path):
    snap = tmp_path / "snap"
    (snap / "transformer").mkdir(parents=True)
    (snap / "model_index.json").write_text('{"a": 1}')
    (snap / "transformer" / "w.safetensors").write_bytes(b"\0" * 10)
    src = {"kind": "path", "path": str(snap), "files": ["stale"]}
    doc = rs.run_identity({}, "float32", _platform(), {}, {}, source=src)
    assert doc["source"] == {"kind": "path", "path": str(snap), "files": {
        "model_index.json": hashlib.sha256(b'{"a": 1}').hexdigest(), "transformer/w.safetensors": 10}}
    hub = rs.run_identity({}, "float32", _platform(), {}, {}, source={"kind": "hub", "path": str(snap), "files": [1]})
    assert hub["source"] == {"kind": "hub", "path": str(snap)}
    gone = rs.run_identity({}, "float32", _platform(), {}, {}, source={"kind": "path", "path": str(tmp_path / "no")})
    assert gone["source"] == {"kind": "path", "path": str(tmp_path / "no")}


# Digests a run dir written by this version records: a resume by a later version must compute the same values, or
# it would regenerate every item of every earlier run.
IDENTITY = {"config": {"seed": 0, "model.name": "tiny_flux"}, "dtype": "float32", "b": [1, 2.5, None, "é"]}


def test_identity_digest_is_stable_and_order_free():
    assert rs.identity_sha256(IDENTITY) == "2644b2c6631e8c68f4ad4cef05272c7ed096e7f5ddb5664f47625f6cb9a8dc1c"
    assert rs.identity_sha256(dict(reversed(list(IDENTITY.items())))) == rs.identity_sha256(IDENTITY)


def test_inputs_digest_is_stable():
    item = _item(_row(seed=3), seed=3)
    assert rs.inputs_sha256("r" * 64, item) == "0bc1a5d389cac10ac751ce1488ea0458f14bfc953d2b372bfa177453708cb991"


def test_inputs_digest_changes_with_the_run_and_each_input():
    base = rs.inputs_sha256("r", _item())
    assert rs.inputs_sha256("r", _item()) == base
    for other in (rs.inputs_sha256("s", _item()), rs.inputs_sha256("r", _item(seed=12)),
                  rs.inputs_sha256("r", _item(_row(prompt="a blue fox"))),
                  rs.inputs_sha256("r", _item(_row(width=128))),
                  rs.inputs_sha256("r", _item(_row(guidance_scale=None)))):
        assert other != base
    assert rs.inputs_sha256("r", _item(_row(id="other-id", line=7))) == base  # the id names the file only


def test_expected_inputs_records_batch_size_and_position():
    a, b, c = (_item(_row(id=i), seed=s) for i, s in (("a", 1), ("b", 2), ("c", 3)))
    exp = rs.expected_inputs("r", [[a, b], [c]])
    assert exp == {"a": {"inputs_sha256": rs.inputs_sha256("r", a), "batch": {"size": 2, "position": 0}},
                   "b": {"inputs_sha256": rs.inputs_sha256("r", b), "batch": {"size": 2, "position": 1}},
                   "c": {"inputs_sha256": rs.inputs_sha256("r", c), "batch": {"size": 1, "position": 0}}}


def test_identity_diff_names_the_differing_keys():
    old = {"config": {"a": 1, "b": {"c": 2}}, "packages": {"torch": "2.13"}, "sha256": "x"}
    new = {"config": {"a": 1, "b": {"c": 3}}, "packages": {"torch": "2.14", "pillow": "11"}, "sha256": "x"}
    assert rs.identity_diff(old, new) == ["config.b.c: 2 -> 3", "packages.pillow: None -> '11'",
                                          "packages.torch: '2.13' -> '2.14'"]
    assert rs.identity_diff(old, old) == []
    assert rs.identity_diff(None, new) == ["(the earlier run recorded no identity)"]
    assert rs.identity_diff({}, new) == ["(the earlier run recorded no identity)"]


# -------------------------------------------------------------------------------------------------- reuse


def _expected(**kw: Any) -> Dict[str, Dict[str, Any]]:
    return {k: {"inputs_sha256": sha, "batch": {"size": 2, "position": p}} for k, (sha, p) in kw.items()}


def test_reusable_needs_the_same_inputs_and_batch():
    exp = _expected(a=("s1", 0), b=("s2", 1), c=("s3", 0), d=("s4", 1))
    done = {"a": {"inputs_sha256": "s1", "batch": {"size": 2, "position": 0}},      # reused
            "b": {"inputs_sha256": "other", "batch": {"size": 2, "position": 1}},   # other inputs
            "c": {"inputs_sha256": "s3", "batch": {"size": 1, "position": 0}},      # other batch size
            "d": {"file": "x"},                                                     # recorded before identities
            "e": {"inputs_sha256": "s5", "batch": {"size": 2, "position": 0}}}      # not in this run
    assert rs.reusable(done, exp) == {"a": done["a"]}


def test_reusable_position_counts():
    exp = _expected(a=("s1", 0))
    assert rs.reusable({"a": {"inputs_sha256": "s1", "batch": {"size": 2, "position": 1}}}, exp) == {}


def test_why_not_reused_names_the_first_reason():
    item = _item(_row(prompt="a red fox", width=64), seed=11)
    prompt_sha = hashlib.sha256(b"a red fox").hexdigest()
    assert rs.why_not_reused({"prompt_sha256": "0" * 64}, item, False) == "prompt"
    assert rs.why_not_reused({"prompt_sha256": prompt_sha, "seed": 12}, item, False) == "seed"
    assert rs.why_not_reused({"seed": 11, "params": {"width": 128}}, item, True) == "width"
    assert rs.why_not_reused({"seed": 11, "params": {"width": 64, "steps": 9}}, item, True) == (
        "no inputs_sha256 recorded")
    assert rs.why_not_reused({"inputs_sha256": "x"}, item, True) == "run config/platform/backends/packages"
    assert rs.why_not_reused({"inputs_sha256": "x", "batch": {"size": 4, "position": 3}}, item, False) == (
        "its batch: size/position 4/3")
    assert rs.why_not_reused({"inputs_sha256": "x", "prompt_sha256": None, "seed": None}, item, False) == (
        "its batch: size/position None/None")


def test_regenerate_batches_runs_a_batch_again_whole():
    a, b, c, d, e = (_item(_row(id=i)) for i in "abcde")
    reuse = {"a": {}, "b": {}, "d": {}, "e": {}}
    assert [it.key for it in rs.regenerate_batches([[a, b], [c, d], [e]], reuse)] == ["c", "d"]
    assert rs.regenerate_batches([[a, b], [e]], reuse) == []
    assert [it.key for it in rs.regenerate_batches([[a, b], [c, d], [e]], {})] == list("abcde")


def test_get_walks_dotted_keys():
    d = {"a": {"b": {"c": 1}}, "x": 3}
    assert rs._get(d, "a.b.c") == 1 and rs._get(d, "a.b") == {"c": 1}
    assert rs._get(d, "a.z") is None and rs._get(d, "x.y") is None and rs._get(d, "q") is None


@pytest.mark.parametrize("text, kind", [("", "JSONDecodeError"), ("garbage{", "JSONDecodeError"), ("[]", "list"),
                                        ("\xff\xfe", "UnicodeDecodeError")])
def test_a_dir_whose_manifest_is_not_a_json_object_is_refused_and_left_as_it_was(tmp_path, text, kind):
    """An empty, truncated or edited ``manifest.json`` raised a traceback (JSONDecodeError; ``[]``: AttributeError)
    and exited 1; it is refused (exit 2) naming the file, and nothing in the dir is touched."""
    from _helpers import execute
    from runner.core.errors import RunnerError
    from runner.core.resume import ResumeConflictError

    d = tmp_path / "run"
    d.mkdir()
    (d / "manifest.json").write_bytes(text.encode("latin-1"))
    (d / "items.jsonl").write_text("mine\n")
    r = execute(d, ["dataset.limit=1"], catch=(RunnerError,))
    assert isinstance(r.error, ResumeConflictError) and r.error.exit_code == 2, r
    msg = str(r.error)
    assert msg.startswith(f"{d / 'manifest.json'} is not a run's manifest ({kind}: "), msg
    assert msg.endswith("fix: another run dir (hydra.run.dir=...), or move the dir's files away if they are not a "
                        "run's"), msg
    assert (d / "manifest.json").read_bytes() == text.encode("latin-1")
    assert (d / "items.jsonl").read_text() == "mine\n" and sorted(p.name for p in d.iterdir()) == [
        "items.jsonl", "manifest.json"]
