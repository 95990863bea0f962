"""Issue #16, kinds 4, 5, 6, 7, 9 and 10 (cases C14-C17, C19, C20 of ``shared/cases/README.md``), each as the
case's input run for real (tiny_flux on CPU), plus the other places where the same kind of fault could happen.

* C14 resume identity: an item is reused only when the current run would produce exactly it (prompt, seed,
  parameters, batch size and position, run config, platform, backends, packages); a forced resume after a line
  was inserted at the top of a txt dataset regenerates every shifted item, and the dir then equals a fresh run's.
* C15 no tracebacks: a bad library env var, an output dir under a regular file, an unknown architecture key and a
  pickle-only snapshot each exit 2 before anything loads, naming the variable / key / file and the fix.
* C16 complete refusals: every unmet requirement is named.
* C17 repro of quoted values: overrides are replayed exactly; every path the re-run adds is quoted for Hydra.
* C19 Hydra's instantiate keys refused at any depth. C20 misplaced backend keys say where they belong.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytestmark = pytest.mark.cpu

REPO_ROOT = Path(__file__).resolve().parent.parent
STEPS = "model.generation.num_inference_steps=2"


def _journal(d: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (d / "items.jsonl").read_text().splitlines() if line.strip()]


def _pngs(d: Path) -> Dict[str, bytes]:
    return {r["key"]: (d / r["file"]).read_bytes() for r in _journal(d) if r["status"] == "ok"}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _cli(args: List[str], env: Dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", "model=tiny_flux", "platform=cpu", *args], cwd=cwd,
                          env=dict(env, PYTHONPATH=str(REPO_ROOT)), capture_output=True, text=True, timeout=timeout)


def _job(compose, tmp_path: Path, ov: List[str]) -> Dict[str, Any]:
    """``run_job`` in-process (platform=cpu); returns job_status.json (the exit code and the error)."""
    from runner.app.jobs import run_job

    ov = ["platform=cpu", *ov]
    code = run_job(compose(ov), tmp_path, ov, reraise=True)
    st = json.loads((tmp_path / "job_status.json").read_text())
    assert st["exit_code"] == code
    return st


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a model is built or loaded (every refusal below must come first)."""
    import models.flux as flux

    def no(*a, **k):
        raise AssertionError("the model was built or loaded before the refusal")

    monkeypatch.setattr(flux.FluxEngine, "load_pipeline", no)
    monkeypatch.setattr(flux, "embedded_snapshot", no)
    monkeypatch.setattr(flux, "build_components", no)


# ============================================================================================ C14 resume identity
def test_c14_inserted_first_line_with_force_regenerates_every_shifted_item(execute, tmp_path):
    """The case: a 2-line txt dataset run to completion, a new first line inserted, re-run into the same dir with
    run.force=true. line000001 must not keep the old prompt's image: every item is regenerated (their prompts and
    derived seeds moved) and the dir equals a fresh run of the new file, byte for byte."""
    data = tmp_path / "prompts.txt"
    data.write_text("a red fox in snow\na lighthouse at dusk\n")
    ov = ["dataset=txt", f"dataset.path={data}", STEPS]
    d = tmp_path / "run"
    assert execute(ov, d).code == 0
    old = {r["key"]: r for r in _journal(d)}
    data.write_text("a green frog on a leaf\na red fox in snow\na lighthouse at dusk\n")
    r = execute([*ov, "run.force=true"], d)
    assert r.code == 0
    recs = {x["key"]: x for x in _journal(d)}
    assert list(recs) == ["line000001", "line000002", "line000003"]
    for key, prompt in zip(recs, ("a green frog on a leaf", "a red fox in snow", "a lighthouse at dusk")):
        assert recs[key]["prompt_sha256"] == _sha(prompt.encode()), key
    assert recs["line000001"]["file_sha256"] != old["line000001"]["file_sha256"], "old prompt's image kept"
    assert r.manifest["resumed_from"]["reused_items"] == 0 and r.manifest["counts"]["ok"] == 3
    fresh = execute(ov, tmp_path / "fresh")
    assert _pngs(d) == _pngs(fresh.run_dir)
    assert sorted(p.name for p in (d / "images").iterdir()) == sorted(p.name for p in (fresh.run_dir / "images").iterdir())


def test_c14_identity_holds_every_input_of_an_item(execute, tmp_path):
    """Each thing that determines an item's bytes is in its identity: an unchanged re-run reuses everything; a
    forced change of a generation setting or of batch_size regenerates exactly the affected items, and the dir then
    equals a fresh run with the new config (byte for byte)."""
    data = tmp_path / "rows.jsonl"
    rows = [{"id": "a", "prompt": "a red fox"}, {"id": "b", "prompt": "a blue bird", "seed": 7},
            {"id": "c", "prompt": "a teapot"}, {"id": "d", "prompt": "a cabin", "width": 64}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ov = ["dataset=jsonl", f"dataset.path={data}", STEPS, "batch_size=2"]
    d = tmp_path / "run"
    assert execute(ov, d).code == 0
    recs = _journal(d)
    assert all(len(r["inputs_sha256"]) == 64 for r in recs)
    assert [(r["key"], r["batch"]["size"], r["batch"]["position"]) for r in recs] == [
        ("a", 2, 0), ("b", 2, 1), ("c", 1, 0), ("d", 1, 0)]

    # unchanged: everything reused, nothing loaded
    r = execute(ov, d)
    assert (r.manifest["counts"]["ok"], r.manifest["counts"]["reused"]) == (0, 4)

    # a generation setting (forced): every item regenerated, as a fresh run with it
    ms = "model.generation.max_sequence_length=32"
    r = execute([*ov, ms, "run.force=true"], d)
    assert (r.manifest["counts"]["ok"], r.manifest["counts"]["reused"]) == (4, 0)
    assert _pngs(d) == _pngs(execute([*ov, ms], tmp_path / "fresh_ms").run_dir)

    # batch_size (not a semantic key: no force needed): items whose batch size/position changes are regenerated;
    # c and d ran alone before and keep their batch (size 1, position 0)
    r = execute([*ov[:-1], "batch_size=1", ms], d)
    assert (r.manifest["counts"]["ok"], r.manifest["counts"]["reused"]) == (2, 2)
    assert _pngs(d) == _pngs(execute([*ov[:-1], "batch_size=1", ms], tmp_path / "fresh_bs1").run_dir)


def test_c14_batch_with_a_missing_item_runs_again_whole(execute, tmp_path):
    """A batch of 2 whose second item was lost (a kill between its two writes) runs again whole, so the regenerated
    item keeps its batch peer and position and equals the uninterrupted run's bytes; its peer is rewritten with
    the same bytes. A record written before identities existed (no inputs_sha256) is never reused."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n"
                            for k, p in (("a", "a red fox"), ("b", "a blue bird"), ("c", "a teapot"))))
    ov = ["dataset=jsonl", f"dataset.path={data}", STEPS, "batch_size=2"]
    d = tmp_path / "run"
    ref = execute(ov, d)
    want = _pngs(d)
    recs = _journal(d)
    (d / recs[1]["file"]).unlink()
    r = execute(ov, d)
    assert (r.manifest["counts"]["ok"], r.manifest["counts"]["reused"]) == (2, 1)
    assert _pngs(d) == want
    assert [x["batch"] for x in _journal(d)] == [x["batch"] for x in ref.items]

    legacy = [{k: v for k, v in x.items() if k not in ("inputs_sha256", "batch")} for x in _journal(d)]
    (d / "items.jsonl").write_text("".join(json.dumps(x) + "\n" for x in legacy))
    r = execute(ov, d)
    assert (r.manifest["counts"]["ok"], r.manifest["counts"]["reused"]) == (3, 0)
    assert _pngs(d) == want


def test_c14_merge_keeps_only_records_of_the_current_config(tmp_path):
    """runner.core.distributed.merge (data parallel) reuses ok records of every journal of the dir: a stale ok record
    (an earlier config's, left in items.jsonl) must not win over the rank's failed retry of that item, and a
    current one is kept."""
    from runner.core.distributed import merge

    def rec(key, status, sha):
        return {"key": key, "id": key, "status": status, "inputs_sha256": sha, "file": f"images/{key}.png"}

    (tmp_path / "items.jsonl").write_text(json.dumps(rec("a", "ok", "OLD-a")) + "\n"
                                          + json.dumps(rec("b", "ok", "NEW-b")) + "\n")
    (tmp_path / "items.rank0.jsonl").write_text(json.dumps(rec("a", "failed", "NEW-a")) + "\n")
    (tmp_path / "manifest.rank0.json").write_text(json.dumps({"status": "completed_with_failures",
                                                              "identity": {"sha256": "RUN"}}))
    current = lambda shas: {"a": [f"NEW-a" for _ in shas], "b": ["NEW-b" for _ in shas]}  # noqa: E731
    merge(tmp_path, 1, ["a", "b"], "torchrun", current)
    got = {r["key"]: r for r in _journal(tmp_path)}
    assert got["a"]["status"] == "failed" and got["b"]["status"] == "ok"


# ============================================================================================ C15 no tracebacks
def _no_traceback(p: subprocess.CompletedProcess, *names: str) -> str:
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for n in names:
        assert n in out, f"{n!r} not named in:\n{out[-3000:]}"
    assert "fix" in out.lower()
    return out


def test_c15_bad_diffusers_env_var_exits_2_with_manifest(subprocess_env, tmp_path):
    d = tmp_path / "run"
    p = _cli([STEPS, "dataset.limit=1", f"hydra.run.dir={d}"], dict(subprocess_env, DIFFUSERS_ATTN_BACKEND="garbage"),
             tmp_path)
    _no_traceback(p, "DIFFUSERS_ATTN_BACKEND", "garbage", "backend.attention")
    assert json.loads((d / "manifest.json").read_text())["status"] == "invalid"
    assert json.loads((d / "job_status.json").read_text())["error_type"] == "EnvironmentVariableError"


def test_c15_output_dir_under_a_regular_file(subprocess_env, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    d = tmp_path / "run"
    p = _cli([STEPS, "dataset.limit=1", f"output.dir={f}/y", f"hydra.run.dir={d}"], subprocess_env, tmp_path)
    _no_traceback(p, "output.dir", str(f))
    assert json.loads((d / "job_status.json").read_text())["error_type"] == "OutputPathError"
    # Hydra's own run dir under a file is refused before Hydra makes it
    p = _cli([STEPS, f"hydra.run.dir={f}/z"], subprocess_env, tmp_path)
    _no_traceback(p, "hydra.run.dir", str(f))


def test_c15_unknown_architecture_key_with_dummy_weights(subprocess_env, tmp_path):
    p = _cli([STEPS, "dataset.limit=1", "model.load_format=dummy", "+model.architecture.transformer.num_layerz=5",
              f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env, tmp_path)
    _no_traceback(p, "model.architecture.transformer.num_layerz", "FluxTransformer2DModel", "num_layers")


@pytest.mark.parametrize("key", ["+model.architecture.transformer.num_layerz=5",
                                 "+model.architecture.text_encoder.num_layerz=5",  # CLIPTextConfig stores it silently
                                 "+model.architecture.vae.latent_chanels=4",
                                 "+model.architecture.scheduler.shiftt=1.0",
                                 "+model.architecture.transformr.num_layers=1",
                                 "+model.architecture.tokenizer.vocab=5"])
@pytest.mark.parametrize("fmt", ["dummy", "auto"])
def test_c15_architecture_keys_checked_before_anything_is_built(compose, tmp_path, no_load, key, fmt):
    st = _job(compose, tmp_path, [STEPS, "dataset.limit=1", f"model.load_format={fmt}", key])
    assert (st["exit_code"], st["error_type"]) == (2, "ConfigValueError"), st
    assert key.split("=")[0].lstrip("+").rsplit(".", 1)[0] in st["error"]


@pytest.fixture(scope="module")
def pickle_snapshot(tiny_snapshot, tmp_path_factory) -> Path:
    """tiny_flux's snapshot with every ``*.safetensors`` replaced by a ``.bin`` (torch.save pickle) file."""
    import torch
    from safetensors.torch import load_file

    dst = tmp_path_factory.mktemp("pickle") / "snap"
    shutil.copytree(tiny_snapshot, dst)
    for f in list(dst.rglob("*.safetensors")):
        name = "diffusion_pytorch_model.bin" if f.name.startswith("diffusion") else "pytorch_model.bin"
        torch.save(load_file(f), f.parent / name)
        f.unlink()
    return dst


def test_c15_pickle_only_snapshot_refused_naming_the_file(compose, tmp_path, pickle_snapshot, monkeypatch, no_load,
                                                         subprocess_env):
    import torch

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle file was loaded"))
    st = _job(compose, tmp_path / "in", ["model=flux", f"model.path={pickle_snapshot}", STEPS, "dataset.limit=1",
                                         "model.generation.width=128", "model.generation.height=128"])
    assert (st["exit_code"], st["error_type"]) == (2, "ModelPathError"), st
    assert "pytorch_model.bin" in st["error"] and "safetensors" in st["error"]
    p = _cli(["model=flux", f"model.path={pickle_snapshot}", STEPS, "dataset.limit=1",
              f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env, tmp_path)
    _no_traceback(p, "model.path", "pytorch_model.bin")


@pytest.mark.parametrize("name,value,named", [
    ("DIFFUSERS_ATTN_BACKEND", "garbage", "flash"),
    ("DIFFUSERS_ATTN_CHECKS", "maybe", "not a boolean"),
    ("CUDA_VISIBLE_DEVICES", "first", "device indices"),
    ("TORCH_CUDNN_SDPA_ENABLED", "yes please", "0 or 1"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments", "key:value"),
    ("LOCAL_RANK", "zero", "integer"),
    ("VLLM_CPU_KVCACHE_SPACE", "4GiB", "integer"),
    ("TRITON_INTERPRET", "true", "0 or 1"),
    ("RUNNER_CACHE", "<file>/cache", "is a file"),
])
def test_c15_every_env_var_the_run_reads_is_checked_at_startup(compose, tmp_path, monkeypatch, no_load, name, value,
                                                              named):
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv(name, value.replace("<file>", str(f)))
    st = _job(compose, tmp_path / "run", [STEPS, "dataset.limit=1"])
    assert (st["exit_code"], st["error_type"]) == (2, "EnvironmentVariableError"), st
    assert name in st["error"] and named in st["error"]


@pytest.mark.parametrize("value", ["0", "0,1", "GPU-8f6a3c1e-1234", "", "-1"])
def test_c15_valid_cuda_visible_devices_accepted(value):
    from runner.core.environment import check_environment

    check_environment({"CUDA_VISIBLE_DEVICES": value, "PYTORCH_CUDA_ALLOC_CONF":
                       "expandable_segments:True,roundup_power2_divisions:[256:1,512:2]"})


def test_c15_cache_dir_under_a_file(compose, tmp_path, no_load):
    f = tmp_path / "file"
    f.write_text("x")
    st = _job(compose, tmp_path / "run", [STEPS, "dataset.limit=1", f"cache_dir={f}/c"])
    assert (st["exit_code"], st["error_type"]) == (2, "OutputPathError") and "cache_dir" in st["error"], st


# ======================================================================================= C16 complete refusals
@pytest.mark.parametrize("ov,named", [
    (["backend.attention=trtllm"], ["platform cuda", "this is cpu", "sm100 or sm103", "float32",
                                    "not wired into the engine of stage 'denoise'"]),
    (["backend.attention=cudnn", "dtype=float32"], ["platform cuda", "this is cpu", "float32"]),
])
def test_c16_refusal_names_every_unmet_requirement(compose, tmp_path, no_load, ov, named):
    st = _job(compose, tmp_path, [STEPS, "dataset.limit=1", *ov])
    assert (st["exit_code"], st["outcome"], st["error_type"]) == (2, "refused", "BackendUnavailableError"), st
    for n in named:
        assert n in st["error"], f"{n!r} not named in: {st['error']}"


# ==================================================================================== C17 repro of quoted values
AWKWARD = ["run(1).jsonl", "a,b.jsonl", "[x]{y}.jsonl", "it's.jsonl", 'say "hi".jsonl', "two  spaces .jsonl",
           "$HOME.jsonl", "${oc.env:HOME}.jsonl", "a=b:c.jsonl", "back\\slash\\.jsonl", "é漢字🙂.jsonl",
           "#~!*?|@%&;.jsonl", "null", "true", "1.5", "tab\there.jsonl", "end\\"]


@pytest.mark.parametrize("name", AWKWARD)
def test_c17_hydra_quote_composes_to_the_exact_value(compose, name):
    """Property: for each awkward value, the quoted override composes (through Hydra) to exactly that value."""
    from runner.core.paths import hydra_quote

    path = f"/data/dir ({name})/{name}"
    cfg = compose(["dataset=jsonl", f"dataset.path={hydra_quote(path)}", f"+model.architecture.note={hydra_quote(name)}"])
    assert cfg.dataset.path == path
    assert cfg.model.architecture.note == name


@pytest.mark.parametrize("name", AWKWARD)
def test_c17_rerun_command_replays_overrides_exactly(name, tmp_path):
    """runner.tools.repro's re-run argv: the original overrides verbatim; a relative dataset.path becomes the recorded
    absolute path, and the new run dir is added, each parsing back to exactly the intended value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from runner.core.paths import hydra_quote
    from runner.tools.repro import rerun_command

    raw = [f"dataset.path={hydra_quote(name)}", f"+model.architecture.note={hydra_quote(name)}"]
    man = {"overrides": raw, "dataset": {"path": f"/abs/{name}"}, "config": {"output": {"dir": "x"}}}
    new_dir = tmp_path / f"new {name}"
    argv = rerun_command(man, new_dir)[3:]
    parsed = {o.key_or_group: OmegaConf.to_container(OmegaConf.create({"v": o.value()}), resolve=True)["v"]
              for o in OverridesParser.create().parse_overrides(argv)}  # as the composed config holds them
    assert parsed["dataset.path"] == f"/abs/{name}"
    assert argv[1] == raw[1]  # replayed verbatim
    assert parsed["output.dir"] == parsed["hydra.run.dir"] == str(new_dir)


def test_c17_repro_of_quoted_path_passes(subprocess_env, tmp_path):
    """The case: a run with 'dataset.path="<dir>/run(1).jsonl"' passes, then `python -m runner.repro <run dir>`
    reproduces it (REPRO OK); repro.sh re-runs it into a NEW_RUN_DIR full of Hydra's special characters."""
    data = tmp_path / "d i r" / "run(1).jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"id": "r1", "prompt": "a red fox"}) + "\n")
    d = tmp_path / "run"
    p = _cli([STEPS, "dataset=jsonl", f'dataset.path="{data}"', f"hydra.run.dir={d}"], subprocess_env, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    env = dict(subprocess_env, PYTHONPATH=str(REPO_ROOT))
    r = subprocess.run([sys.executable, "-m", "runner.repro", str(d), "--out", str(tmp_path / "again (1), [x]")],
                       env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "REPRO OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    new = tmp_path / "re run (2),[y]=z's"
    r = subprocess.run(["bash", str(d / "repro.sh"), str(new)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _pngs(new) == _pngs(d)


# ====================================================================================== C19 instantiate keys
@pytest.mark.parametrize("ov", ["+model.architecture._target_=os.system",
                                "+model.architecture.transformer._partial_=true",
                                "+model.stages.denoise.engine_extras._target_=os.system",
                                "+platform.overlays.tiny_flux.engine_extras._args_=[1]",
                                "+model.architecture._recursive_=false", "+model.architecture._convert_=all",
                                "+_target_=os.system", "+model._target_=os.system"])
def test_c19_instantiate_keys_refused_at_any_depth(compose, tmp_path, no_load, ov):
    st = _job(compose, tmp_path, [STEPS, "dataset.limit=1", ov])
    key = ov.split("=")[0].lstrip("+")
    assert (st["exit_code"], st["error_type"]) == (2, "ConfigValueError"), st
    assert st["error"].startswith(f"{key}: the run config takes no {key.rsplit('.', 1)[-1]}"), st["error"]


def test_c19_cli_exit_2(subprocess_env, tmp_path):
    p = _cli([STEPS, "dataset.limit=1", "+model.architecture._target_=os.system", f"hydra.run.dir={tmp_path / 'r'}"],
             subprocess_env, tmp_path)
    _no_traceback(p, "model.architecture._target_")


# ======================================================================================== C20 misplaced keys
@pytest.mark.parametrize("ov,fld", [("+model.attention_backend=sdpa", "attention"),
                                    ("+model.attn_backend=sdpa", "attention"),
                                    ("+model.moe_backend=torch", "moe"),
                                    ("+model.linear_backend=torch", "linear"),
                                    ("+model.stages.denoise.attention_backend=sdpa", "attention"),
                                    ("+model.stages.denoise.attn=sdpa", "attention"),
                                    ("+attention_backend=sdpa", "attention"),
                                    ("+model.architecture.attn_backend=sdpa", "attention"),
                                    ("+model.architecture.attention=sdpa", "attention"),
                                    ("+platform.overlays.tiny_flux.attention_backend=sdpa", "attention")])
def test_c20_misplaced_backend_key_points_where_it_belongs(compose, tmp_path, no_load, ov, fld):
    st = _job(compose, tmp_path, [STEPS, "dataset.limit=1", ov])
    assert (st["exit_code"], st["error_type"]) == (2, "MisplacedBackendKeyError"), st
    assert f"backend.{fld}" in st["error"], st["error"]
    if not ov.startswith("+platform"):
        assert f"model.stages.denoise.backend.{fld}" in st["error"] or f"model.stages.<stage>.backend.{fld}" in \
            st["error"], st["error"]


def test_c20_case_message(compose, tmp_path, no_load):
    st = _job(compose, tmp_path, [STEPS, "dataset.limit=1", "+model.attention_backend=sdpa"])
    assert "backend.attention=sdpa" in st["error"] and "model.stages.denoise.backend.attention=sdpa" in st["error"]


@pytest.mark.parametrize("ov,want", [("+model.generation.widht=64", "model.generation.width"),
                                     ("+model.nme=x", "model.name"), ("+sed=1", "seed"),
                                     ("+model.stages.denoise.backnd.attention=sdpa", "model.stages.denoise.backend")])
def test_c20_other_unknown_keys_get_did_you_mean(compose, tmp_path, no_load, ov, want):
    st = _job(compose, tmp_path, [STEPS, "dataset.limit=1", ov])
    assert st["exit_code"] == 2 and f"did you mean {want}?" in st["error"], st


def test_c20_hydra_compose_error_gets_the_pointer(subprocess_env, tmp_path):
    """Without ``+`` Hydra itself refuses the key (not in struct); the CLI adds where it belongs."""
    p = _cli(["model.attention_backend=sdpa", f"hydra.run.dir={tmp_path / 'r'}"], subprocess_env, tmp_path)
    assert p.returncode == 2
    assert "backend.attention=sdpa" in p.stderr, p.stderr[-2000:]


# regression: bug: on the H200 `PYTORCH_CUDA_ALLOC_CONF=garbage python -m runner ...` aborted the process
# (exit 134, "terminate called after throwing an instance of 'c10::Error'") while torch loaded its CUDA library,
# before the startup check that refuses it could run; on a CPU the same check ran only after Hydra made the run dir.
@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_malformed_allocator_setting_is_refused_before_torch_is_imported(subprocess_env, tmp_path, var):
    d = tmp_path / "run"
    env = dict(subprocess_env, PYTHONPATH=str(REPO_ROOT), **{var: "garbage"})
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", "platform=cpu", f"hydra.run.dir={d}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert var in p.stderr and "fix" in p.stderr and "Traceback" not in p.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "hydra" not in imported  # refused first thing, before torch or Hydra load
    assert not d.exists()
