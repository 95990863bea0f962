"""The backend installs of a diffusion stage as passes (:mod:`models.passes`): the attention, MoE and linear
backends the stage resolved (``engine.resolutions``, under the precedence contract) installed on each denoiser
(``engine.experts()``) with their probes, which the stage's evidence reads (``engine.probes``:
:func:`models.denoiser_evidence.build`). Selection is not here (``runner.core.resolve``, ``runner.kernels.registry``):
these passes install what was selected.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from models.passes import Pass


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
