"""Mutation testing of the core rules (issues #23, #29): mutmut over the functions that implement them, scored.

    python benchmarks/mutation.py                      # every group, one after the other, writes the JSON below
    python benchmarks/mutation.py --groups gate sinks  # some groups (the others' results are kept from --work)
    python benchmarks/mutation.py --rerun-survivors    # re-test only the last run's survivors (after new tests)
    python benchmarks/mutation.py --whole-core --resume --groups G   # go on where a stopped run of G was

Not part of CI (each group is meant to stay within 20 minutes on 2 shared cores: its tests are the fast ones that
call the code directly; ``group_wall_s`` in the result says what each took; mutmut forks per mutant and needs
Linux or macOS). Needs the ``mutation`` extra (``pip install -e .[mutation]``: mutmut 3).

What it does:

1. copies the checkout (tracked and untracked, not ignored, files) into ``build/mutation/<group>/`` (``--work``),
   so the working tree is never touched, and appends a ``[tool.mutmut]`` table (:func:`mutmut_table`) to that
   copy's ``pyproject.toml``;
2. runs ``mutmut run`` there (under ``nice``), one group of :data:`GROUPS` after the other, each in its own copy
   (``build/mutation/<group>``) on the mutants of the group's functions only. mutmut first runs the group's test
   files once with every function instrumented, recording which tests call which function; each mutant is then
   run against exactly the tests of its group that called its function (forked from a process that has imported
   everything, so no interpreter start-up per mutant);
   Tests that start Python subprocesses (gloo workers, lock holders) run the mutant there too, and the functions
   such a subprocess called count as called by its test (:data:`SITECUSTOMIZE`, :data:`HITS_PLUGIN`);
3. writes ``benchmarks/results/mutation.json``: the scope (files and functions, ``"*"`` expanded), the git commit,
   the command, the time taken per group, ``killed`` (count),
   ``survived`` (each with ``file:line``, function and the mutated line), ``equivalent`` (survivors that cannot
   change behaviour, each matched by :data:`EQUIVALENT` with a one-line reason) and
   ``score = killed / (killed + survived)``. A mutant that no selected test reaches (mutmut: ``no tests``) counts
   as survived; a timeout counts as killed (the mutant never finishes where the original does).

Mutants live in ``build/mutation/<group>/mutants``; ``cd build/mutation/<group> && mutmut show <name>`` prints
one of them.

The whole core (issue #42; prepared, not yet run):

    python benchmarks/mutation.py --list-whole-core    # the groups: files, lines, functions, est. mutants, tests
    python benchmarks/mutation.py --whole-core         # every group of benchmarks/mutation_core.json, in its order
    python benchmarks/mutation.py --whole-core --groups core_m_memory   # one group (results of others kept)

Scope: every module of runner/ (app, core, kernels, tools) and models/ (engines, families, features, vllm, the
toys' data and oracles) but the toys' training scripts and the GPU-only functions named in
``benchmarks/mutation_core.json`` (:data:`WHOLE_CORE`, :data:`GPU_ONLY`): 100 files in 63 groups, ~53,000 mutants
by :func:`estimate_mutants` (an estimate from the AST, fitted on the last result; mutmut's count will differ).

How a session runs it:

1. one scoped commit: the code of runner/, models/ and kernels/ (:data:`SCOPED_DIRS`) as the last commit that
   changed it left it (``--whole-core`` refuses uncommitted changes there; commits of tests/, docs/, benchmarks/
   after it keep the scored code as it was); change no scoped file while groups run. Each group's result is
   written as it finishes to ``benchmarks/results/mutation_core/<group>.json`` (commit those: a session's
   ``build/`` does not outlive it), and ``mutation.json`` is rebuilt from those files, so a whole-core run spans
   sessions: ``--skip-done`` skips the groups already scored on their files as HEAD has them (a group's result
   holds while its own files are unchanged: :func:`write_whole_core`). Run it as one command
   in the background with its log, e.g.
   ``nohup python benchmarks/mutation.py --whole-core --skip-done > build/mutation-core.log 2>&1 &``;
   ``--whole-core --report-only`` rebuilds ``mutation.json`` (and its ``changed_since``) from the committed files;
   a survivor killed by a new test is re-tested with ``--rerun-survivors`` (same session: it needs ``build/``);
2. order (the file's order): the 35 groups whose tests call the code directly (runner/core, kernels, app, tools,
   then models/; ~50,000 mutants, ~5.6 h at 0.25 s a mutant), the subprocess group (``core_core_rundir_*``,
   ~1.5 s a mutant) and the pipeline groups (``core_m_cache_*``, ~5 s a mutant, ~2 h) within them, then the 28
   groups that only end-to-end tests reach (``e2e`` in the file: ``__main__``, manifest, pool, signals,
   backend_passes, diffusion_rows, flux2, prompt_tokens, snapshot, source, zimage; ~2,800 mutants, ~4.7 h at 6 s);
3. expected wall time: ~10.3 h in all at the per-group rates of :data:`RATE` (measured per group on the last
   result: 2,859 s of group wall time for 5,983 mutants, 0.48 s a mutant on average); at the last result's
   ``wall_s_full_run`` per mutant (436.5 s / 5,885 = 0.074 s, a run of the first, direct groups only) it would be
   ~1.1 h, a lower bound. The budget of one session (20 minutes a group) holds a few groups: a whole-core run
   spans sessions only if they all stay at the same commit (record it in the closing note);
4. then: every survivor killed by a new test (``--rerun-survivors``) or written down in
   ``benchmarks/mutation_equivalent.json`` with its reason; ``--list-whole-core`` exits 1 when a file with
   functions of runner/ or models/ is in no group (a new module).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "mutation.json"
#: ``--whole-core``: one file per group run, committed (``<group>.json``), so a whole-core score spans sessions: a
#: session's sandbox keeps no ``build/``; the aggregate (:data:`RESULT`) is rebuilt from these files.
GROUP_RESULTS = ROOT / "benchmarks" / "results" / "mutation_core"
#: The directories whose code the whole-core score covers (a change elsewhere does not make it stale).
SCOPED_DIRS = ("runner", "models", "kernels")

#: A group's scope names a file's functions, or ``"*"``: every function and method of the file (top level and
#: one class deep, as mutmut mutates them).
ALL = "*"


#: Mutation groups: per group the functions (``Class.method`` for methods) whose mutants are run, by file, and the
#: test files (or test node ids) that may kill them (each mutant runs the tests of its group that call its function).
#: The functions are the ones that implement the rules named in issues #23 and #29; ``"*"`` takes every function
#: of the file. What a group leaves out is said beside it (GPU-only paths, code only whole pipeline runs reach at
#: ~10 s a mutant).
GROUPS: Dict[str, Dict[str, Any]] = {
    # precedence: which layer wins, per stage and field; the legacy extras and the overlay's extras
    "precedence": {
        "scope": {"runner/core/resolve.py": ["cli_keys", "_set_by", "_layers", "resolve_stage", "_resolve_stage",
                                        "_normalize_attention", "_canonical", "_any_not_auto"]},
        # test_precedence.py (the layer pairs through Hydra-composed YAML, ~0.3 s a case) would take hours here;
        # test_precedence_layers.py holds the same pairs on config objects, and the conflicts, specs and messages
        "tests": ["tests/test_precedence_layers.py"]},
    # backend registry: every requirement, the platform class, auto order and selection, names, checks
    "registry": {
        "scope": {"runner/kernels/registry.py": [
            "has_symbol", "on_platform", "sm_at_least", "sm_in", "symbol", "dtype_in", "head_dim_in",
            "head_dim_at_most", "head_dim_multiple_of", "no_mask", "no_sequence_parallel", "Backend.unmet",
            "context_parallel_unmet", "_flash_check", "normalize", "check", "platform_class", "auto_order",
            "auto_select", "validate_spec"]},
        "tests": ["tests/test_backends.py", "tests/test_registry_requirements.py"]},
    # evidence: the verdict and each of its mismatch branches, the forward counter
    "evidence": {
        "scope": {"models/denoiser_evidence.py": ["KernelTrace.match", "KernelTrace.calls", "DenoiserProbe._pre",
                                         "DenoiserProbe._post", "build", "_moe_calls", "_moe_kernels"]},
        "tests": ["tests/test_evidence_verdict.py"]},
    # resume: the semantic keys, the identity and which finished items are reused
    "resume": {
        "scope": {"runner/core/resume.py": ["_get", "_flat", "cache_config", "semantic_diff", "previous_run",
                                       "remove_temp_files", "finished", "item_inputs", "run_identity",
                                       "inputs_sha256", "expected_inputs", "identity_diff", "reusable",
                                       "why_not_reused", "regenerate_batches"]},
        "tests": ["tests/test_resume_rules.py"]},
    # dataset validation: coercion, every row check, seeds, item keys, batching
    "dataset": {
        "scope": {"runner/core/dataset.py": ["safe_stem", "derive_seed", "coerce", "source_path", "load_rows",
                                        "expand_items", "batches", "parse_fields", "field_problem",
                                        "validate_rows", "check_size", "check_at_least_one", "check_seed",
                                        "check_guidance", "check_video_count", "check_prompt", "check_max_pixels",
                                        "build_diffusion_row", "csv_extra_cells"]},
        "tests": ["tests/test_dataset_validation.py", "tests/test_row_specs.py"]},
    # artifact writing: atomic replace, the journal, the writer's ordering and error handling, journal reading
    "artifacts": {
        "scope": {"runner/core/artifacts.py": ["storage_error", "atomic_write_bytes", "atomic_write_json",
                                          "Journal.__init__", "Journal.append", "ArtifactWriter.write_png",
                                          "ArtifactWriter.submit", "ArtifactWriter.drain", "ArtifactWriter.close"],
                  "runner/core/sinks.py": ["read_journal", "compact_journal", "write_folder_metadata", "artifact_intact"]},
        "tests": ["tests/test_atomic_writes.py"]},
    # data-parallel sharding and merge
    "distributed": {
        "scope": {"runner/core/distributed.py": ["shard", "_ended", "merge", "merged_exit_code", "torchrun_exit_line",
                                                "Layout.role", "Layout.section"]},
        "tests": ["tests/test_merge.py", "tests/test_ring_ulysses.py::test_layout_roles_of_a_ring_times_ulysses_mesh",
                  "tests/test_context_parallel.py::test_layout_roles_and_mesh"]},
    # repro verdicts
    "repro": {
        "scope": {"runner/tools/repro.py": ["_sha", "_tokens_sha", "_compare_tokens", "_items", "rerun_command",
                                      "_backend_diffs", "compare"]},
        "tests": ["tests/test_repro_verdicts.py"]},
    # the FP8 linear path (runs on CPU)
    "fp8_linear": {
        "scope": {"runner/kernels/linear.py": ["LinearRecord.add", "_quantize_rows", "FP8Linear.__init__",
                                        "FP8Linear.forward", "_eligible", "install"]},
        "tests": ["tests/test_fp8_linear.py"]},
    # ---- issue #29: the core added since the last audit (the run-dir lock, resume plan, sinks, gate, cache,
    # context parallel, evidence, distributed, the Run's steps)
    # the run-dir lock: holder records, takeover of a dead owner's lock, workers joining and leaving
    "rundir": {
        "scope": {"runner/core/rundir.py": ALL},
        # test_rundir.py's tests that start whole ``python -m runner`` runs (20-40 s each here) are left out
        "tests": ["tests/test_rundir_workers.py"] + [f"tests/test_rundir.py::{t}" for t in (
            "test_readers_report_a_running_manifest_with_a_dead_owner_as_crashed",
            "test_repro_refuses_a_live_run_and_notes_a_crashed_one", "test_merge_reports_a_worker_left_running_as_crashed",
            "test_resume_of_a_run_left_running_records_crashed")] + ["tests/test_mutation_kills_rundir.py"]},
    # the resume plan (ResumePlan: refusals, reuse, the compile mode, the identity's values)
    "resume_plan": {
        "scope": {"runner/core/resume.py": ["compile_mode_of", "_when_set_keys", "_canonical", "_source_fingerprint",
                                       "_identity_value", "identity_sha256", "plan", "log_not_reused"]},
        "tests": ["tests/test_mutation_kills_resume.py", "tests/test_resume_rules.py",
                  "tests/test_resume_compile_mode.py"]},
    # the Run's steps on one-step runs: the plan, the verdict, finalize, the exit code, evidence, compaction
    "run": {
        # (each mutant runs one-step pipelines, ~10 s a run here: the verdict and the exit code only; plan_resume,
        # finalize, close_outputs, timing_section, evidence_doc and compact are ~1100 more mutants; the resume
        # decision itself is group resume_plan)
        "scope": {"runner/app/run.py": ["Run.verdict", "Run.exit_code"]},
        "tests": ["tests/test_mutation_kills_run.py"]},
    # fixed cache schedules: which steps each method reuses, the counts and the evidence of planned reuse
    "cache": {
        # the fixed schedules (PAB, TaylorSeer) and the planned-reuse evidence; each mutant runs toy_shapes pipelines
        "scope": {"models/cache.py": ["CacheCounts.minus", "StepCache.evidence", "_taylorseer", "_taylorseer_reused",
                                     "_pab", "_pab_reused"]},
        "tests": ["tests/test_mutation_kills_cache.py", "tests/test_cache_schedule.py"]},
    # context parallelism: the refusals before loading, the collectives the evidence expects. setup and enable run
    # only in other processes (torchrun ranks, gloo workers: tests/test_ring_ulysses.py and
    # test_mutation_kills_context_parallel.py's gloo test, ~2 min a run on 2 shared cores), too slow per mutant here
    "context_parallel": {
        "scope": {"models/context_parallel.py": ["check_model", "expected_collectives"]},
        "tests": ["tests/test_ring_ulysses.py::test_expected_collectives_of_each_layout"] + [
            f"tests/test_mutation_kills_context_parallel.py::{t}" for t in (
                "test_a_denoiser_class_without_a_plan_is_refused_naming_it",
                "test_heads_not_a_multiple_of_the_ulysses_degree_are_refused_with_the_degrees_that_fit",
                "test_what_diffusers_can_split_passes")] + [
            f"tests/test_context_parallel.py::{t}" for t in (
                "test_heads_not_divisible_by_ulysses_degree",
                "test_backend_without_context_parallel_support_is_refused_by_name")]},
    # the sinks: artifact dims against the record, PNG and video verify and rename, journals, unlisted files
    "sinks": {
        "scope": {"runner/core/sinks.py": ["embedded_fields", "folder_metadata_row", "check_artifact_dims",
                                          "_Counting._recorded", "_FileSink.submit", "_FileSink.verify",
                                          "_FileSink.close", "ImageSink._write", "MP4Sink.identity",
                                          "MP4Sink._payload", "MP4Sink._write", "RecordSink.submit",
                                          "RecordSink.verify", "ComputeOnlySink.submit", "keep_unlisted",
                                          "ImageSink.options", "ImageSink.identity", "ImageSink._payload"]},
        "tests": ["tests/test_mutation_kills_sinks.py", "tests/test_atomic_writes.py",
                  "tests/test_video.py::test_sink_frame_rate_and_shape_rules",
                  "tests/test_outputs.py::test_png_whose_size_differs_from_its_record_fails_and_is_not_written"]},
    # the quality gate: same rows, pairing among several lossless jobs, ratios, PSNR, verdicts, the CLI
    "gate": {
        "scope": {"runner/tools/gate.py": ALL},
        "tests": ["tests/test_mutation_kills_gate.py"]},
    # the stage loop: upstream text feeding the next stage, a failed batch retried item by item, run_stage's records
    "stages": {
        "scope": {"runner/app/stages.py": ["link_records", "feed", "generate_isolated", "run_stage"]},
        "tests": ["tests/test_mutation_kills_stages.py", "tests/test_batch_retry.py",
                  "tests/test_mutation_kills_run.py"]},
    # the startup checks: schema, run values, dtype, fresh dir, cpu threads, cache applicability
    "checks": {
        "scope": {"runner/app/checks.py": ALL},
        "tests": ["tests/test_schema.py", "tests/test_validate.py"]},
    # denoiser evidence: the whole module (call counts, kernels, collectives, MoE, the forward count)
    "evidence_all": {
        "scope": {"models/denoiser_evidence.py": ["DenoiserProbe.__init__", "_attention_calls", "_linear_calls",
                                                  "_kernel_calls", "_collective_calls", "forward_count_check"]},
        "tests": ["tests/test_mutation_kills_evidence.py", "tests/test_evidence_verdict.py"]},
}

#: Survivors that cannot change what a user sees (benchmarks/mutation_equivalent.json), matched on the file,
#: function, original line and mutated line of the mutation (stripped), each with its one-line reason. An entry
#: with ``"survives": true`` is no equivalent: it stays a survivor, with the reason no test kills it here.
#: The whole core (issue #42), in ``benchmarks/mutation_core.json``: every module of runner/ (app, core, kernels,
#: tools) and models/ but the toys' training scripts (``models/toy_*/train*.py``: offline training, no runner code
#: path imports them), in groups of one module or a cluster of small modules of one package, each estimated to take
#: at most about 20 minutes on 2 shared cores (:func:`estimate_mutants`, ``--list-whole-core``). A file's scope is
#: ``"*"``, or ``{"all_but": [...]}`` leaving out the functions of ``gpu_only`` (each runs only on a CUDA device:
#: allocator statistics and caps, the device probe, Triton launches, the CUDA profiler's stop; on a CPU no test can
#: reach them, so each of their mutants would count as survived), or a list of functions where a module needs
#: several groups. Per group ``tests`` are the test files (or node ids) that import the module and call it
#: directly, found statically (ast: ``import runner.x``, ``from runner.x import``, ``from models import y``), with
#: a file's end-to-end tests (``execute``, ``run_job``, ``cli``, ``python -m runner``) left out, plus the tests the
#: groups above give the same file; ``e2e`` names the end-to-end test files used where no direct test exists (at
#: most two, chosen by hand; ~6 s a mutant). Regenerate the lists when tests move; ``--list-whole-core`` shows them.
CORE = ROOT / "benchmarks" / "mutation_core.json"
_core = json.loads(CORE.read_text())
WHOLE_CORE: Dict[str, Dict[str, Any]] = _core["groups"]
GPU_ONLY: Dict[str, List[str]] = _core["gpu_only"]

#: Seconds per mutant on 2 shared cores, from the last recorded run's per-group wall times and mutant counts
#: (``group_wall_s`` / killed+survived+equivalent at 81e1164): groups whose tests call the code directly took
#: 0.11-0.34 s a mutant (0.25 taken), tests that start subprocesses ~1.5 s (rundir, context_parallel), tests that
#: run toy pipelines ~5 s (cache); an end-to-end group is taken at 6 s.
RATE = {"direct": 0.25, "e2e": 6.0, "runner/core/rundir.py": 1.5, "models/context_parallel.py": 1.57,
        "models/cache.py": 5.07}

#: Rough weights of :func:`estimate_mutants` per AST node (mutmut 3 mutates each call argument twice: ``None`` and
#: removed; a string to ``"XX..XX"`` and its case; numbers +1; operators, comparisons, ``and``/``or``, ``not``,
#: augmented and plain assignments, booleans, ``break``/``continue``, lambdas, f-strings), scaled by
#: :data:`MUTANT_SCALE`, fitted on the 175 functions of the last result (5,936 mutants; the estimate's correlation
#: per function 0.96, per file within about +-25%). An estimate: mutmut itself says the count.
MUTANT_WEIGHTS = {"args": 2, "assign": 1, "aug": 2, "binop": 1.5, "bool": 1, "bool_op": 1, "brk": 1, "cmp": 1.5,
                  "fstr": 1, "lambda": 1, "num": 1, "str": 2, "unary": 1}
MUTANT_SCALE = 0.82

NICE = 19  # a shared developer machine: the mutants run at the lowest priority

EQUIVALENT: List[Dict[str, str]] = json.loads((ROOT / "benchmarks" / "mutation_equivalent.json").read_text())


def _toml_list(xs: List[str]) -> str:
    return json.dumps(xs)


def mutmut_table(group: Dict[str, Any]) -> str:
    return "\n".join([
        "", "[tool.mutmut]",
        f"source_paths = {_toml_list(['runner/', 'models/'])}",
        f"only_mutate = {_toml_list(sorted(group['scope']))}",
        f"also_copy = {_toml_list(['conf/', 'sitecustomize.py', 'mutmut_subprocess_hits.py'])}",
        f"pytest_add_cli_args = {_toml_list(['-o', 'addopts=-ra', '-p', 'no:cacheprovider', '-p', 'mutmut_subprocess_hits', '-W', 'ignore'])}",
        f"pytest_add_cli_args_test_selection = {_toml_list(group['tests'])}",
        "use_git_change_detection = false",
        "",
    ])


def mangled(path: str, func: str) -> str:
    mod = path[:-3].replace("/", ".")
    if "." in func:
        cls, meth = func.split(".")
        return f"{mod}.x\u01c1{cls}\u01c1{meth}"
    return f"{mod}.x_{func}"


def functions(path: str, names: Any) -> List[str]:
    """The functions of ``path`` a scope entry names (``"*"``: all, in file order; ``{"all_but": [...]}``: all but
    those, the GPU-only ones of :data:`GPU_ONLY`); an unknown name is an error, so a renamed function cannot
    silently drop out of the scope."""
    starts = _function_starts(ROOT / path)
    if names == ALL:
        return list(starts)
    if isinstance(names, dict):
        missing = [f for f in names["all_but"] if f not in starts]
        if missing:
            raise SystemExit(f"mutation: {path} has no function(s) {', '.join(missing)}; fix {CORE.name}")
        return [f for f in starts if f not in names["all_but"]]
    missing = [f for f in names if f not in starts]
    if missing:
        raise SystemExit(f"mutation: {path} has no function(s) {', '.join(missing)}; fix GROUPS")
    return list(names)


def expanded(group: Dict[str, Any]) -> Dict[str, List[str]]:
    """``{file: [function, ...]}`` of a group, ``"*"`` expanded."""
    return {p: functions(p, fs) for p, fs in group["scope"].items()}


def scope_globs(group: Dict[str, Any]) -> List[str]:
    return [f"{mangled(p, f)}__mutmut_*" for p, fs in expanded(group).items() for f in fs]


def git_commit() -> Dict[str, Any]:
    """The commit the run tested, and whether the tree differed from it (tracked files)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = [ln for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()
               if not ln.endswith(str(RESULT.relative_to(ROOT)))]  # the result file itself aside
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed)}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def scoped_state() -> Dict[str, Any]:
    """The code a whole-core group tests: ``scoped_commit`` (the last commit that changed a file of
    :data:`SCOPED_DIRS`: commits of tests/, docs/ or results after it leave the scored code as it was) and
    ``scoped_dirty`` (uncommitted changes to those files: ``--whole-core`` refuses them)."""
    return {"scoped_commit": _git("log", "-1", "--format=%H", "--", *SCOPED_DIRS),
            "scoped_dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", *SCOPED_DIRS))}


def scope_blobs(group: Dict[str, Any], commit: str = "HEAD") -> Dict[str, str]:
    """``{file: git blob id}`` of the group's scoped files at ``commit``: what its mutants were made from."""
    return {p: _git("rev-parse", f"{commit}:{p}") for p in sorted(group["scope"])}


def changed_since(commit: str) -> List[str]:
    """The files of :data:`SCOPED_DIRS` that differ between ``commit`` and HEAD (a stale score names them)."""
    return [f for f in _git("diff", "--name-only", commit, "HEAD", "--", *SCOPED_DIRS).splitlines() if f]


def write_group_result(name: str, res: Dict[str, Any], wall_s: float, mode: str) -> Path:
    """``GROUP_RESULTS/<name>.json``: one whole-core group's run (:func:`collect`'s counts and every survivor,
    equivalent or not: which ones are equivalent is decided again when the aggregate is written, from
    ``mutation_equivalent.json`` as it is then), the scoped commit it tested, HEAD, date, wall time and mode."""
    GROUP_RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"group": name, **scoped_state(), "scope_blobs": scope_blobs(WHOLE_CORE[name]),
           "head": _git("rev-parse", "HEAD"), "mode": mode,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "wall_s": round(wall_s, 1),
           "killed": res["killed"], "survivors": res["survived"] + res["equivalent"],
           "per_function": res["per_function"], "not_scored": res["not_scored"]}
    out = GROUP_RESULTS / f"{name}.json"
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return out


def read_group_result(name: str) -> Optional[Dict[str, Any]]:
    """A committed group run of :func:`write_group_result`, its survivors split again into ``survived`` and
    ``equivalent`` (:func:`_known`), per-function tallies recounted likewise; None when the group has none."""
    path = GROUP_RESULTS / f"{name}.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if "scope_blobs" not in doc:  # written before the blobs were recorded: the scoped commit's
        doc["scope_blobs"] = scope_blobs(WHOLE_CORE[name], doc["scoped_commit"])
    survived, equivalent = [], []
    per = {k: {"killed": v["killed"], "survived": 0, "equivalent": 0} for k, v in doc["per_function"].items()}
    for e in doc["survivors"]:
        e = {k: v for k, v in e.items() if k != "reason"}
        p = e["where"].rsplit(":", 1)[0]
        known = _known(p, e["function"], e["original"], e["mutated"])
        if known:
            e["reason"] = known["reason"]
        eq = bool(known and not known.get("survives"))
        (equivalent if eq else survived).append(e)
        per.setdefault(f"{p}:{e['function']}", {"killed": 0, "survived": 0, "equivalent": 0})[
            "equivalent" if eq else "survived"] += 1
    return {**doc, "survived": survived, "equivalent": equivalent, "per_function": per}


#: Copied to ``mutants/sitecustomize.py``: a Python a test starts (``python -m runner``, torchrun ranks, gloo
#: workers, with ``PYTHONPATH`` on the mutated tree and a tmp dir as cwd) imports mutated modules, whose trampoline
#: reads mutmut's config from the cwd; this loads it from the work dir first, so such a subprocess runs (and, under
#: a mutant, runs the mutant). During the stats run it also writes the functions the subprocess called to
#: ``mutants/.subprocess_hits/<pid>``, which :data:`HITS_PLUGIN` credits to the test that started it (mutmut
#: itself sees only the test process's calls, so a function that only a subprocess runs would get no tests).
SITECUSTOMIZE = """\
import os as _os
if _os.environ.get("MUTANT_UNDER_TEST"):
    _cwd = _os.getcwd()
    _mutants = _os.path.dirname(_os.path.abspath(__file__))
    try:
        _os.chdir(_os.path.dirname(_mutants))
        from mutmut.configuration import config as _config
        _config()
    except Exception:
        pass
    finally:
        _os.chdir(_cwd)
    if _os.environ.get("MUTANT_UNDER_TEST") == "stats":
        import atexit as _atexit
        import threading as _threading

        def _dump_hits():
            try:
                from mutmut.state import state
                names = sorted(state()._stats)
                if names:
                    d = _os.path.join(_mutants, ".subprocess_hits")
                    _os.makedirs(d, exist_ok=True)
                    tmp = _os.path.join(d, "." + str(_os.getpid()))
                    with open(tmp, "w") as f:
                        f.write("\\n".join(names))
                    _os.replace(tmp, _os.path.join(d, str(_os.getpid())))
            except Exception:
                pass

        def _dump_often():  # a subprocess the test kills (SIGKILL) runs no atexit
            import time
            while True:
                time.sleep(0.2)
                _dump_hits()

        _atexit.register(_dump_hits)
        _threading.Thread(target=_dump_often, daemon=True).start()
"""

#: Copied to ``mutants/mutmut_subprocess_hits.py`` and loaded with ``-p``: before mutmut's stats collector reads a
#: test's hits (its ``pytest_runtest_teardown``), the functions the test's subprocesses called are added.
HITS_PLUGIN = """\
import os
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".subprocess_hits")
    if os.environ.get("MUTANT_UNDER_TEST") != "stats" or not os.path.isdir(d):
        return
    from mutmut.state import state
    for name in os.listdir(d):
        p = os.path.join(d, name)
        with open(p) as f:
            state()._stats.update(x for x in f.read().split("\\n") if x)
        os.remove(p)


def pytest_sessionfinish(session, exitstatus):
    # Child processes a test left behind (a subprocess of a failed test, never waited for) are killed and reaped
    # here: the stats, clean and forced-fail sessions run inside mutmut's own process, whose os.wait() would
    # otherwise reap one of them and fail on a pid that is no mutant's.
    import signal
    kids = set()
    try:
        for tid in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{tid}/children") as f:
                kids.update(int(x) for x in f.read().split())
    except OSError:
        return
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
"""


def prepare(work: Path, group: Dict[str, Any]) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if not src.is_file() or rel.startswith("benchmarks/results/"):
            continue
        dst = work / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    with open(work / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write(mutmut_table(group))
    (work / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (work / "mutmut_subprocess_hits.py").write_text(HITS_PLUGIN)


def mutmut_bin() -> str:
    cand = Path(sys.executable).parent / "mutmut"
    return str(cand) if cand.exists() else (shutil.which("mutmut") or "mutmut")


def run_mutmut(work: Path, names: List[str], max_children: int) -> int:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the mutants/ copy, nothing else
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = ["nice", "-n", str(NICE), mutmut_bin(), "run", "--max-children", str(max_children), *names]
    print("mutation:", " ".join(cmd[:6]), f"<{len(names)} names> in {work}", flush=True)
    with open(work / "mutmut.log", "a", encoding="utf-8") as log:  # mutmut's progress spinner: kept out of the way
        return subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


# ------------------------------------------------------------------------------------------------ results


def _function_starts(path: Path) -> Dict[str, int]:
    """``{"func" | "Class.method": first line (its first decorator, else def)}`` of a source file."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{m.name}"] = min([m.lineno, *(d.lineno for d in m.decorator_list)])
    return out


def _changed(diff: str) -> Tuple[int, str, str]:
    """(line offset in the function of the first changed line, original line(s), mutated line(s))."""
    orig_no = 0
    removed, added, first = [], [], None
    for ln in diff.splitlines():
        if ln.startswith(("---", "+++")):
            continue
        if ln.startswith("@@"):
            orig_no = int(ln.split()[1].split(",")[0][1:]) - 1
            continue
        if ln.startswith("-"):
            first = orig_no if first is None else first
            removed.append(ln[1:].strip())
            orig_no += 1
        elif ln.startswith("+"):
            first = orig_no if first is None else first
            added.append(ln[1:].strip())
        else:
            orig_no += 1
    return (first or 0), " ".join(removed), " ".join(added)


def _known(path: str, func: str, orig: str, mut: str) -> Optional[Dict[str, Any]]:
    for e in EQUIVALENT:
        if e["file"] == path and e["function"] == func and e["original"] == orig and e["mutated"] == mut:
            return e
    return None


def collect(work: Path, group: Dict[str, Any]) -> Dict[str, Any]:
    """Per scoped mutant of the group's work dir: its last status; for survivors file:line, function, mutation."""
    from mutmut.stats import status_by_exit_code

    here = os.getcwd()
    os.chdir(work)
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        wanted = {mangled(p, f): (p, f) for p, fs in expanded(group).items() for f in fs}
        per: Dict[str, Dict[str, int]] = {}
        killed, survived, equivalent, other = 0, [], [], {}
        for path in group["scope"]:
            meta = Path("mutants") / (path + ".meta")
            if not meta.exists():
                raise SystemExit(f"mutation: {work / meta} is missing; did mutmut run?")
            codes = json.loads(meta.read_text())["exit_code_by_key"]
            starts = _function_starts(Path(path))
            for name, code in sorted(codes.items(), key=lambda kv: (kv[0].split("__mutmut_")[0],
                                                                      int(kv[0].rsplit("_", 1)[1]))):
                base = name.split("__mutmut_")[0]
                if base not in wanted:
                    continue
                p, func = wanted[base]
                status = status_by_exit_code[code]
                tally = per.setdefault(f"{p}:{func}", {"killed": 0, "survived": 0, "equivalent": 0})
                if status in ("killed", "timeout"):
                    killed += 1
                    tally["killed"] += 1
                    continue
                if status not in ("survived", "no tests"):
                    other[name] = status  # not checked / suspicious / segfault: listed, not scored
                    continue
                off, orig, mut = _changed(get_diff_for_mutant(name, path=path))
                entry = {"mutant": name, "where": f"{p}:{starts.get(func, 0) + off}", "function": func,
                         "original": orig, "mutated": mut, "status": status}
                known = _known(p, func, orig, mut)
                if known:
                    entry["reason"] = known["reason"]
                if known and not known.get("survives"):
                    equivalent.append(entry)
                    tally["equivalent"] += 1
                else:
                    survived.append(entry)
                    tally["survived"] += 1
        return {"killed": killed, "survived": survived, "equivalent": equivalent, "per_function": per,
                "not_scored": other}
    finally:
        os.chdir(here)


def _function_nodes(path: Path) -> Dict[str, ast.AST]:
    tree = ast.parse(path.read_text())
    out: Dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{m.name}"] = m
    return out


def estimate_mutants(fn: ast.AST) -> float:
    """A rough count of the mutants mutmut makes of one function (:data:`MUTANT_WEIGHTS`; docstring, annotations and
    f-string parts not counted)."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    skip, n = set(), 0.0
    w = MUTANT_WEIGHTS
    for stmt in body:
        for x in ast.walk(stmt):
            if isinstance(x, ast.AnnAssign):
                skip.update(id(y) for y in ast.walk(x.annotation))
            elif isinstance(x, ast.JoinedStr):
                skip.update(id(y) for y in ast.walk(x) if y is not x)
    for stmt in body:
        for x in ast.walk(stmt):
            if id(x) in skip:
                continue
            if isinstance(x, ast.Constant):
                v = x.value
                n += w["bool"] if isinstance(v, bool) else w["num"] if isinstance(v, (int, float)) else \
                    w["str"] if isinstance(v, str) else 0
            elif isinstance(x, ast.JoinedStr):
                n += w["fstr"]
            elif isinstance(x, ast.BinOp):
                n += w["binop"]
            elif isinstance(x, ast.AugAssign):
                n += w["aug"]
            elif isinstance(x, ast.Compare):
                n += w["cmp"] * len(x.ops)
            elif isinstance(x, ast.BoolOp):
                n += w["bool_op"] * (len(x.values) - 1)
            elif isinstance(x, ast.UnaryOp):
                n += w["unary"]
            elif isinstance(x, (ast.Assign, ast.AnnAssign)) and getattr(x, "value", None) is not None:
                n += w["assign"]
            elif isinstance(x, ast.Call):
                n += w["args"] * (len(x.args) + len(x.keywords))
            elif isinstance(x, ast.Lambda):
                n += w["lambda"]
            elif isinstance(x, (ast.Break, ast.Continue)):
                n += w["brk"]
    return n * MUTANT_SCALE


def group_estimate(group: Dict[str, Any]) -> Dict[str, Any]:
    """Per group: files, lines, functions, estimated mutants and seconds (:data:`RATE`)."""
    files, est, secs, nfun = {}, 0.0, 0.0, 0
    for p, fs in expanded(group).items():
        nodes = _function_nodes(ROOT / p)
        e = sum(estimate_mutants(nodes[f]) for f in fs)
        rate = RATE.get(p, RATE["e2e"] if group.get("e2e") else RATE["direct"])
        files[p] = {"lines": len((ROOT / p).read_text().splitlines()), "functions": len(fs), "mutants": round(e)}
        est, secs, nfun = est + e, secs + e * rate, nfun + len(fs)
    return {"files": files, "functions": nfun, "mutants": round(est), "seconds": round(secs)}


def core_files() -> List[str]:
    """Every ``.py`` file of runner/ and models/ the whole core covers (the toys' training scripts excepted)."""
    import re

    out = subprocess.run(["git", "ls-files", "runner", "models"], cwd=ROOT, capture_output=True, text=True).stdout
    return [f for f in out.split() if f.endswith(".py") and not re.fullmatch(r"models/toy_\w+/train\w*\.py", f)]


def list_whole_core(per_mutant_s: Optional[float] = None) -> int:
    """Print each whole-core group (its files with lines, functions and estimated mutants, its tests) and the
    totals; files of runner/ and models/ with functions that no group covers are listed as a failure."""
    tot_m, tot_s = 0, 0
    for name, g in WHOLE_CORE.items():
        e = group_estimate(g)
        tot_m, tot_s = tot_m + e["mutants"], tot_s + e["seconds"]
        print(f"{name}: ~{e['mutants']} mutants, {e['functions']} functions, ~{e['seconds'] / 60:.0f} min")
        for p, fe in e["files"].items():
            gpu = f" (GPU-only left out: {', '.join(GPU_ONLY[p])})" if p in GPU_ONLY and isinstance(
                g["scope"][p], dict) else ""
            part = "" if g["scope"][p] in (ALL,) or isinstance(g["scope"][p], dict) else " (part)"
            print(f"  {p}{part}: {fe['lines']} lines, {fe['functions']} functions, ~{fe['mutants']} mutants{gpu}")
        print(f"  tests ({len(g['tests'])}{', end-to-end: ' + ' '.join(g['e2e']) if g.get('e2e') else ''}):")
        for t in g["tests"]:
            print(f"    {t}")
    covered = {p for g in WHOLE_CORE.values() for p in g["scope"]}
    missing = [p for p in core_files() if p not in covered and _function_starts(ROOT / p)]
    print(f"whole core: {len(WHOLE_CORE)} groups, {len(covered)} files, ~{tot_m} mutants (estimate), "
          f"~{tot_s / 3600:.1f} h at the per-group rates of RATE"
          + (f", ~{tot_m * per_mutant_s / 3600:.1f} h at {per_mutant_s} s a mutant" if per_mutant_s else ""))
    if missing:
        print("not in any whole-core group: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


def scope_doc(names: Optional[List[str]] = None, table: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """What the score covers (the groups ``names`` of ``table``, default all of :data:`GROUPS`): per file its
    functions (``"*"`` expanded), the counts of files and functions."""
    table = GROUPS if table is None else table
    files: Dict[str, List[str]] = {}
    for g in (table[n] for n in (names if names is not None else table)):
        for p, fs in expanded(g).items():
            files.setdefault(p, [])
            files[p] += [f for f in fs if f not in files[p]]
    return {"files": dict(sorted(files.items())), "file_count": len(files),
            "function_count": sum(len(fs) for fs in files.values())}


def score_fields(killed: int, survived: List[Dict[str, Any]], equivalent: List[Dict[str, Any]],
                 per: Dict[str, Any], other: Dict[str, Any]) -> Dict[str, Any]:
    """The counts, survivors and score of a result (``score = killed / (killed + survived)``)."""
    return {
        "counting": "killed includes timeouts; survived includes mutants no selected test reaches (mutmut 'no "
                    "tests'); equivalent survivors are listed with their reason and left out of the score",
        "score": round(killed / (killed + len(survived)), 4) if killed + len(survived) else None,
        "killed": killed,
        "survived_count": len(survived),
        "equivalent_count": len(equivalent),
        "survived": survived,
        "equivalent": equivalent,
        "per_function": per,
        "not_scored": other,
    }


def write_whole_core(out: Path, table: Dict[str, Dict[str, Any]], argv: Optional[List[str]],
                     max_children: int) -> int:
    """The whole-core score (:data:`RESULT`) from the committed group results (:func:`read_group_result`), not
    from ``build/``. ``commit`` is the scoped commit of HEAD (the last commit that changed runner/, models/ or
    kernels/); a group counts when the files it mutated are, blob for blob, the files of that commit (a group run
    at an older scoped commit whose own files have not changed since still holds: the rest of the tree changed
    around them, which ``group_runs[g].changed_since`` names); a group whose files changed is left out of the score
    and listed in ``groups_stale`` with those files (re-run it); ``groups_without_results`` lists both those and
    the groups never run. Re-run with ``--report-only`` to refresh after commits."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tool = f"mutmut {version('mutmut')}"
    except PackageNotFoundError:  # --report-only needs no mutmut
        tool = "mutmut (not installed where this was written)"
    commit = _git("log", "-1", "--format=%H", "--", *SCOPED_DIRS)
    results = {n: r for n in table if (r := read_group_result(n)) is not None}
    now = {n: scope_blobs(table[n], commit) for n in results}
    used = {n: r for n, r in results.items() if r["scope_blobs"] == now[n]}
    stale = {n: sorted(p for p in now[n] if now[n][p] != r["scope_blobs"].get(p))
             for n, r in results.items() if n not in used}
    killed = sum(r["killed"] for r in used.values())
    survived = [{**e, "group": n} for n, r in used.items() for e in r["survived"]]
    equivalent = [{**e, "group": n} for n, r in used.items() for e in r["equivalent"]]
    per: Dict[str, Any] = {}
    other: Dict[str, Any] = {}
    for r in used.values():
        per.update(r["per_function"])
        other.update(r["not_scored"])
    doc = {
        "issue": "#42",
        "whole_core": True,
        "tool": tool,
        "command": "python benchmarks/mutation.py --whole-core --skip-done",
        "last_command": " ".join(["python benchmarks/mutation.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": f"{os.cpu_count()} CPU cores (shared), --max-children {max_children}, nice {NICE}",
        "commit": commit,
        "head": _git("rev-parse", "HEAD"),
        "complete": len(used) == len(table),
        "group_wall_s": {n: r["wall_s"] for n, r in used.items()},
        "group_runs": {n: {"commit": r["scoped_commit"], "head": r["head"], "mode": r["mode"], "date": r["date"],
                           "changed_since": changed_since(r["scoped_commit"]) if r["scoped_commit"] != commit else []}
                       for n, r in used.items()},
        "changed_since": sorted({f for n, r in used.items() if r["scoped_commit"] != commit
                                 for f in changed_since(r["scoped_commit"])}),
        "groups": table,
        "scope": scope_doc(list(used), table),
        **score_fields(killed, survived, equivalent, per, other),
        "groups_stale": stale,
        "groups_without_results": [n for n in table if n not in used],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"mutation: whole core at {commit[:12]}: {len(used)} of {len(table)} groups, score {doc['score']} "
          f"(killed {killed}, survived {len(survived)}, equivalent {len(equivalent)}) -> {out}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "mutation",
                    help="scratch copies of the checkout, one per group (default build/mutation/<group>)")
    ap.add_argument("--max-children", type=int, default=2, help="mutants run in parallel (default 2)")
    ap.add_argument("--groups", nargs="*", default=None, choices=sorted(GROUPS) + sorted(WHOLE_CORE),
                    metavar="GROUP",
                    help=f"run these groups only (default all: {', '.join(GROUPS)}; with --whole-core the groups "
                         "of benchmarks/mutation_core.json); the others' results are kept from --work")
    ap.add_argument("--whole-core", action="store_true",
                    help="the whole core (issue #42): every module of runner/ and models/ but the toys' training "
                         "scripts, the groups of benchmarks/mutation_core.json (default --work build/mutation-core); "
                         "refuses a tree with uncommitted changes to tracked files")
    ap.add_argument("--list-whole-core", action="store_true",
                    help="print the whole core's groups (files, lines, functions, estimated mutants and minutes, "
                         "tests) and the estimated total; runs nothing")
    ap.add_argument("--rerun-survivors", action="store_true",
                    help="keep the work dirs and re-test only the mutants that survived there (after new tests)")
    ap.add_argument("--resume", action="store_true",
                    help="keep each group's mutants/ and copy the checkout over it: mutmut keeps the result of every "
                         "mutant whose function is unchanged (by its hash) and tests the rest, so a run stopped "
                         "(a session's end) or moved to a later commit goes on where it was; the result records the "
                         "mode")
    ap.add_argument("--skip-done", action="store_true",
                    help="--whole-core: skip the groups whose committed result (benchmarks/results/mutation_core/) "
                         "tested the current scoped commit: a later session goes on where the last one stopped")
    ap.add_argument("--report-only", action="store_true", help="rewrite the JSON from --work without running")
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args(argv)
    if a.list_whole_core:
        return list_whole_core(per_mutant_s=0.074)
    table = WHOLE_CORE if a.whole_core else GROUPS
    if a.groups and any(g not in table for g in a.groups):
        ap.error(f"--groups {' '.join(g for g in a.groups if g not in table)}: not a group of "
                 f"{'--whole-core' if a.whole_core else 'GROUPS (add --whole-core for the whole-core groups)'}")
    if a.whole_core and a.work == ROOT / "build" / "mutation":
        a.work = ROOT / "build" / "mutation-core"
    state = scoped_state() if a.whole_core else {}
    if a.whole_core and not a.report_only and state["scoped_dirty"]:
        print(f"mutation: --whole-core runs at one commit: commit (or drop) the changes to {', '.join(SCOPED_DIRS)} "
              "first", file=sys.stderr)
        return 2
    root = a.work.resolve()
    t0 = time.time()
    run_groups = a.groups or list(table)
    if a.skip_done:  # the groups whose committed result mutated the files as HEAD has them (an earlier session's)
        done = [n for n in run_groups if (r := read_group_result(n)) and r["scope_blobs"] == scope_blobs(table[n])]
        if done:
            print(f"mutation: {len(done)} group(s) already scored on their files as HEAD has them: skipped",
                  flush=True)
        run_groups = [n for n in run_groups if n not in done]
    timings: Dict[str, float] = {}
    ran_at: Dict[str, Dict[str, Any]] = {}
    prev = json.loads(a.out.read_text()) if a.out.exists() else {}
    for name in run_groups:
        if a.report_only:
            break
        group, work = table[name], root / name
        t1 = time.time()
        if a.rerun_survivors:
            last = read_group_result(name) if a.whole_core else None
            names = ([s["mutant"] for s in last["survivors"]] if last else
                     [s["mutant"] for s in prev.get("survived", []) + prev.get("equivalent", [])
                      if s.get("group") == name])
            # the group's table as it is now (a test file added to the group is selected), then the new tests
            (work / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + mutmut_table(group))
            for t in {t.split("::")[0] for t in group["tests"]} | {"tests/conftest.py", "tests/_helpers.py"}:
                if (ROOT / t).is_file():  # the new tests into the copy
                    for dst in (work / t, work / "mutants" / t):
                        shutil.copy2(ROOT / t, dst)
        else:
            if work.exists() and not (a.resume and (work / "mutants").is_dir()):
                shutil.rmtree(work)
            work.mkdir(parents=True, exist_ok=True)
            prepare(work, group)
            names = scope_globs(group)
        if names:
            rc = run_mutmut(work, names, a.max_children)
            if rc != 0:
                print(f"mutation: mutmut exited {rc} in group {name} (log: {work / 'mutmut.log'})", file=sys.stderr)
                return rc
        timings[name] = round(time.time() - t1, 1)
        mode = "rerun_survivors" if a.rerun_survivors else "resume" if a.resume else "full"
        ran_at[name] = {**git_commit(), "mode": mode,
                        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
        if a.whole_core:
            out = write_group_result(name, collect(work, group), timings[name], mode)
            print(f"mutation: group {name} written to {out.relative_to(ROOT)}", flush=True)
        print(f"mutation: group {name} done in {timings[name]:.0f} s", flush=True)

    if a.whole_core:
        return write_whole_core(a.out, table, argv, a.max_children)

    killed, survived, equivalent, per, other = 0, [], [], {}, {}
    for name, group in table.items():
        if not (root / name / "mutants").is_dir():
            print(f"mutation: group {name} has no results in {root / name}; left out", file=sys.stderr)
            continue
        res = collect(root / name, group)
        killed += res["killed"]
        for e in res["survived"] + res["equivalent"]:
            e["group"] = name
        survived += res["survived"]
        equivalent += res["equivalent"]
        per.update(res["per_function"])
        other.update(res["not_scored"])
    import mutmut

    full = not (a.rerun_survivors or a.report_only) and a.groups is None
    group_s = {k: v for k, v in (prev.get("group_wall_s") or {}).items() if (root / k / "mutants").is_dir()}
    if not a.rerun_survivors:
        group_s.update(timings)
    doc = {
        "issue": "#23, #29, #42" if a.whole_core else "#23, #29",
        "whole_core": a.whole_core,
        "tool": f"mutmut {mutmut.__version__}",
        "command": "python benchmarks/mutation.py" + (" --whole-core" if a.whole_core else ""),
        "last_command": " ".join(["python benchmarks/mutation.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": f"{os.cpu_count()} CPU cores (shared), --max-children {a.max_children}, nice {NICE}",
        **git_commit(),
        "wall_s_full_run": round(time.time() - t0, 1) if full else prev.get("wall_s_full_run"),
        "group_wall_s": group_s,
        "group_runs": {k: v for k, v in {**(prev.get("group_runs") or {}), **ran_at}.items()
                       if (root / k / "mutants").is_dir()},  # per group: the commit its last run tested
        "last_wall_s": round(time.time() - t0, 1),
        "groups": table,
        "scope": scope_doc([n for n in table if (root / n / "mutants").is_dir()], table),
        **score_fields(killed, survived, equivalent, per, other),
        "groups_without_results": [n for n in table if not (root / n / "mutants").is_dir()],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"mutation: score {doc['score']} (killed {killed}, survived {len(survived)}, equivalent "
          f"{len(equivalent)}) in {doc['last_wall_s']:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
