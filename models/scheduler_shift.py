"""``model.generation.shift``: a static timestep shift on the pipeline's flow-matching scheduler, applied, read back
and checked.

A flow-matching schedule's sigmas ``u`` in (0, 1] (FLUX, Qwen-Image: ``linspace(1, 1/n, n)``; a flow-sigma UniPC,
Wan's: ``1 - linspace(1, 1/T, n + 1)[:-1]`` reversed) become ``s * u / (1 + (s - 1) * u)`` under the static shift
``s`` (diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps`` without dynamic shifting,
``UniPCMultistepScheduler`` with ``use_flow_sigmas``). The families' own rules differ: FLUX and Qwen-Image shift
dynamically by the image's token count (``mu`` from ``calculate_shift``; Qwen-Image also stretches to
``shift_terminal``), Wan applies ``flow_shift``. A few-step distilled adapter is trained at one static shift
(Qwen-Image-Lightning's scheduler config: ``base_shift = max_shift = log 3`` with exponential time shift, which is the
static shift 3, and ``shift_terminal`` None; Wan 2.2 Lightning: shift 5), so ``shift`` replaces the family's rule:

* ``flow_match`` (a config with ``use_dynamic_shifting``: ``FlowMatchEulerDiscreteScheduler``): ``shift=s``,
  ``use_dynamic_shifting=False``, ``shift_terminal=None`` (the pipeline's ``mu`` is then unused);
* ``flow_sigmas`` (a config with ``flow_shift`` and ``use_flow_sigmas``): ``flow_shift=s``.

Any other scheduler has no flow shift: a chosen value is refused at startup (exit 2; every value is chosen while no
model YAML sets one: ``runner.core.resolve.user_chose``), a model's own is recorded as ignored. After each pipeline
call the scheduler's ``sigmas`` (what ``set_timesteps`` produced for that call) are read back into each item's
``scheduler`` record; the evidence (``evidence.stages.<stage>.scheduler``) checks that un-shifting them by ``s``
gives the families' unshifted schedule (evenly spaced from 1, :func:`schedule_problem`) and that the scheduler is
still the one installed. A schedule another shift produced fails that (exit 3).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence

from models.passes import Pass
from runner.core.errors import ConfigValueError

log = logging.getLogger("runner")

#: Tolerance of the evidence's check on un-shifted sigmas: a flow-sigma UniPC's schedule ends at ``1/n + 1/T``-ish
#: (``linspace(1, 1/T, n + 1)``, T = 1000 training timesteps: 0.2507 for 0.25 at 4 steps), float32 sigmas ~1e-7.
SPACING_TOL = 2e-3


def shift_kind(conf: Dict[str, Any]) -> Optional[str]:
    """How a scheduler config takes a static shift: ``flow_sigmas`` (a ``flow_shift`` with ``use_flow_sigmas``: UniPC
    and DPM-Solver++ with flow sigmas, which also have a ``use_dynamic_shifting`` that is off), ``flow_match`` (a
    ``shift`` beside ``use_dynamic_shifting``, or the class ``FlowMatchEulerDiscreteScheduler``) or None."""
    if "flow_shift" in conf and conf.get("use_flow_sigmas"):
        return "flow_sigmas"
    if ("shift" in conf and "use_dynamic_shifting" in conf
            or str(conf.get("_class_name")) == "FlowMatchEulerDiscreteScheduler"):
        return "flow_match"
    return None


def shifted_config(conf: Dict[str, Any], shift: Optional[float], kind: Optional[str] = None) -> Dict[str, Any]:
    """The scheduler config ``conf`` with the static ``shift`` applied (module docstring); ``conf`` unchanged for
    None. ``kind``: :func:`shift_kind` of the scheduler (default: of ``conf``).

    Raises:
        ValueError: the scheduler takes no flow shift (:func:`shift_kind` None).
    """
    if shift is None:
        return dict(conf)
    kind = kind or shift_kind(conf)
    if kind == "flow_match":
        return {**conf, "shift": float(shift), "use_dynamic_shifting": False, "shift_terminal": None}
    if kind == "flow_sigmas":
        return {**conf, "flow_shift": float(shift)}
    raise ValueError(f"scheduler {conf.get('_class_name') or '?'} has no flow shift")


def unshift(sigmas: Sequence[float], shift: float) -> List[float]:
    """The inverse of the static shift: ``u = s' / (s - (s - 1) s')`` of each sigma ``s'``."""
    return [x / (shift - (shift - 1) * x) for x in sigmas]


def schedule_problem(sigmas: Sequence[float], steps: int, shift: float, train_steps: int = 1000) -> Optional[str]:
    """What is wrong with ``sigmas`` (the scheduler's, ``steps`` + 1 values with the final one) as a schedule of
    ``steps`` steps at the static ``shift``: None when its first ``steps`` values, un-shifted (:func:`unshift`), are
    evenly spaced from 1 to ``1/steps`` (the ``sigmas`` FLUX's, Qwen-Image's, Z-Image's pipelines pass; a flow-sigma
    UniPC's, Wan's) or to ``1/train_steps`` (a ``FlowMatchEulerDiscreteScheduler`` given no sigmas, SD3's: its
    shifted ``sigma_min``), within :data:`SPACING_TOL`."""
    head = [float(x) for x in sigmas[:steps]]
    if len(head) < steps or not head:
        return f"{len(sigmas)} sigmas for {steps} steps"
    u = unshift(head, shift)
    wants = [[1.0 - i * (1.0 - end) / max(steps - 1, 1) for i in range(steps)]
             for end in (1.0 / steps, 1.0 / max(int(train_steps), 1))]
    if all(max(abs(a - b) for a, b in zip(u, want)) > SPACING_TOL for want in wants):
        return (f"sigmas {[round(x, 5) for x in head]} un-shifted by {shift:g} are {[round(x, 5) for x in u]}, not "
                f"the evenly spaced {[round(x, 5) for x in wants[0]]} (or to {wants[1][-1]:g}): another shift made "
                "them")
    return None


class ShiftPass(Pass):
    """``model.generation.shift`` (module docstring): checked at startup, applied to the loaded pipeline's scheduler,
    the sigmas each call used recorded per item and checked in the evidence."""

    name = "shift"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.shift: Optional[float] = None       # the shift applied (None: none, or ignored)
        self.kind: Optional[str] = None
        self.ignored: Optional[Dict[str, Any]] = None
        self.installed: Any = None               # the scheduler put on the pipeline
        self.calls: List[Dict[str, Any]] = []    # per call: steps, sigmas read back
        self.by_item: Dict[str, Dict[str, Any]] = {}

    @property
    def value(self) -> Optional[float]:
        g = self.engine.cfg.generation
        return getattr(g, "shift", None)

    def check_config(self) -> None:
        """``model.generation.shift`` null or a finite number > 0.

        Raises:
            ConfigValueError: naming the key, the value and the fix.
        """
        s = self.value
        if s is not None and (not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0):
            raise ConfigValueError(f"model.generation.shift={s} must be a finite number > 0 (the static timestep "
                                   "shift); fix: e.g. model.generation.shift=3.0, or null for the model's own")

    def prepare(self) -> None:
        """Whether the weight source's scheduler takes a flow shift (its config, no weights).

        Raises:
            ConfigValueError: it takes none and the user chose the value (``runner.core.resolve.user_chose``), naming
                the scheduler and the fix; the model's own value is recorded as ignored instead.
        """
        s = self.value
        if s is None:
            return
        conf = self.engine.component_config("scheduler") or {}
        cls = conf.get("_class_name") or self._component_class()  # an architecture's config names no class
        self.kind = shift_kind({"_class_name": cls, **conf})
        if self.kind is not None:
            self.shift = float(s)
            return
        why = (f"model={self.engine.cfg.name}'s scheduler ({cls}) has no flow-matching shift (a shift or a "
               "flow_shift with use_flow_sigmas), so the value would change nothing")
        if self.engine.chosen("model.generation.shift", s):
            raise ConfigValueError(f"model.generation.shift={s} is ignored by model={self.engine.cfg.name}: {why}; "
                                   "fix: model.generation.shift=null")
        self.ignored = {"value": s, "why": why}
        log.warning("model.generation.shift=%s is recorded as ignored: %s", s, why)

    def _component_class(self) -> str:
        try:
            return str(self.engine.component_class("scheduler"))
        except Exception:  # noqa: BLE001 - a name for the message only
            return "unknown scheduler"

    def install(self, sections: Dict[str, Any]) -> None:
        """Replace the pipeline's scheduler by one of its class at the shifted config (:func:`shifted_config`)."""
        if self.shift is None:
            return
        pipe = self.engine.pipe
        old = pipe.scheduler
        conf = shifted_config(dict(old.config), self.shift, self.kind)
        self.installed = type(old).from_config({k: v for k, v in conf.items() if not k.startswith("_")})
        pipe.scheduler = self.installed

    def after_pipe(self, batch: Sequence[Any], kwargs: Dict[str, Any], outputs: List[Any]) -> List[Any]:
        """Read the sigmas the scheduler used in this call back (its ``sigmas`` after ``set_timesteps``)."""
        if self.shift is None:
            return outputs
        sched = self.engine.pipe.scheduler
        sig = getattr(sched, "sigmas", None)
        sig = [round(float(x), 6) for x in sig] if sig is not None else []
        call = {"steps": int(kwargs.get("num_inference_steps") or 0), "sigmas": sig,
                "same_scheduler": sched is self.installed}
        self.calls.append(call)
        for it in batch:
            self.by_item[it.key] = {"shift": self.shift, "sigmas": sig}
        return outputs

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """``shift`` as applied (null: the model's own schedule), in each item's ``params`` while one is set."""
        return {"shift": self.shift} if self.value is not None else {}

    def record(self, item: Any) -> Dict[str, Any]:
        """The item's ``scheduler``: the shift and the sigmas its call used, read from the scheduler."""
        rec = self.by_item.get(item.key)
        return {"scheduler": rec} if rec is not None else {}

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        """``section["scheduler"]``: the shift, the scheduler class, each distinct schedule read back and its check
        (:func:`schedule_problem`); mismatches for a schedule another shift made or a scheduler swapped out."""
        if self.value is None:
            return []
        if self.shift is None:
            section["scheduler"] = {"shift": None, "ignored": self.ignored}
            return []
        seen: Dict[str, Dict[str, Any]] = {}
        problems: List[str] = []
        for c in self.calls:
            key = repr((c["steps"], c["sigmas"]))
            if key in seen:
                continue
            why = schedule_problem(c["sigmas"], c["steps"], self.shift,
                                   int(self.installed.config.get("num_train_timesteps", 1000)))
            if not c["same_scheduler"]:
                why = "the pipeline's scheduler was replaced after the shift was installed"
            seen[key] = {"steps": c["steps"], "sigmas": c["sigmas"], "check": "verified" if why is None else why}
            if why is not None:
                problems.append(f"scheduler: model.generation.shift={self.shift:g} did not act: {why}")
        section["scheduler"] = {"shift": self.shift, "kind": self.kind,
                                "class": type(self.installed).__name__ if self.installed is not None else None,
                                "schedules": list(seen.values()),
                                "verdict": "verified" if seen and not problems else
                                ("mismatch" if problems else "not_observed")}
        return problems
