"""``python -m runner`` as a user runs it: a subprocess in a scratch working directory, with every Hydra output
dir under ``tmp_path`` so nothing lands in the repository's ``outputs/``."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def _runner(args, cwd, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cfg_job_prints_composed_config(tmp_path, subprocess_env):
    p = _runner(["--cfg", "job"], tmp_path, subprocess_env)
    assert p.returncode == 0, p.stderr
    assert "name: toy_shapes" in p.stdout  # the embedded default
    cfg = yaml.safe_load(p.stdout)
    assert cfg["model"]["name"] == "toy_shapes"
    assert cfg["dataset"]["format"] == "builtin"
    assert "hydra" not in cfg
    assert not (tmp_path / "outputs").exists(), "--cfg job must not start a run"


def test_cfg_job_shows_overrides(tmp_path, subprocess_env):
    p = _runner(["--cfg", "job", "dataset=jsonl", "dataset.path=my.jsonl", "batch_size=4", "seed=7"], tmp_path,
                subprocess_env)
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert (cfg["dataset"]["format"], cfg["dataset"]["path"], cfg["batch_size"], cfg["seed"]) == (
        "jsonl", "my.jsonl", 4, 7)


def test_typo_exits_nonzero(tmp_path, subprocess_env):
    p = _runner(["batch_size=abc"], tmp_path, subprocess_env)
    assert p.returncode != 0
    assert "batch_size" in p.stderr
    assert not (tmp_path / "outputs").exists()


def test_multirun_seed_sweep(tmp_path, subprocess_env):
    sweep = tmp_path / "sweep"
    p = _runner(["-m", "seed=1,2", "dataset.limit=2", "platform=cpu", f"hydra.sweep.dir={sweep}"], tmp_path,
                subprocess_env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    jobs = sorted(d for d in sweep.iterdir() if d.is_dir())
    assert [d.name for d in jobs] == ["0", "1"]
    images = []
    for job, seed in zip(jobs, (1, 2)):
        m = json.loads((job / "manifest.json").read_text())
        assert m["status"] == "completed"
        assert m["config"]["seed"] == seed
        assert f"seed={seed}" in m["overrides"]
        assert (m["counts"]["ok"], m["counts"]["failed"]) == (2, 0)
        items = [json.loads(line) for line in (job / "items.jsonl").read_text().splitlines()]
        assert len(items) == 2
        for it in items:
            data = (job / it["file"]).read_bytes()
            assert it["file_sha256"] == hashlib.sha256(data).hexdigest()
            images.append(data)
    assert images[:2] != images[2:], "seed=1 and seed=2 gave the same images"
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_subprocesses_import_the_checkout_under_test(tmp_path, subprocess_env):
    """``python -m runner`` started by a test, from any directory, runs this checkout's code, not a ``runner``
    installed in the environment (an editable install of another checkout): conftest puts the repo root first on
    the subprocess's ``PYTHONPATH``, for ``subprocess_env`` and for the environment every subprocess inherits."""
    import os

    repo = Path(__file__).resolve().parent.parent
    code = ("import json, runner, models, runner.kernels as k; print(json.dumps([m.__file__ for m in (runner, models, k)]))")
    for env in (subprocess_env, None):
        p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        for f in json.loads(p.stdout):
            assert Path(f).resolve().is_relative_to(repo), f"{f} is not from {repo}"
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(repo)


SWEEP_ONE_MODEL_KEY = ["-m", "model=prompt_expand_flux,tiny_flux", "model.stages.expand.backend.attention=TORCH_SDPA"]


def test_sweep_setting_a_key_only_one_model_has_says_why_and_what_works(tmp_path, subprocess_env):
    """Issue 29: ``-m model=prompt_expand_flux,tiny_flux model.stages.expand.backend.attention=...`` got Hydra's
    "Could not override" (tiny_flux has no ``model.stages.expand``), and its suggested ``+`` fix fails in the
    prompt_expand_flux job. Both forms get one runner line (exit 2, no job run) naming the key, the models with and
    without it, and what works; the fix it names (an experiment preset per model) composes."""
    for arg in (SWEEP_ONE_MODEL_KEY[2], "+" + SWEEP_ONE_MODEL_KEY[2]):
        p = _runner([*SWEEP_ONE_MODEL_KEY[:2], arg, f"hydra.sweep.dir={tmp_path / 'sw'}"], tmp_path, subprocess_env)
        out = p.stdout + p.stderr
        assert p.returncode == 2, out[-2000:]
        assert "Could not override" not in out and "Traceback" not in out and "Error merging" not in out
        line = next(x for x in out.splitlines() if x.startswith("runner: "))
        assert "exists only in model=prompt_expand_flux (model=tiny_flux has no model.stages.expand)" in line
        assert "fix: one sweep per model" in line and "-m experiment=" in line
        assert not (tmp_path / "sw").exists()
    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "expand_sdpa.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: prompt_expand_flux\n"
                                           "model:\n  stages:\n    expand:\n      backend:\n"
                                           "        attention: TORCH_SDPA\n")
    p = _runner(["experiment=expand_sdpa", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "--cfg", "job"],
                tmp_path, subprocess_env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert yaml.safe_load(p.stdout)["model"]["stages"]["expand"]["backend"]["attention"] == "TORCH_SDPA"


def test_sweep_override_problem_leaves_other_command_lines_alone():
    """No message for a single run, a key every swept option has, a key no option has (the typo check's), or a
    sweep over one model."""
    from runner.tools.sweep import sweep_override_problem

    assert sweep_override_problem(SWEEP_ONE_MODEL_KEY[1:]) is None  # not a multirun
    assert sweep_override_problem(["-m", "model=tiny_flux,tiny_sd3", "seed=3", "model.generation.width=64"]) is None
    assert sweep_override_problem(["-m", "model=tiny_flux,tiny_sd3", "model.nothere=1"]) is None
    assert sweep_override_problem(["-m", "model=prompt_expand_flux", SWEEP_ONE_MODEL_KEY[2]]) is None
    assert "exists only in model=prompt_expand_flux" in sweep_override_problem(SWEEP_ONE_MODEL_KEY)


def test_hydra_run_dir_on_a_sweep_is_refused_naming_hydra_sweep_dir(tmp_path, subprocess_env):
    """New-user report: ``-m ... hydra.run.dir=X`` ran the sweep under ``outputs/sweeps/...`` without a word (Hydra
    uses ``hydra.sweep.dir`` in a multirun). Now exit 2 before any job, naming the key, the value and the fix;
    nothing is written at X nor at the default sweep dir."""
    from runner.tools.sweep import run_dir_in_sweep_problem

    target = tmp_path / "mine"
    p = _runner(["-m", "model=tiny_flux", "seed=1,2", "dataset.limit=1", f"hydra.run.dir={target}"], tmp_path,
                subprocess_env)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("runner: "))
    assert line == "runner: " + run_dir_in_sweep_problem(["-m", f"hydra.run.dir={target}"]), line
    assert f"hydra.run.dir={str(target)!r} is not used by a sweep (-m/--multirun)" in line
    assert line.endswith(f"fix: hydra.sweep.dir={target}") and "Traceback" not in out
    assert not target.exists() and not (tmp_path / "outputs").exists()
    # the forms and command lines it leaves alone / catches
    assert run_dir_in_sweep_problem([f"hydra.run.dir={target}", "seed=1,2"]) is None  # a single run
    assert run_dir_in_sweep_problem(["--multirun", "seed=1,2", f"hydra.sweep.dir={target}"]) is None
    assert run_dir_in_sweep_problem(["--multirun", f"++hydra.run.dir={target}"]).startswith("++hydra.run.dir=")
    assert run_dir_in_sweep_problem(["-m", "hydra.run.dir.x=1"]) is None


def test_a_backend_typo_in_a_sweep_is_refused_before_any_job_runs(tmp_path, subprocess_env):
    """New-user report: ``-m backend.attention=TORCH_SDPA,cudnnx`` ran job 0 (a whole generation), then job 1 was
    refused at its startup. Now exit 2 before any job with the registry's message (key, value, closest match) and
    the sweep named; nothing written. (Typed values and group options of a sweep were already checked up front.)"""
    from runner.kernels.registry import UnknownBackendError, normalize
    from runner.tools.sweep import sweep_backend_problem

    sweep = tmp_path / "sw"
    p = _runner(["-m", "model=tiny_flux", "dataset.limit=1", "backend.attention=TORCH_SDPA,cudnnx",
                 f"hydra.sweep.dir={sweep}"], tmp_path, subprocess_env)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    line = next(x for x in out.splitlines() if x.startswith("runner: "))
    with pytest.raises(UnknownBackendError) as e:
        normalize("attention", "cudnnx", where="backend.attention")
    assert line == (f"runner: {e.value} (in the sweep backend.attention=TORCH_SDPA,cudnnx: its job would be refused "
                    "when it started, after the jobs ahead of it ran; nothing ran)"), line
    assert "closest match: CUDNN_ATTN" in line and not sweep.exists() and "Traceback" not in out
    # a stage's backend and the second swept key too; only real typos, only sweeps
    assert sweep_backend_problem(["-m", "seed=1,2", "model.stages.expand.backend.attention=sdpa,flashx"]).startswith(
        "model.stages.expand.backend.attention='flashx' is not a known backend")
    assert sweep_backend_problem(["-m", "backend.attention=sdpa,cudnn", "backend.linear=auto,fp8x"]).startswith(
        "backend.linear='fp8x'")
    for fine in (["-m", "backend.attention=sdpa,cudnn,auto"], ["backend.attention=TORCH_SDPA,cudnnx"],
                 ["-m", "seed=1,2"], ["-m", "model.backend.x=1,2"]):
        assert sweep_backend_problem(fine) is None, fine


def test_tested_diffusers_range_is_pyprojects_pin():
    import tomllib

    from packaging.requirements import Requirement

    from runner.core.requirements import TESTED

    repo = Path(__file__).resolve().parent.parent
    deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {r.name: str(r.specifier) for r in map(Requirement, deps)}
    from packaging.specifiers import SpecifierSet

    for dist, spec in TESTED.items():
        assert SpecifierSet(pins[dist]) == SpecifierSet(spec), (dist, pins[dist], spec)


def test_refusals_name_the_projects_extras_as_pyproject_defines_them():
    """Every missing-extra refusal's fix is ``install_fix``: ``pip install -e ".[<extra>]"`` with the extra's
    requirements, which must be pyproject's (a changed pin shows up here); the launchers' refusal reads so."""
    import tomllib

    from packaging.requirements import Requirement

    import pytest

    from runner.core.errors import EXTRAS, install_fix
    from runner.core.requirements import DependencyVersionError, check_feature

    repo = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, reqs in EXTRAS.items():
        ours = {Requirement(r).name: Requirement(r) for r in reqs.split(", ")}
        theirs = {Requirement(r).name: Requirement(r) for r in extras[extra]}
        assert all(str(ours[n]) == str(theirs[n]) for n in ours), (extra, reqs, extras[extra])
    assert install_fix("lora") == 'pip install -e ".[lora]"  (peft>=0.21,<0.22)'
    with pytest.raises(DependencyVersionError) as e:
        check_feature("ray", "launcher=ray", {"ray": None})
    assert str(e.value) == ('launcher=ray: ray is not installed; the runner needs ray>=2.40; fix: pip install -e '
                            '".[scale]"  (ray[data]>=2.40, submitit>=1.5)')


def test_version_problems_name_the_package_version_range_and_fix():
    import pytest

    from runner.core.requirements import DependencyVersionError, check_versions, version_problems

    assert version_problems({"diffusers": "0.42.1"}) == []
    assert version_problems({"diffusers": "0.35.0"}) == [
        "diffusers==0.35.0 is outside the tested range diffusers>=0.37,<0.43; fix: pip install 'diffusers>=0.37,<0.43'"]
    assert "0.43.0 is outside" in version_problems({"diffusers": "0.43.0"})[0]
    assert version_problems({"diffusers": None})[0].startswith("diffusers is not installed")
    with pytest.raises(DependencyVersionError) as e:
        check_versions({"diffusers": "0.36.0"})
    assert e.value.exit_code == 2


def test_an_untested_diffusers_is_refused_at_startup(tmp_path, subprocess_env):
    """A diffusers 0.35 found first on the path (its metadata: what the check reads) ends ``python -m runner`` with
    exit 2 and the fix, before Hydra starts or anything is written."""
    import os

    fake = tmp_path / "site"
    info = fake / "diffusers-0.35.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: diffusers\nVersion: 0.35.0\n")
    env = dict(subprocess_env, PYTHONPATH=subprocess_env["PYTHONPATH"] + os.pathsep + str(fake))
    p = _runner([f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env)
    assert p.returncode == 2, p.stderr
    assert "diffusers==0.35.0 is outside the tested range diffusers>=0.37,<0.43" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists()
