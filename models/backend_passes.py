"""The backend installs of a diffusion stage as passes (:mod:`models.passes`): the attention, MoE and linear
backends the stage resolved (``engine.resolutions``, under the precedence contract) installed on each denoiser
(``engine.experts()``) with their probes, which the stage's evidence reads (``engine.probes``:
:func:`models.denoiser_evidence.build`). Selection is not here (``runner.core.resolve``, ``runner.kernels.registry``):
these passes install what was selected.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from models.passes import Pass
from models.source import family_names
from runner.core.errors import ConfigValueError


def uses_dispatcher(module: torch.nn.Module) -> bool:
    """The attention module's processor calls diffusers' ``dispatch_attention_fn`` (so backends can be chosen and
    observed per call site); read from the processor class's source."""
    proc = getattr(module, "processor", None)
    if proc is None:
        return False
    try:
        return "dispatch_attention_fn" in inspect.getsource(type(proc))
    except (OSError, TypeError):
        return False


def module_dispatches(cls: type) -> bool:
    """Diffusers model class ``cls`` calls diffusers' ``dispatch_attention_fn``: its module's source does, or that of
    a diffusers module it imports an attention class from (Chroma's ``FluxAttention`` from ``transformer_flux``)."""
    import sys

    from diffusers.models.attention import AttentionModuleMixin

    mod = sys.modules[cls.__module__]
    sources = {mod} | {sys.modules[v.__module__] for v in vars(mod).values() if isinstance(v, type)
                       and issubclass(v, AttentionModuleMixin) and v.__module__.startswith("diffusers.")}
    for m in sources:
        try:
            if "dispatch_attention_fn" in inspect.getsource(m):
                return True
        except (OSError, TypeError):
            continue
    return False


def fuse_qkv(transformer: torch.nn.Module) -> int:
    """diffusers' ``fuse_projections`` on every attention module of ``transformer`` that supports it, deleting the
    unfused Linears each fused one replaces (their weights freed, linear evidence exact); returns the modules fused."""
    from diffusers.models.attention import AttentionModuleMixin

    covers = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
              "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"), "to_added_kv": ("add_k_proj", "add_v_proj")}
    n = 0
    for _, mod in attention_modules(transformer):
        if not (isinstance(mod, AttentionModuleMixin) and getattr(mod, "_supports_qkv_fusion", False)
                and not getattr(mod, "fused_projections", False)):
            continue
        mod.fuse_projections()
        for fused, names in covers.items():
            if getattr(mod, fused, None) is not None:
                for name in names:
                    if getattr(mod, name, None) is not None:
                        delattr(mod, name)
        n += 1
    return n


def attention_modules(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every attention module of a diffusers model: ``AttentionModuleMixin`` (the dispatcher
    era) and the older ``attention_processor.Attention`` (SD3, PixArt...)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    for name, mod in model.named_modules():
        if isinstance(mod, (AttentionModuleMixin, Attention)):
            yield name, mod


class AttentionPass(Pass):
    """The attention backend on every call site of each denoiser, with its probes
    (``runner.kernels.attention.install``); each site expects the family's dispatcher calls per forward
    (``engine.site_calls_per_forward``); with several experts each site knows its expert (it runs once per
    forward of that expert)."""

    name = "attention"

    def install(self, sections: Dict[str, Any]) -> None:
        from runner.kernels import attention

        e = self.engine
        e.probes["attention"] = attention.install(e.stage, e.attention_sites(), e.resolutions["attention"].selected,
                                                  e.ctx.plat.sm, observe=e.observe)
        names = [x for x, _ in e.experts()]
        mods = {layer: mod for _, layer, mod in e.attention_sites()}
        for site in e.probes["attention"]:
            n = e.site_calls_per_forward(site.layer, mods.get(site.layer))
            if n != 1:  # the family's rule (Wan 2.1 I2V: image and text cross-attention, two calls)
                site.per_forward = n
            if len(names) > 1:
                site.expert = next((x for x in names[1:] if site.layer.startswith(f"{x}.")), names[0])


class MoePass(Pass):
    """The MoE backend on every MoE block when the family has them (``"moe"`` in the engine's ``backend_fields``;
    ``runner.kernels.moe.install`` over the family's ``moe_blocks()`` and ``moe_layout()``); the routed experts'
    Linears are then the MoE backend's (:meth:`owned_linears`)."""

    name = "moe"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.owned: Tuple[str, ...] = ()

    def install(self, sections: Dict[str, Any]) -> None:
        e = self.engine
        if "moe" not in e.backend_fields:
            return
        from runner.kernels import moe

        blocks, layout = list(e.moe_blocks()), e.moe_layout()
        e.probes["moe"] = {"resolved": e.resolutions["moe"].selected,
                           "sites": moe.install(blocks, layout, e.resolutions["moe"].selected, observe=e.observe)}
        self.owned = tuple(f"{name}.{p}" for name, b in blocks for p in layout.expert_linears(b))

    def owned_linears(self) -> Tuple[str, ...]:
        return self.owned


class LinearPass(Pass):
    """The linear backend on the blocks of each denoiser, except the Linears another pass owns (the MoE backend's,
    unfused LoRA branches: :meth:`models.passes.Pass.owned_linears`), counted into one record
    (``runner.kernels.linear``); with several experts ``probes["expert_linears"]`` holds each one's module count
    (the evidence expects them per forward of that expert). Installed after the passes that own Linears."""

    name = "linear"

    def install(self, sections: Dict[str, Any]) -> None:
        from runner.kernels import linear

        e = self.engine
        excluded = tuple(x for p in e.passes for x in p.owned_linears())
        rec, per = None, {}
        for name, mod in e.experts():
            before = rec.modules if rec is not None else 0
            rec = linear.install(mod, e.resolutions["linear"].selected, prefixes=e.fp8_prefixes, observe=e.observe,
                                 exclude=excluded, record=rec, device=e.device)
            per[name] = rec.modules - before
        e.probes["linear"] = rec
        if len(per) > 1:
            e.probes["expert_linears"] = per


class BackendSelection:
    """The stage's backends resolved under the precedence contract and checked against the platform
    (``runner.core.resolve.resolve_stage``), ``moe=auto`` chosen by measurement; a part of
    :class:`models.diffusers_engine.DiffusersEngine` (its ``ctx``, ``stage``, ``backend_fields``, ``needs_mask``,
    ``head_dim()``, ``reads_engine_extras``). A family with MoE layers provides ``moe_blocks()``, ``moe_layout()``,
    ``moe_dims()`` and ``moe_probe()``."""

    def resolve_backends(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Resolve the stage's backends under the precedence contract and check they can run here; ``moe=auto``
        on a stage with MoE layers then chooses by measurement (:meth:`choose_moe_by_measurement`).

        Returns:
            ``({field: FieldResolution}, engine_extras)`` of the stage.

        Raises:
            runner.kernels.registry.BackendError subclasses, naming the field, the value, the reason and the fix (a
            field outside ``backend_fields`` set to a backend: ``StageConflictError`` naming the model).
        """
        from runner.kernels.attention import plan
        from runner.kernels.registry import SelectionContext, wired
        from runner.core.resolve import LEGACY_KEYS, MisplacedBackendKeyError, StageInfo, check_placement, cli_keys, resolve_stage

        plat = self.ctx.plat
        pipeline = getattr(self.ctx.run.model, "pipeline", None) or []
        check_placement(self.ctx.cfg, stages=[self.stage, *[s for s in pipeline if s != self.stage]])
        lay = self.ctx.parallel
        sel = SelectionContext(platform_kind=plat.kind, sm=plat.sm, dtype=self.dtype, head_dim=self.head_dim(),
                               needs_mask=self.needs_mask, sequence_parallel=lay is not None,
                               ring_attention=lay is not None and lay.ring > 1,
                               moe_dims=self.moe_dims() if "moe" in self.backend_fields else None)
        info = StageInfo(name=self.stage, roles=list(self.model_cfg.roles), fields=self.backend_fields, ctx=sel,
                         wired={"attention": wired("attention", "diffusers"), "moe": wired("moe", "diffusers")},
                         model=str(self.model_cfg.name))
        resolutions, extras = resolve_stage(self.ctx.cfg, cli_keys(self.ctx.overrides), info)
        if "moe" in self.backend_fields and resolutions["moe"].resolved == "auto":
            self.choose_moe_by_measurement(resolutions["moe"], sel)
        for spec in resolutions["attention"].selected.values():  # wiring problems surface now, not after loading
            plan(spec["backend"], plat.sm)
        if extras and not self.reads_engine_extras:
            import difflib

            key = sorted(extras)[0]
            close = difflib.get_close_matches(key, list(LEGACY_KEYS.values()), n=1)
            raise MisplacedBackendKeyError(
                f"model.stages.{self.stage}.engine_extras.{key} is not read: the {self.stage!r} stage's engine "
                f"(diffusers) takes no engine_extras" + (f"; did you mean the legacy key {close[0]!r}?" if close else
                                                          "; fix: remove it"))
        return resolutions, extras

    def choose_moe_by_measurement(self, res: Any, sel: Any) -> None:
        """``moe=auto`` on a stage with MoE layers: where more than one wired MoE backend can run here, time each
        on one MoE block of the model's shape (:meth:`moe_probe`; ``runner.kernels.moe.time_block``: the router and the
        shared expert included, median of 5 calls after 2 warm-up calls) and select the fastest; the reason records
        the device, the shape and every timing. With one candidate (CPU: only ``TORCH``) nothing is timed and the
        reason says why the others cannot run. A candidate that raises while timed is skipped, with its error in
        the reason. Under ``parallelism=data`` nothing is timed (every worker must select the same backend, and
        timings differ between processes): the ranked choice stays, and the reason says so. Mutates ``res``
        (``selected``, ``reason``)."""
        from runner.kernels import moe
        from runner.kernels import registry as reg

        cands = moe.auto_candidates(sel)
        if len(cands) < 2:
            res.reason = f"the only MoE backend that can run here: {res.reason}"
            return
        if str(self.ctx.run.parallelism.mode) == "data":
            res.reason = (f"ranked first of {', '.join(cands)} (not timed: under parallelism=data every worker must "
                          f"select the same backend): {res.reason}")
            return
        devices = [torch.device(self.device).index or 0] if str(self.device).startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            block, x, shape = self.moe_probe()
            times, failed = moe.time_candidates(block, self.moe_layout(), x, cands)
            del block, x
        if not times:
            raise reg.BackendUnavailableError(f"auto found no MoE backend that runs the model's MoE block here: "
                                              + "; ".join(f"{k}: {v}" for k, v in failed.items()))
        best = min(times, key=times.__getitem__)
        res.selected = best
        res.reason = (f"measured at startup on {self.device} ({shape}, {str(self.dtype).replace('torch.', '')}, "
                      "median of 5 calls after 2 warm-up calls, router and shared expert included): "
                      + ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(times.items(), key=lambda kv: kv[1]))
                      + "".join(f", {k} failed ({v})" for k, v in failed.items())
                      + f"; {best} is the fastest")

    def moe_blocks(self) -> Iterator[Tuple[str, torch.nn.Module]]:
        """``(layer name, block)`` of every MoE block of the loaded denoiser (names relative to it); none by
        default."""
        return iter(())

    def moe_layout(self) -> Any:
        """The family's ``runner.kernels.moe.ExpertsLayout`` (where its MoE blocks keep router, experts, shared expert).

        Raises:
            NotImplementedError: the family declares no MoE layers.
        """
        raise NotImplementedError(f"{type(self).__name__} has no MoE layers")

    def moe_dims(self) -> Optional[Tuple[int, int]]:
        """``(H, I)`` of the denoiser's routed experts from the model's configs (no weights), for the MoE backends'
        shape requirements; None (unknown) by default."""
        return None

    def moe_probe(self) -> Tuple[torch.nn.Module, torch.Tensor, str]:
        """One randomly initialised MoE block of the model's shape on the stage's device and dtype, an input of the
        tokens one MoE call sees at the configured generation size, and a description of the shape (for
        :meth:`choose_moe_by_measurement`); reads the model's configs only, no weights.

        Raises:
            NotImplementedError: the family declares no MoE layers.
        """
        raise NotImplementedError(f"{type(self).__name__} has no MoE layers")

    def backends_section(self) -> Dict[str, Any]:
        """``backends.<stage>``: per field, what was requested, its layer, the canonical and selected names."""
        return {f: r.to_dict() for f, r in self.resolutions.items()}


class AttentionSites:
    """The attention call sites of a diffusers pipeline's denoisers and what decides their backend before loading
    (every site must call diffusers' dispatcher); a part of :class:`models.pipelines.PipelineEngine` (its ``spec``,
    ``cfg``, ``experts()``, ``component_class()``)."""

    def prepare_attention(self) -> None:
        """After loading, before backends are installed: the spec's ``attention_processor`` (a processor that routes
        the attention through diffusers' dispatcher, e.g. SD3's) on every attention module; nothing without one."""
        if self.spec is None or not self.spec.attention_processor:
            return
        mod_name, _, attr = self.spec.attention_processor.partition(":")
        proc_cls = getattr(importlib.import_module(mod_name), attr)
        for _, expert in self.experts():
            for _, mod in attention_modules(expert):
                mod.set_processor(proc_cls())

    def attention_role(self, layer: str) -> str:
        """The role (``model.roles``) of the attention module at ``layer``: by the spec's layer-name suffixes
        (:meth:`models.family.FamilySpec.role`), else the model's first role."""
        roles = tuple(str(r) for r in self.cfg.roles)
        return self.spec.role(layer, roles) if self.spec is not None else roles[0]

    def attention_sites(self) -> Iterator[Tuple[str, str, Any]]:
        """Yield ``(role, layer_name, attention_module)`` for every attention call site of the transformer (of every
        expert: a later expert's layer names start with its component, ``transformer_2.blocks.0.attn1``).

        Raises:
            ConfigValueError: a site whose processor does not call diffusers' dispatcher (its backend can be
                neither chosen nor observed), naming the model and the module.
        """
        for i, (expert, model) in enumerate(self.experts()):
            for name, mod in attention_modules(model):
                name = name if i == 0 else f"{expert}.{name}"  # the first expert's names as a one-expert model's
                if not uses_dispatcher(mod):
                    raise ConfigValueError(
                        f"model={self.cfg.name}: attention module {name} ({type(mod.processor).__name__}) does not "
                        "call diffusers' attention dispatcher, so its backend can be neither selected nor observed; "
                        f"fix: a model family whose transformer uses the dispatcher ({', '.join(family_names())})")
                yield self.attention_role(name), name, mod

    def dispatches(self) -> bool:
        """The transformer's attention goes through diffusers' dispatcher, decided before loading: the spec installs
        a dispatching processor (SD3, HiDream), else :func:`module_dispatches` on the transformer class."""
        if self.spec is not None and self.spec.attention_processor:
            return True
        import diffusers

        cls = getattr(diffusers, self.component_class("transformer"), None)
        return cls is not None and module_dispatches(cls)

    def resolve_backends(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """The base resolution, then: a transformer that does not use diffusers' dispatcher takes no explicit
        attention backend (refused, naming the model).

        Raises:
            runner.kernels.registry.BackendError subclasses; ConfigValueError for a non-dispatching transformer.
        """
        if "attention" in self.backend_fields and not self.dispatches():
            raise ConfigValueError(
                f"model={self.cfg.name}: its transformer ({self.component_class('transformer')}) does not call "
                "diffusers' attention dispatcher, so no attention backend can be selected or observed in it; fix: "
                f"a model family whose transformer uses the dispatcher ({', '.join(family_names())})")
        resolutions, extras = super().resolve_backends()
        return resolutions, extras
