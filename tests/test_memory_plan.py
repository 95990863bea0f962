"""Plan mode (issue #38): ``python -m runner <overrides> --plan`` prints the memory plan the composed run would get,
on any machine, with nothing loaded and no run dir; the plan is what a run records as its manifest's
``memory_plan`` (one function computes both: ``models.memory.FittingPass.plan``). ``memory.offload=auto`` off a GPU is
``none``, recorded so. The GPU side (a CUDA run's record against ``--plan`` on the same machine) is in
tests/test_memory_cuda.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from _helpers import cli, execute, library_noise
from runner.core import memory as planner

FLUX_DEV = ["model=flux", "model.load_format=dummy", "batch_size=16", "memory.vae_slicing=true",
            "memory.offload=auto"]


def _plan_cli(args, tmp_path, subprocess_env):
    p = cli([*args, "--plan"], subprocess_env, tmp_path)
    assert not library_noise(p.stdout + p.stderr), library_noise(p.stdout + p.stderr)
    assert not (tmp_path / "outputs").exists(), "plan mode made a run dir"
    return p


def test_plan_mode_prints_what_a_cpu_run_records(tmp_path, subprocess_env):
    """A real CPU run with ``memory.offload=auto`` records a plan (``none``, and why); ``--plan --json`` with the same
    overrides prints the same section, ``applied`` (filled at placement) aside."""
    overrides = ["model=toy_shapes", "dataset.limit=2", "batch_size=2", "memory.offload=auto"]
    r = execute(tmp_path / "run", overrides)
    assert r.code == 0, r.error
    recorded = json.loads((tmp_path / "run" / "manifest.json").read_text())["memory_plan"]
    p = _plan_cli(["platform=cpu", *overrides, "--json"], tmp_path, subprocess_env)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    printed = doc["stages"]["denoise"]
    assert printed["applied"] == {} and recorded["applied"]["offload"] == "none"
    assert printed == {k: v for k, v in recorded.items() if k != "applied"} | {"applied": {}}
    assert recorded["offload"] == "none" and recorded["planned"]["offload"] == "none"
    assert "auto on platform cpu" in recorded["why"] and recorded["budget_gb"] is None
    assert [c["offload"] for c in recorded["candidates"]] == list(planner.OFFLOAD_MODES)
    assert doc["platform"] == "cpu" and doc["dtype"] == "float32" and doc["batch"]["batch_size"] == 2
    # another batch is another plan: the comparison can fail
    other = ["platform=cpu", "model=toy_shapes", "dataset.limit=2", "batch_size=1", "memory.offload=auto"]
    assert _plans(other)["stages"]["denoise"]["planned"] != printed["planned"]


def _plans(overrides, device_gb=None):
    from _helpers import compose
    from runner.tools.plan import plans

    return plans(compose(overrides), overrides, device_gb)


@pytest.fixture(scope="module")
def flux_plans():
    """FLUX.1-dev (conf/model/flux.yaml, random weights: only its architecture is read) at 1024^2 under 24 / 12 / 8
    GiB at batch 16, and 8 GiB at batch 8, planned for a CUDA GPU from this CPU machine."""
    return {name: _plans([*FLUX_DEV, *extra])
            for name, extra in {"24": ["memory.max_gpu_gb=24"], "12": ["memory.max_gpu_gb=12"],
                                "8": ["memory.max_gpu_gb=8"], "8@8": ["memory.max_gpu_gb=8", "batch_size=8"]}.items()}


def _fits(sec, budget_gb):
    """The chosen plan fits the budget and every faster candidate does not (auto's rule)."""
    cands = sec["candidates"]
    chosen = [c["offload"] for c in cands].index(sec["planned"]["offload"])
    assert cands[chosen]["peak_gb"] <= budget_gb, sec
    assert all(c["peak_gb"] > budget_gb for c in cands[:chosen]), sec


def test_flux_dev_plans_under_24_12_and_8_gib(flux_plans):
    for name in ("24", "12", "8@8"):
        doc = flux_plans[name]
        assert doc["platform"] == "cuda" and doc["dtype"] == "bfloat16", doc
        sec = doc["stages"]["denoise"]
        budget = float(name.split("@")[0])
        assert sec["budget_gb"] == budget and sec["max_gpu_gb"] == budget
        _fits(sec, budget)
        assert sec["why"].startswith(f"auto: {sec['offload']} is the fastest plan that fits {budget} GiB")
    assert flux_plans["24"]["batch"]["batch_size"] == 16 and flux_plans["8@8"]["batch"]["batch_size"] == 8
    assert flux_plans["24"]["batch"]["width"] == 1024
    # batch 16 does not fit 8 GiB under any plan (the denoiser's activations alone are ~8 GiB): refused, naming
    # batch_size among the fixes; at batch 8 the same plan modes are cheaper
    refused = flux_plans["8"]["stages"]["denoise"]
    assert "no plan fits memory.max_gpu_gb=8.0" in refused["refused"] and "lower batch_size" in refused["refused"]
    assert all(c["peak_gb"] > 8 for c in refused["candidates"])
    half = {c["offload"]: c["peak_gb"] for c in flux_plans["8@8"]["stages"]["denoise"]["candidates"]}
    assert all(half[c["offload"]] < c["peak_gb"] for c in refused["candidates"])
    # the streamed estimates do not depend on the budget; group_block keeps what each budget leaves resident
    # (runner.core.memory.keep_resident): without those blocks' bytes, 24 and 12 plan the same candidates
    c24, c12 = (flux_plans[n]["stages"]["denoise"]["candidates"] for n in ("24", "12"))
    assert [_streamed(c) for c in c24] == [_streamed(c) for c in c12]
    g24, g12 = (next(c for c in cs if c["offload"] == "group_block") for cs in (c24, c12))
    assert g24["resident_blocks"] > g12["resident_blocks"] >= 1 and g24["moved_per_call_gb"] < g12["moved_per_call_gb"]
    margin = planner.resident_margin(24 * planner.GIB) / planner.GIB
    assert g24["peak_gb"] <= 24 - margin < g24["peak_gb"] + 0.7  # filled to within one block (0.63 GiB) of it


def _streamed(c):
    """A candidate without the resident blocks' bytes (GiB, rounded to the planner's 3 decimals)."""
    r = c["resident_gb"]
    return {**c, "peak_gb": round(c["peak_gb"] - r, 2), "stages_gb": {k: round(v - r, 2) for k, v in
                                                                       c["stages_gb"].items()},
            "moved_per_call_gb": round(c["moved_per_call_gb"] + r * 28, 1), "resident_blocks": 0, "resident_gb": 0}


def test_flux_dev_plan_is_the_planners_estimate_from_the_published_configs(flux_plans):
    """The plan mode's figures (the engine: flux.yaml's architecture, the builtin rows, bf16) equal the planner's
    own computation from FLUX.1-dev's published component configs at 1024^2, batch 16, 512 T5 tokens, 28 steps."""
    from _helpers import flux_dev_reference, flux_dev_stages
    from models import memory

    modules, confs = flux_dev_reference()
    sizes, stages = memory.component_sizes(modules, {}), flux_dev_stages(confs, batch=16, slicing=True)
    want = [p.to_dict() for p in planner.plans(sizes, stages, "transformer", 28, budget=24 * planner.GIB)]
    assert flux_plans["24"]["stages"]["denoise"]["candidates"] == want


def test_the_printed_plan_marks_the_choice_and_a_refusal_exits_2(flux_plans, tmp_path, subprocess_env):
    from runner.tools.plan import render

    lines = render(flux_plans["24"]).splitlines()
    chosen = [x for x in lines if x.lstrip().startswith("->")]
    assert len(chosen) == 1 and chosen[0].split()[0] == "->group_block", lines
    peak = flux_plans["24"]["stages"]["denoise"]["planned"]["peak_gb"]
    assert f"{peak:.3f}" in chosen[0].split()
    assert any(x.strip().startswith(f"plan: group_block (peak {peak} GiB; against memory.max_gpu_gb=24)")
               for x in lines), lines
    assert "largest batch 16 x 1024x1024" in lines[0]  # platform=auto: this machine's CUDA GPU, or planned as one
    assert re.search(r"platform(=auto planned as a CUDA GPU| cuda) \(bfloat16\)", lines[0]), lines[0]
    no = _plan_cli([*FLUX_DEV, "memory.max_gpu_gb=8"], tmp_path, subprocess_env)  # the command line, end to end
    assert no.returncode == 2, no.stdout + no.stderr
    assert "refused: memory.offload=auto: no plan fits memory.max_gpu_gb=8.0" in no.stdout
    assert "->" not in no.stdout and "Traceback" not in no.stdout + no.stderr


def test_capacity_comes_from_the_budget_or_device_gb(flux_plans):
    """Without a budget, ``auto`` needs the GPU's memory: refused naming ``--device-gb`` on a machine without the
    GPU; with ``--device-gb`` it plans against it (a 24 GiB card takes what a 24 GiB budget takes); a bad value is
    named."""
    from runner.core.errors import ConfigValueError
    from runner.tools.plan import parse

    with pytest.raises(ConfigValueError, match="--device-gb=<GiB>"):
        _plans(FLUX_DEV)
    doc = _plans(FLUX_DEV, device_gb=24)
    sec = doc["stages"]["denoise"]
    assert doc["device_total_gb"] == 24.0 and sec["budget_gb"] == 24.0 and sec["max_gpu_gb"] is None
    assert sec["planned"] == flux_plans["24"]["stages"]["denoise"]["planned"]
    assert parse(["model=flux", "--plan", "--device-gb", "80", "--json"]) == (["model=flux"], 80.0, True)
    for bad in (["--device-gb", "lots"], ["--device-gb=0"], ["--device-gb=inf"], ["--device-gb=nan"], ["-m"],
                ["--plot"]):
        with pytest.raises(ConfigValueError):
            parse(["--plan", *bad])


def test_the_device_bounds_every_plan_and_refusals_name_what_bound_them(flux_plans):
    """New-user report: an explicit plan over the device's memory was accepted (``memory.offload=none`` planned at
    34 GiB on a 20 GiB GPU: an OOM after loading), a budget above the device planned against the budget, and a
    refusal against ``--device-gb`` named ``memory.max_gpu_gb`` (which the user had not set) and its fix."""
    def denoise(extra, gib):
        return _plans([*FLUX_DEV, *extra], device_gb=gib)["stages"]["denoise"]

    none = denoise(["memory.offload=none"], 80)
    peak = none["planned"]["peak_gb"]
    assert none["bound"] == "the device's 80.0 GiB" and "its peak fits the device's 80.0 GiB" in none["why"]
    for gib in (peak - 0.01, 20.0):  # just under the estimate: refused (a check of >= peak + 1 GiB would pass it)
        refused = denoise(["memory.offload=none"], gib)["refused"]
        assert refused.startswith(f"memory.offload=none plans a peak of {peak} GiB"), refused
        assert f"over the device's {round(gib, 3)} GiB; fix: memory.offload=" in refused, refused
    assert denoise(["memory.offload=none"], peak + 0.01)["planned"]["offload"] == "none"
    # a budget above the device plans against the device, and says so; below it, against the budget
    capped = denoise(["memory.max_gpu_gb=100"], 24)
    assert capped["budget_gb"] == 24.0 and capped["max_gpu_gb"] == 100.0
    assert capped["bound"] == "the device's 24.0 GiB (memory.max_gpu_gb=100.0 is more than the device has)"
    assert capped["planned"] == flux_plans["24"]["stages"]["denoise"]["planned"]
    under = denoise(["memory.max_gpu_gb=12"], 80)
    assert under["bound"] == "memory.max_gpu_gb=12"
    assert under["planned"] == flux_plans["12"]["stages"]["denoise"]["planned"]
    # auto refused by the device: names the device, and no budget in its fix; by a budget: the budget
    dev = denoise([], 2)["refused"]
    assert "no plan fits the device's 2.0 GiB" in dev and "max_gpu_gb" not in dev and dev.endswith("a GPU with more memory")
    bud = denoise(["memory.max_gpu_gb=2"], 80)["refused"]
    assert "no plan fits memory.max_gpu_gb=2.0 " in bud and bud.endswith("or raise memory.max_gpu_gb")


@pytest.mark.parametrize("value", ["inf", "nan", "1e308", "-1", "0"])
def test_a_budget_that_is_no_finite_positive_number_is_refused_naming_the_fix(value):
    """New-user report: ``memory.max_gpu_gb=inf`` (or nan, 1e308) ended in an OverflowError traceback, exit 1, when
    the budget became bytes. Refused at the settings, exit 2, naming key, value and fix."""
    from runner.core.errors import ConfigValueError

    with pytest.raises(ConfigValueError, match=r"memory\.max_gpu_gb=.* must be a finite number of GiB .*; fix: "):
        _plans([*FLUX_DEV, f"memory.max_gpu_gb={value}"])


def test_a_cpu_run_refuses_a_budget_pointing_at_plan_mode(tmp_path):
    from runner.core.errors import RunnerError

    r = execute(tmp_path / "r", ["model=toy_shapes", "dataset.limit=1", "memory.max_gpu_gb=8"], catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2
    assert "memory.max_gpu_gb=8.0 budgets GPU memory" in str(r.error) and "--plan" in str(r.error)


def test_the_docs_page_shows_what_its_command_prints(flux_plans):
    """docs/memory_plan.md's example: its command is the FLUX.1-dev 24 GiB plan, and the table it shows is what
    that command prints (the first line, naming this machine's capacity, aside)."""
    from runner.tools.plan import parse, render

    page = (Path(__file__).resolve().parents[1] / "docs" / "memory_plan.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", page, re.S)
    command = blocks[0].replace("\\\n", " ").split()
    assert command[:3] == ["python", "-m", "runner"]
    overrides, device_gb, as_json = parse(command[3:])
    assert sorted(overrides) == sorted([*FLUX_DEV, "memory.max_gpu_gb=24"]) and device_gb is None and not as_json
    assert blocks[1].strip().splitlines()[1:] == render(flux_plans["24"]).splitlines()[1:]


def test_plan_help_says_what_it_prints_and_how_capacity_is_given(capsys):
    from runner.tools.plan import main

    assert main(["model=flux", "--plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("``python -m runner <overrides> --plan [--device-gb GiB] [--json]``")
    assert "--device-gb=<GiB>" in out and "memory.max_gpu_gb" in out


def test_platform_auto_says_it_is_planned_as_a_gpu_and_what_runs_here():
    """``platform=auto`` (the default) on this CPU machine is planned for a CUDA GPU: the first line says so and
    names what the same run here would use (cpu, float32); ``platform=cuda`` names no such thing; a configured
    ``memory.offload=none`` (the default) is not called explicit."""
    from runner.tools.plan import render

    auto = _plans(["dataset.limit=2"])
    assert auto["platform"] == "cuda" and auto["platform_here"] == {"platform": "cpu", "dtype": "float32"}
    head = render(auto).splitlines()[0]
    assert head.startswith("memory plan for platform=auto planned as a CUDA GPU (bfloat16); this machine has none, "
                           "and the same run here would use platform cpu (float32)"), head
    cuda = _plans(["dataset.limit=2", "platform=cuda"])
    assert cuda["platform_here"] is None and render(cuda).startswith("memory plan for platform cuda (bfloat16)")
    why = auto["stages"]["denoise"]["why"]
    assert why.startswith("memory.offload=none as configured") and "explicit" not in why


def test_a_refusals_fix_never_suggests_what_is_already_set(flux_plans):
    """FLUX.1-dev under 8 GiB at batch 16 with ``memory.vae_slicing=true`` (set): the fix names what lowers the peak
    that is not set yet (tiling, quantizing, the batch, the budget), not vae_slicing; the planner's rule on its own:
    every setting in effect is left out, none is when nothing is."""
    refused = flux_plans["8"]["stages"]["denoise"]["refused"]
    fix = refused.split("fix: ", 1)[1]
    assert "vae_slicing" not in fix and "memory.vae_tiling=true" in fix and "lower batch_size" in fix, refused
    cands = [planner.Plan(m, True, 1, stages={"denoise": 9 * planner.GIB}, peak=9 * planner.GIB)
             for m in planner.OFFLOAD_MODES]
    with pytest.raises(planner.MemoryBudgetError) as e:
        planner.choose("auto", cands, planner.GIB)
    assert ("fix: quantize the largest component (model.quantization.transformer=nf4 or int8wo), lower batch_size, "
            "set memory.vae_slicing=true / memory.vae_tiling=true, or raise memory.max_gpu_gb") in str(e.value)
    with pytest.raises(planner.MemoryBudgetError) as e:
        planner.choose("auto", cands, planner.GIB, already=["memory.vae_slicing=true", "memory.vae_tiling=true",
                                                            "model.quantization.transformer=nf4"])
    assert str(e.value).endswith("fix: lower batch_size, or raise memory.max_gpu_gb"), str(e.value)


@pytest.mark.parametrize("overrides,error_type,text", [
    (["model=flux", "platform=cuda", "model.load_format=dummy", "memory.max_gpu_gb=-3"], "ConfigValueError",
     "memory.max_gpu_gb=-3.0 must be"),
    (["model=flux", "platform=cuda"], "ModelPathError", "model=flux needs weights"),
    (["model=no_such_model"], None, "model=no_such_model: no such model"),  # refused before composing
])
def test_plan_json_refusals_are_json_on_stdout(overrides, error_type, text, tmp_path, subprocess_env):
    """Field case: ``--plan --json`` refused before planning printed nothing on stdout (the refusal on stderr only),
    so a JSON reader failed on an empty document."""
    p = _plan_cli([*overrides, "--json"], tmp_path, subprocess_env)
    assert p.returncode == 2, p.stdout + p.stderr
    doc = json.loads(p.stdout)["refused"]
    assert doc["error_type"] == error_type and text in doc["message"] and doc["exit_code"] == 2, doc
    line = f"runner: {error_type + ': ' if error_type else ''}{text}"
    assert line in p.stderr
    q = _plan_cli(overrides, tmp_path, subprocess_env)  # without --json: the line on stderr, stdout empty
    assert q.returncode == 2 and q.stdout.strip() == "" and line in q.stderr


def test_a_plan_flag_without_plan_is_named_not_hydras_usage_dump(subprocess_env, tmp_path):
    """New-user report: ``python -m runner model=flux --device-gb=80`` (``--plan`` forgotten) printed Hydra's argument
    usage and 'unrecognized arguments'. One line naming the flag and the fix, exit 2, nothing run."""
    from _helpers import cli
    from runner.tools.plan import stray_plan_flag

    assert stray_plan_flag(["model=flux", "--plan", "--json"]) is None and stray_plan_flag(["model=flux"]) is None
    p = cli(["model=flux", "--device-gb=80"], subprocess_env, tmp_path)
    assert p.returncode == 2 and "usage:" not in p.stderr, p.stderr
    assert p.stderr.strip() == ("runner: --device-gb is a flag of --plan (the memory plan, nothing run); fix: add "
                                "--plan, or drop --device-gb=80")
    assert not (tmp_path / "outputs").exists()
