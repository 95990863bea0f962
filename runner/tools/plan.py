"""``python -m runner <overrides> --plan [--device-gb GiB] [--json]``: the memory plan the composed run would get,
on any machine, with nothing loaded and no run dir made (issue #38).

For each stage whose engine plans memory (the diffusers pipelines), it prints every offload plan's estimate per
phase (``text_encode``, ``denoise``, ``vae_decode``), each plan's peak with the reserve and the bytes it copies to
the device per pipeline call, then the plan taken and why, or the refusal the run would end with (exit 2).
``--json`` prints ``{"platform", "dtype", "device_total_gb", "capacity_from", "batch", "platform_here", "stages":
{stage: plan}}`` instead (``platform_here``: ``{"platform", "dtype"}`` a run on this machine would use where
``platform=auto`` is planned as a GPU it lacks, else null), where ``plan`` is
``models.memory.Fitting.section()`` as the engine's ``memory_plan`` returns it: the one function a run calls while
it reads its rows (``models.memory.FittingPass.prepare_rows``), whose result the run records as the manifest's
``memory_plan`` (``applied`` is filled at placement; a refusal gives ``{"refused": message, "candidates": [...]}``).
A command the run would refuse before planning (a config value, the weights, an override Hydra cannot compose)
prints ``{"refused": {"error_type", "message", "exit_code"}}`` under ``--json`` (the same line on stderr; exit 2;
``error_type`` null for an override refused before composing, e.g. an unknown model: :func:`refuse`).

**Which device it plans for.** ``platform=<kind>`` of the composed config; ``platform=auto`` plans for this
machine's GPU when it has one, else for a CUDA GPU (memory plans are for GPUs; the header then says so, and which
platform the same run on this machine would use). ``platform=cpu`` plans a CPU run:
``memory.offload=auto`` is then ``none``, recorded so.

**Its capacity.** ``memory.max_gpu_gb=<GiB>`` when set: the budget bounds the plan, as in the run. Otherwise the
GPU's total memory: this machine's when it has that GPU, else ``--device-gb=<GiB>``: the capacity to plan for, as
accelerate's ``max_memory={0: "80GiB"}`` names one without the device (an H100 80GB has 79.2 GiB, an H200 139.8;
``torch.cuda.get_device_properties(0).total_memory / 2**30`` on the machine says it exactly). Without either,
``memory.offload=auto`` is refused (what it takes depends on the capacity), and an explicit plan is printed with
``budget_gb`` null where a GPU run records its total.

Not checked here (the target machine's, checked when the run starts there): the backends, the quantization
methods' packages, the free memory. The rows are read and checked as the run reads them (``dataset.*``,
``batch_size``, ``num_images_per_prompt``: the largest batch shape decides the activations).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from runner.core.errors import ConfigValueError, RunnerError

#: The command-line flags of plan mode (everything else is a Hydra override).
FLAG = "--plan"


def stray_plan_flag(argv: Sequence[str]) -> Optional[str]:
    """Why a command line without ``--plan`` holds one of its flags (``--device-gb``, ``--json``), which Hydra's
    argument parser would answer with its usage dump; None when there is none or ``--plan`` is given."""
    if wants_plan(argv):
        return None
    flag = next((a for a in argv if a == "--json" or a == "--device-gb" or a.startswith("--device-gb=")), None)
    return (f"{flag.split('=', 1)[0]} is a flag of --plan (the memory plan, nothing run); fix: add --plan, or drop "
            f"{flag}" if flag else None)


def wants_plan(argv: Sequence[str]) -> bool:
    """Whether ``python -m runner``'s arguments ask for plan mode."""
    return FLAG in argv


def parse(argv: Sequence[str]) -> Tuple[List[str], Optional[float], bool]:
    """``(overrides, device_gb, as_json)`` of a plan-mode command line.

    Raises:
        ConfigValueError: ``--device-gb`` without a positive number, a multirun (``-m``), another flag.
    """
    overrides: List[str] = []
    device_gb: Optional[float] = None
    as_json = False
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == FLAG:
            continue
        if a == "--json":
            as_json = True
        elif a == "--device-gb" or a.startswith("--device-gb="):
            raw = a.split("=", 1)[1] if "=" in a else (args.pop(0) if args else "")
            try:
                device_gb = float(raw)
            except ValueError:
                device_gb = None
            if device_gb is None or not 0 < device_gb <= 1 << 20:  # inf and nan too (an OverflowError later)
                raise ConfigValueError(f"--device-gb {raw!r} must be the GPU's memory in GiB (> 0); fix: e.g. "
                                       "--device-gb=79.2 for an H100 80GB")
        elif a in ("-m", "--multirun"):
            raise ConfigValueError("--plan plans one run, not a sweep; fix: drop -m and give one value per key")
        elif a.startswith("-"):
            raise ConfigValueError(f"{a}: plan mode takes --plan, --device-gb=<GiB> and --json beside the run's "
                                   "overrides; fix: remove it")
        else:
            overrides.append(a)
    return overrides, device_gb, as_json


def compose(overrides: Sequence[str]) -> Any:
    """The run config as ``python -m runner <overrides>`` composes it (Hydra's ``hydra.*`` keys left out: plan mode
    makes no run dir)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.core.paths import CONF_DIR
    from runner.core.schema import register_configs

    register_configs()
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="runner_plan"):
        return hydra_compose("config", overrides=keep)


def target(cfg: Any, device_gb: Optional[float]) -> Tuple[str, Optional[int], str]:
    """``(platform kind, device total bytes or None, where the capacity came from)`` of the run being planned
    (module docstring)."""
    from runner.core import memory as planner
    from runner.core.platform import detect

    name = str(cfg.platform.name)
    here = detect("auto", "auto", ())
    kind = name if name != "auto" else (here.kind if here.kind in ("cuda", "rocm") else "cuda")
    if kind not in ("cuda", "rocm"):
        return kind, None, f"not planned against ({kind}: no GPU memory to fit)"
    if device_gb is not None:
        return kind, int(device_gb * planner.GIB), f"--device-gb={device_gb:g}"
    if here.kind == kind:
        from models.memory import device_total

        dev = here.device if str(cfg.platform.device) == "auto" else str(cfg.platform.device)
        return kind, device_total(dev), f"this machine's {dev}"
    return kind, None, "unknown (no such GPU here: --device-gb=<GiB> gives it)"


def plans(cfg: Any, overrides: Sequence[str], device_gb: Optional[float] = None) -> Dict[str, Any]:
    """Every planning stage's plan for the composed run ``cfg`` (module docstring; the ``--json`` document).

    Raises:
        runner.core.errors.RunnerError subclasses: what the run itself refuses before reading its rows, and
            ``memory.offload=auto`` without a capacity (a budget or ``--device-gb``) for a GPU this machine lacks.
    """
    from runner.app import checks
    from runner.app.stages import build_engines, stage_graph
    from runner.core import memory as planner
    from runner.core.schema import to_typed

    checks.check_schema(cfg)
    run = to_typed(cfg)
    engines = build_engines(cfg, overrides, specs=stage_graph(cfg, run), run=run)
    kind, total, source = target(cfg, device_gb)
    dtype = checks.resolve_dtype(cfg.dtype, kind)
    gpu = kind in ("cuda", "rocm")
    if gpu and total is None and cfg.memory.max_gpu_gb is None and str(cfg.memory.offload) == "auto":
        raise ConfigValueError("memory.offload=auto without memory.max_gpu_gb plans against the GPU's total memory, "
                               f"and this machine has no {kind} device; fix: --device-gb=<GiB> (the GPU's memory, "
                               "e.g. 79.2 for an H100 80GB), or memory.max_gpu_gb=<GiB>")
    for e in engines:
        e.ctx.dtype = dtype
        e.check_config()
    checks.check_run_values(cfg)
    out: Dict[str, Any] = {"platform": kind, "dtype": str(dtype).replace("torch.", ""),
                           "device_total_gb": planner.gb(total) if total else None, "capacity_from": source,
                           "stages": {e.stage: None for e in engines}, "batch": None, "platform_here": None}
    if str(cfg.platform.name) == "auto":
        from runner.core.platform import detect

        here = detect("auto", "auto", ()).kind
        if here != kind:  # platform=auto planned as a GPU this machine lacks: what a run here would use instead
            out["platform_here"] = {"platform": here,
                                    "dtype": str(checks.resolve_dtype(cfg.dtype, here)).replace("torch.", "")}
    planning = [e for e in engines if hasattr(e, "prepare_plan")]
    if not planning:  # a vLLM model: nothing here plans its memory (vLLM sizes its own KV cache)
        return out
    for e in planning:
        e.prepare_plan(kind)
    rows, _ = engines[-1].read_rows()  # ctx.plat is None: the read itself plans nothing (plan_memory)
    for e in planning:
        try:
            out["stages"][e.stage] = e.passes["memory"].plan(rows, total if gpu else None)
        except planner.MemoryBudgetError as err:
            out["stages"][e.stage] = {"refused": str(err), "candidates": [p.to_dict() for p in e.fit.candidates],
                                      "max_gpu_gb": e.fit.settings.max_gpu_gb}
    out["batch"] = batch_shape(cfg, rows)
    return out


def batch_shape(cfg: Any, rows: Sequence[Any]) -> Dict[str, Any]:
    """The largest batch shape the plan is for: ``{batch_size, width, height, num_frames}`` (as
    ``models.memory.FittingPass.stages`` takes it)."""
    big = max(rows, key=lambda r: r.width * r.height * (getattr(r, "num_frames", None) or 1))
    return {"batch_size": max(1, min(int(cfg.batch_size), len(rows) * int(cfg.num_images_per_prompt))),
            "width": big.width, "height": big.height, "num_frames": getattr(big, "num_frames", None),
            "rows": len(rows)}


def render(doc: Dict[str, Any]) -> str:
    """The plan as the console prints it: per stage a table of every plan's estimate (GiB), then the plan taken and
    why, or the refusal."""
    b = doc["batch"]
    mem = f"{doc['device_total_gb']} GiB ({doc['capacity_from']})" if doc["device_total_gb"] else doc["capacity_from"]
    head = f"memory plan for platform {doc['platform']} ({doc['dtype']}), device memory {mem}"
    here = doc.get("platform_here")
    if here:  # platform=auto on a machine without the GPU: say so first (module docstring)
        head = (f"memory plan for platform=auto planned as a {doc['platform'].upper()} GPU ({doc['dtype']}); this "
                f"machine has none, and the same run here would use platform {here['platform']} ({here['dtype']}); "
                f"device memory {mem}")
    if b is not None:
        frames = f" x {b['num_frames']} frames" if b.get("num_frames") else ""
        head += (f"; largest batch {b['batch_size']} x {b['width']}x{b['height']}{frames} ({b['rows']} "
                 f"row{'s' * (b['rows'] != 1)})")
    lines = [head]
    for stage, sec in doc["stages"].items():
        if sec is None:
            lines.append(f"stage {stage}: no memory plan (its engine plans none: vLLM sizes its own KV cache)")
            continue
        lines.append(f"stage {stage}:")
        lines.extend(_table(sec["candidates"], (sec.get("planned") or {}).get("offload")))
        if "refused" in sec:
            lines.append(f"  refused: {sec['refused']}")
            continue
        budget = sec.get("bound") or "no budget"
        lines.append(f"  plan: {sec['offload']} (peak {sec['planned']['peak_gb']} GiB; against {budget}): "
                     f"{sec['why']}")
        if sec["quantization"]:
            lines.append("  quantized: " + ", ".join(f"{c}={m}" for c, m in sec["quantization"].items()))
    return "\n".join(lines)


def _table(candidates: Sequence[Dict[str, Any]], chosen: Optional[str]) -> List[str]:
    phases = list(candidates[0]["stages_gb"]) if candidates else []
    head = (f"    {'plan':<12}" + "".join(f"{p:>13}" for p in phases) + f"{'peak+reserve':>14}{'moved/call':>12}"
            + "  resident blocks")
    rows = [head]
    for c in candidates:
        mark = "->" if c["offload"] == chosen else "  "
        n = c.get("resident_blocks", 0)
        rows.append(f"  {mark}{c['offload']:<12}" + "".join(f"{c['stages_gb'][p]:>13.3f}" for p in phases)
                    + f"{c['peak_gb']:>14.3f}{c['moved_per_call_gb']:>12.3f}"
                    + (f"  {n} ({c['resident_gb']:.3f})" if n else ""))
    return rows


def refuse(argv: Sequence[str], error_type: Optional[str], message: str, code: int) -> int:
    """A command refused before it composes: the line on stderr (``runner: <type>: <message>``, or
    ``runner: <message>`` without a type) and, for ``--plan --json``, ``{"refused": {...}}`` on stdout (as
    :func:`main` prints a refusal). Returns ``code``, the exit code."""
    print(f"runner: {error_type + ': ' if error_type else ''}{message}", file=sys.stderr)
    if wants_plan(argv) and "--json" in argv:
        print(json.dumps({"refused": {"error_type": error_type, "message": message, "exit_code": code}}, indent=1))
    return code


def main(argv: Sequence[str]) -> int:
    """Plan mode's command line; returns the exit code: 0 a plan for every planning stage, 2 a refusal or bad
    input (what the run would exit with)."""
    from runner.app.console import loading_bars_off, quiet_tool

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    quiet_tool(argv, loading_bars=True)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        overrides, device_gb, as_json = parse(argv)
        cfg = compose(overrides)
        loading_bars_off()  # once the command line composed (runner.app.console.quiet_tool)
        doc = plans(cfg, overrides, device_gb)
    except (RunnerError, HydraException, OmegaConfBaseException) as e:  # Hydra's: an override it cannot compose
        # under --json a JSON reader gets the refusal on stdout too, not an empty document
        return refuse(argv, type(e).__name__, str(e), e.exit_code if isinstance(e, RunnerError) else 2)
    print(json.dumps(doc, indent=1) if as_json else render(doc))
    refused = any(isinstance(s, dict) and "refused" in s for s in doc["stages"].values())
    return 2 if refused else 0
