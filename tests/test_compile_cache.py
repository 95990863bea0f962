"""Compile cache (#18): ``compile=regional`` artifacts persist under ``<cache_dir>/compile/<key>``; a second process
loads them (a hit counted by torch, recorded in the manifest) and makes the same bytes; another key never reuses
them. Also ``optimize.compile_mode``'s validation. CPU, tiny_flux, real subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _helpers import cli, execute

from conftest import COLD_COMPILE_ARGS as BASE  # the cold process is the session's cold_compile fixture


def _read(run_dir: Path):
    m = json.loads((run_dir / "manifest.json").read_text())
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    return m, items


def _run(tmp: Path, name: str, cache: Path, env, extra=()):
    run_dir = tmp / name
    p = cli([*BASE, f"cache_dir={cache}", f"hydra.run.dir={run_dir}", *extra], env, tmp, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return _read(run_dir)


@pytest.mark.cpu
def test_second_process_hits_the_compile_cache_and_another_key_does_not(tmp_path, subprocess_env, cold_compile):
    _, cold_dir, cache = cold_compile  # a cold process into an empty cache (its console: tests/test_console.py)
    m1, items1 = _read(cold_dir)
    m2, items2 = _run(tmp_path, "warm", cache, subprocess_env)
    c1, c2 = m1["compile"]["cache"], m2["compile"]["cache"]
    assert c1["enabled"] and c1["key"] == c2["key"] and c1["dir"] == c2["dir"]
    assert Path(c1["dir"]).parent == cache / "compile" and (Path(c1["dir"]) / "key.json").is_file()
    assert c1["existed_before"] is False and c1["status"] == "miss"
    assert c1["counters"]["inductor.fxgraph_cache_miss"] > 0
    # the hit is what torch counted in the second process, not the directory's presence
    assert c2["existed_before"] is True and c2["status"] == "hit", c2
    assert c2["counters"]["inductor.fxgraph_cache_hit"] > 0 and c2["counters"]["inductor.fxgraph_cache_miss"] == 0
    assert m2["compile"]["graphs_compiled_after_warmup"] == 0
    assert m1["compile"]["inductor_deterministic"] is True and m2["compile"]["inductor_deterministic"] is True
    # the lossless lane: the warm process makes the same bytes as the cold one
    assert [r["file_sha256"] for r in items1] == [r["file_sha256"] for r in items2]
    # a different dtype is another key: nothing of the first one is read
    m3, _ = _run(tmp_path, "bf16", cache, subprocess_env, ["dtype=bfloat16"])
    c3 = m3["compile"]["cache"]
    assert c3["key"] != c1["key"] and c3["key_fields"]["dtype"] == "bfloat16" and c3["existed_before"] is False
    assert c3["status"] == "miss" and c3["counters"]["inductor.fxgraph_cache_hit"] == 0


@pytest.mark.cpu
def test_key_changes_with_model_config_device_and_torch(monkeypatch):
    import torch

    from models import compile_cache as cc

    lin = torch.nn.Linear(4, 4)
    lin.config = {"num_layers": 2}
    base = dict(device="cpu", denoiser=lin, dtype=torch.float32, backends={"linear": "TORCH"},
                compile_cfg={"compile": "regional", "compile_mode": "default"})
    k0 = cc.cache_key(cc.key_fields(**base))
    assert k0 == cc.cache_key(cc.key_fields(**base))  # stable
    lin.config = {"num_layers": 3}
    assert cc.cache_key(cc.key_fields(**base)) != k0  # model config
    lin.config = {"num_layers": 2}
    assert cc.cache_key(cc.key_fields(**{**base, "backends": {"linear": "FP8"}})) != k0
    assert cc.cache_key(cc.key_fields(**{**base, "compile_cfg": {"compile": "regional",
                                                                   "compile_mode": "max_autotune"}})) != k0
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cc.cache_key(cc.key_fields(**base)) != k0  # torch version
    monkeypatch.setattr(cc, "device_fields", lambda device: {"kind": "cuda", "name": "NVIDIA H200",
                                                             "capability": [9, 0]})
    assert cc.cache_key(cc.key_fields(**base)) != k0  # GPU


@pytest.mark.cpu
@pytest.mark.parametrize("extra, words", [
    (["optimize.compile_mode=max_autotune_no_cudagraphs"], ["compile=none", "compile=regional"]),
    (["compile=regional", "optimize.compile_mode=reduce_overhead"], ["CUDA graphs", "overwritten", "default"]),
    (["compile=regional", "optimize.compile_mode=max_autotune"], ["CUDA graphs", "max_autotune_no_cudagraphs"]),
])
def test_compile_mode_is_validated(tmp_path, extra, words):
    from runner.core.errors import RunnerError

    run = execute(tmp_path / "r", ["model=tiny_flux", "dataset.limit=1", *extra], catch=(RunnerError,))
    assert type(run.error).__name__ == "ConfigValueError" and run.error.exit_code == 2, run.error
    assert all(w in str(run.error) for w in words), str(run.error)


@pytest.mark.cpu
def test_compile_mode_reaches_torch_compile(monkeypatch):
    from models.compile import compile_regional

    seen = []

    class Block(__import__("torch").nn.Module):
        def compile(self, **kw):
            seen.append(kw)

    import torch

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(), Block()])
    out = compile_regional(model, "max_autotune_no_cudagraphs")
    assert out["mode"] == "max_autotune_no_cudagraphs"
    assert seen == [{"fullgraph": False, "dynamic": False, "mode": "max-autotune-no-cudagraphs"}] * 2
