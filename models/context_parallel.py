"""Context parallelism (Ulysses, ring) of a diffusers denoiser, on diffusers' own implementation.

diffusers 0.42 ships it: ``ContextParallelConfig(ulysses_degree=..., ring_degree=..., mesh=...)`` and
``ModelMixin.enable_parallelism(config=...)``, which hooks the model's ``_cp_plan`` (split the sequence inputs
over the context group, gather the output at ``proj_out``) and hands every attention processor the config, so
that its dispatcher entry runs the templated Ulysses (all-to-all over heads) or ring (all-gather of key/value
chunks, merged by log-sum-exp) attention. Nothing here communicates; this module builds the mesh, checks what
diffusers would otherwise refuse or mis-run after loading, and applies the config.

One deviation, for CPU: diffusers' ``ModelMixin._resolve_parallel_config`` computes the device as ``rank %
torch.accelerator.device_count()``, a ``ZeroDivisionError`` on a machine without an accelerator (probed on torch
2.13 CPU). :func:`enable` therefore sets the config up itself (same steps: ``ParallelConfig`` wrapping, ``setup``
with this process's rank, world size, device and mesh, recorded on the model) and lets ``enable_parallelism`` do
the rest (its backend check, the processors' config, ``apply_context_parallel``). Under gloo every collective
diffusers' Ulysses path uses runs on CPU (``all_to_all_single``, ``all_gather_into_tensor``).

CFG parallelism: diffusers 0.42 has none (``ParallelConfig`` holds context and tensor parallelism only;
``_modeling_parallel.py`` lists CFG/data parallelism as TODO), so ``parallelism=cfg`` is refused at startup.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from runner.core.distributed import Layout, ParallelismUnsupportedError

#: what the profiler shows of each kind of collective (CPU-side ops of torch's functional collectives and of
#: c10d/gloo/NCCL, and NCCL's device kernels: an all-to-all is send/recv kernels)
COLLECTIVES = {
    "all_to_all": r"all_to_all|alltoall|ncclDevKernel_SendRecv|ncclKernel_SendRecv",
    "all_gather": r"all_gather|allgather|ncclDevKernel_AllGather|ncclKernel_AllGather",
}


def check_model(model_name: str, cls_name: str, config: Dict[str, Any], lay: Layout) -> None:
    """Refuse, before loading, a denoiser diffusers cannot split: no ``_cp_plan`` in its class, or (Ulysses)
    attention heads not a multiple of ``ulysses_degree`` (each rank takes ``heads / ulysses_degree`` heads).

    Raises:
        ParallelismUnsupportedError: naming the model, the class or the head count, and the fix.
    """
    import diffusers

    cls = getattr(diffusers, cls_name, None)
    if cls is None or getattr(cls, "_cp_plan", None) is None:
        raise ParallelismUnsupportedError(
            f"parallelism={lay.mode}: model={model_name}'s denoiser {cls_name} has no context-parallel plan "
            f"(`_cp_plan`) in diffusers {diffusers.__version__}, so diffusers cannot split its sequence; fix: "
            "parallelism=data or single (diffusers plans exist for Flux, Qwen-Image and Wan, among others)")
    heads = config.get("num_attention_heads")
    if lay.ulysses > 1 and heads is not None and int(heads) % lay.ulysses:
        ok = [d for d in range(2, int(heads) + 1) if int(heads) % d == 0]
        raise ParallelismUnsupportedError(
            f"parallelism.ulysses_degree={lay.ulysses}: model={model_name} has {heads} attention heads, not a "
            f"multiple of {lay.ulysses} (Ulysses gives each rank heads / ulysses_degree of them); fix: "
            + (f"parallelism.ulysses_degree in {ok}" if ok else "parallelism=ring") + " or use ring_degree")


def setup(lay: Layout, device: str) -> Any:
    """Build the ``(data, ring, ulysses)`` device mesh and diffusers' context-parallel config over it, set up for
    this process. Every rank calls it at startup, at the same point (creating the mesh's and its flattened
    context dimension's process groups is collective over the world).

    Returns:
        diffusers' ``ParallelConfig`` (its ``context_parallel_config`` set up), for :func:`enable`.
    """
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from runner.core.distributed import MESH_DIMS

    dev = torch.device(device)
    mesh = init_device_mesh(dev.type, (lay.data, lay.ring, lay.ulysses), mesh_dim_names=MESH_DIMS)
    cp = ContextParallelConfig(ring_degree=lay.ring, ulysses_degree=lay.ulysses, mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), dev, mesh=mesh)
    return config


def enable(model: torch.nn.Module, config: Any) -> Dict[str, Any]:
    """Apply diffusers' context parallelism (:func:`setup`'s config) to the loaded denoiser ``model``, after its
    attention backends were installed (``enable_parallelism`` checks each processor's backend).

    Returns:
        The rank's ``context_parallel`` manifest section: degrees, its ring and Ulysses ranks, the process group
        backend, the plan's split inputs and gathered outputs, the attention backend diffusers checked.
    """
    import torch.distributed as dist

    def resolved(_config: Any) -> Any:  # diffusers' _resolve_parallel_config, done by setup (see module doc)
        model._parallel_config = config
        return config

    model._resolve_parallel_config = resolved  # type: ignore[method-assign]
    try:
        model.enable_parallelism(config=config)
    finally:
        del model._resolve_parallel_config
    cp = config.context_parallel_config
    plan = {}
    for module, spec in type(model)._cp_plan.items():
        if isinstance(spec, dict):
            plan[module or "<model>"] = {str(k): f"split dim {v.split_dim}" + (" (output)" if v.split_output else "")
                                         for k, v in spec.items() if hasattr(v, "split_dim")}
        else:
            plan[module or "<model>"] = f"gather dim {getattr(spec, 'gather_dim', '?')}"
    backends = set()
    for m in model.modules():
        proc = getattr(m, "processor", None)
        if getattr(proc, "_parallel_config", None) is config:
            b = getattr(proc, "_attention_backend", None)
            backends.add(str(getattr(b, "value", b)))
    return {"implementation": "diffusers ContextParallelConfig + ModelMixin.enable_parallelism",
            "ulysses_degree": cp.ulysses_degree, "ring_degree": cp.ring_degree,
            "ulysses_rank": cp._ulysses_local_rank, "ring_rank": cp._ring_local_rank,
            "process_group_backend": str(dist.get_backend()), "device": str(config._device),
            "plan": plan,
            "diffusers_attention_backends": sorted(backends)}


def expected_collectives(lay: Optional[Layout], sites: int) -> Dict[str, int]:
    """The least number of each collective one denoiser forward runs under ``lay`` with ``sites`` attention calls:
    Ulysses exchanges query, key, value and output by all-to-all (4 per call); ring all-gathers key/value once per
    call; the output is all-gathered once at ``proj_out`` (counted under ring only, since Ulysses alone has it
    too but it is not what proves the attention ran split)."""
    if lay is None:
        return {}
    out: Dict[str, int] = {}
    if lay.ulysses > 1:
        out["all_to_all"] = 4 * sites
    if lay.ring > 1:
        out["all_gather"] = sites
    return out


# ------------------------------------------------------------------------------------------------- the pass
from models.passes import Pass  # noqa: E402


class ContextSplit:
    """What a family declares to the context-parallel pass (defaults: nothing declared), a part of
    :class:`models.pipelines.PipelineEngine`; a family that splits its sequences overrides these."""

    def splits_attention(self, layer: str) -> bool:
        """Whether diffusers runs the attention call site ``layer`` context-parallel (Ulysses/ring collectives), for
        the evidence's count of collectives; every site by default."""
        return True

    def context_tokens(self, row: Any) -> Optional[Dict[str, int]]:
        """The lengths of the sequences diffusers' context-parallel plan splits for ``row`` (``{name: tokens}``),
        each of which must be a multiple of the context degree; not declared here (``undeclared``: a run with
        context parallelism is refused, ``models.context_parallel.ContextParallelPass``)."""
        return None

    context_tokens.undeclared = True  # type: ignore[attr-defined]

    def context_fix(self, sequence: str, degree: int) -> str:
        """How to make ``sequence`` divisible by ``degree`` (for :meth:`ContextParallelPass.prepare_rows`'s
        refusal)."""
        return "another size (or parallelism degree)"



class ContextParallelPass(Pass):
    """``parallelism=ulysses|ring`` on a diffusion stage (:mod:`models.passes`): the denoiser and every row checked
    before loading, the device mesh and diffusers' config built collectively (:meth:`start`), the config applied to
    each denoiser after the attention backends, and the collectives the evidence expects.

    The family declares what is split: the engine's ``context_tokens(row)`` (``{sequence: tokens}`` per row; the
    base method, marked ``undeclared``, means the family has not declared it, and the run is refused),
    ``context_fix(sequence, degree)`` and ``splits_attention(layer)``.
    """

    name = "context_parallel"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.config: Any = None  # diffusers' ParallelConfig (start)

    def prepare(self) -> None:
        """The denoiser class has a diffusers context-parallel plan and (Ulysses) its head count divides
        (:func:`check_model`); the family declares its split sequences.

        Raises:
            ParallelismUnsupportedError: naming the model and the fix.
        """
        e, lay = self.engine, self.engine.ctx.parallel
        if lay is None:
            return
        check_model(e.model_cfg.name, e.component_class("transformer"), e.component_config("transformer"), lay)
        if getattr(type(e).context_tokens, "undeclared", False):
            raise ParallelismUnsupportedError(
                f"parallelism={lay.mode}: model={e.model_cfg.name} ({type(e).__name__}) does not support context "
                "parallelism yet (its sequence lengths per row are not declared to the runner); fix: "
                "parallelism=data or single")

    def prepare_rows(self, rows: List[Any], path: Any) -> List[Any]:
        """Every split sequence of every row must divide evenly over the context group (diffusers'
        ``EquipartitionSharder`` asserts it mid-run).

        Raises:
            runner.core.dataset.DatasetError: every such row (file:line, sequence, tokens, degree, fix).
        """
        e, lay = self.engine, self.engine.ctx.parallel
        if lay is None:
            return rows
        from runner.core.dataset import DatasetError

        bad = []
        for r in rows:
            for name, n in (e.context_tokens(r) or {}).items():
                if n % lay.context:
                    bad.append(f"{path}:{r.line}: row {r.id!r}: its {name} sequence has {n} tokens, not a multiple of "
                               f"the context degree {lay.context} (ulysses_degree {lay.ulysses} x ring_degree "
                               f"{lay.ring}), which diffusers splits it over; fix: " + e.context_fix(name, lay.context))
        if bad:
            raise DatasetError(bad)
        return rows

    def start(self) -> None:
        """The device mesh and diffusers' ``ContextParallelConfig`` over it (:func:`setup`; collective over every
        rank)."""
        if self.engine.ctx.parallel is not None:
            self.config = setup(self.engine.ctx.parallel, self.engine.ctx.plat.device)

    def install(self, sections: Dict[str, Any]) -> None:
        """Diffusers' context parallelism on each denoiser (after the attention backends: diffusers checks each
        processor's); the manifest's ``context_parallel``."""
        if self.config is not None:
            for _, mod in self.engine.experts():
                sections["context_parallel"] = enable(mod, self.config)

    def evidence_inputs(self) -> Dict[str, Any]:
        """``collectives``: the least number of each collective the run's forwards must show
        (:func:`expected_collectives` over the attention sites diffusers splits)."""
        e = self.engine
        want = expected_collectives(e.ctx.parallel,
                                    sum(1 for site in e.probes["attention"] if e.splits_attention(site.layer)))
        return {"collectives": {k: (COLLECTIVES[k], n) for k, n in want.items()}} if want else {}
