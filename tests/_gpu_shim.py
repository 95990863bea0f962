"""``python tests/_gpu_shim.py <runner overrides>``: ``python -m runner`` exactly (its ``__main__``, Hydra, exit
codes, ``job_status.json``), plus two test hooks set through the environment. Used by tests/test_gpu_e2e.py for the
runs it makes in a subprocess (torch.compile, torchrun, the negative control); the repository root must come first
on ``PYTHONPATH`` (this file's folder is ``sys.path[0]``).

* ``GPU_E2E_TRACES=<dir>``: every stage's profiled denoiser forward (``models.denoiser_evidence.DenoiserProbe.trace``) is
  written to ``<dir>/<pid>.json`` as ``{stage: {"kernels": {name: count}, "ops": {name: count}}}``: device kernels
  and CPU-side ops apart, which the manifest's matched-name lists do not keep (a name there may be a CPU-side
  ``aten::`` op or an Inductor ``record_function`` label as well as a device kernel).
* ``GPU_E2E_SWAP=<module path>=<diffusers backend>``: once the backends are installed and the probes attached
  (``runner.app.execute.run``'s ``on_loaded``), the denoiser's attention module at that path is switched to another
  diffusers dispatcher entry behind the runner's back (``transformer_blocks.0.attn=native``): the negative control.
"""

from __future__ import annotations

import json
import os
import runpy
from typing import Any, Dict


def write_trace(out_dir: str, stage: str, trace: Any) -> str:
    """Merge ``{stage: {kernels, ops}}`` into ``out_dir/<pid>.json``; returns the path."""
    path = os.path.join(out_dir, f"{os.getpid()}.json")
    doc: Dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    doc[stage] = {"kernels": dict(trace.kernels), "ops": dict(trace.ops)}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    return path


def swap_attention(engine: Any, layer: str, backend: str) -> None:
    """Point the attention module ``layer`` of ``engine``'s denoiser at diffusers dispatcher entry ``backend``."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    engine.denoiser.get_submodule(layer).processor._attention_backend = AttentionBackendName(backend)


def install() -> None:
    """Apply the hooks the environment asks for (nothing when neither variable is set)."""
    from models import denoiser_evidence as evidence
    from runner.app import execute

    out = os.environ.get("GPU_E2E_TRACES")
    if out:
        real_build = evidence.build

        def build(stage: str, probes: Any, denoiser: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
            if denoiser is not None and denoiser.trace is not None:
                write_trace(out, stage, denoiser.trace)
            return real_build(stage, probes, denoiser, *args, **kwargs)

        evidence.build = build
    swap = os.environ.get("GPU_E2E_SWAP")
    if swap:
        layer, _, backend = swap.partition("=")
        real_run = execute.run

        def run(*args: Any, **kwargs: Any) -> int:
            kwargs["on_loaded"] = lambda engine: swap_attention(engine, layer, backend)
            return real_run(*args, **kwargs)

        execute.run = run  # runner.app.jobs.run_job imports it at call time


if __name__ == "__main__":
    install()
    runpy.run_module("runner", run_name="__main__", alter_sys=True)
