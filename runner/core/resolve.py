"""Backend resolution: the precedence contract, stage by stage and field by field.

For each stage and field (``attention``, ``linear``, ``moe``) the value comes from the first layer that sets it,
highest first:

====  ====================  ==========================================================================
 1    ``cli_stage``         CLI override of ``model.stages.<stage>.backend.<field>``
 2    ``cli_run``           CLI override of ``backend.<field>``
 3    ``yaml_stage``        ``model.stages.<stage>.backend.<field>`` from YAML (model file, experiment preset)
 4    ``yaml_run``          ``backend.<field>`` from YAML (backend group, experiment preset)
 4b   ``engine_extras``     legacy ``model.stages.<stage>.engine_extras.<field>_backend`` (after the platform
                            overlay's ``engine_extras`` merged into it): a user setting, so it beats the layers
                            below, but it loses to every first-class field above
 5    ``platform_overlay``  ``platform.overlays.<model>.backend.<field>``
 6    ``model_default``     ``model.backend.<field>``
 7    ``auto``              nothing set anywhere
====  ====================  ==========================================================================

Unset is ``None``; an explicit ``auto`` is a value like any other and is kept (``explicit: true``). Hydra's
merged config cannot say who set a value, so CLI layers are told apart from YAML by the task overrides.

After resolution the legacy keys are removed from the stage's ``engine_extras`` so no engine can read them later.
A warning is issued only when a legacy key and the winning first-class value differ after normalization.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from runner.kernels import registry as reg

log = logging.getLogger("runner.core.resolve")

LEGACY_KEYS = {"attention": "attention_backend", "moe": "moe_backend", "linear": "linear_backend"}
BACKEND_KEYS = set(reg.FIELDS) | set(LEGACY_KEYS.values())
def _config_groups() -> List[str]:
    from runner.core.paths import CONF_DIR

    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


CONFIG_GROUPS = _config_groups()
LAYERS = ("cli_stage", "cli_run", "yaml_stage", "yaml_run", "engine_extras", "platform_overlay", "model_default",
          "auto")


class MisplacedBackendKeyError(reg.BackendError):
    """A backend key where nothing reads it; the message says where it belongs."""


_BACKEND_STEMS = (("attention", ("attention", "attn", "sdpa")), ("moe", ("moe",)), ("linear", ("linear",)))


def backend_field_of(name: str, loose: bool = False) -> Optional[str]:
    """The backend field (``attention``, ``moe``, ``linear``) a key name stands for, or None.

    Strict: the field's name or an abbreviation, alone or with ``_backend``/``_impl`` (``attention``,
    ``attention_backend``, ``attn_backend``, ``attn``, ``moe_backend``, ``linear_impl``...). ``loose`` also takes
    any ``_``-separated word of the name (``attention_kernel``): for keys no schema knows anyway.
    """
    n = str(name).lower().replace("-", "_")
    words = n.split("_")
    for fld, stems in _BACKEND_STEMS:
        for stem in stems:
            if n in (stem, f"{stem}_backend", f"{stem}_backends", f"{stem}_impl", f"{stem}backend",
                     f"backend_{stem}") or (loose and stem in words):
                return fld
    return None


def misplaced_backend_message(key: str, value: Any = None, stages: Sequence[str] = ()) -> Optional[str]:
    """The message for a backend-like key ``key`` (dotted) placed where nothing reads it: where the field belongs
    (run level, one stage, the model's default) and the fix; None when ``key``'s last part is not backend-like or
    ``key`` already is a backend place.

    Args:
        stages: the model's stage names (one of them stands in for ``<stage>`` when there is only one).
    """
    parts = key.split(".")
    fld = backend_field_of(parts[-1], loose=True)
    if fld is None or (len(parts) >= 2 and parts[-2] == "backend"):
        return None
    stage = (parts[2] if len(parts) > 3 and parts[:2] == ["model", "stages"] else
             stages[0] if len(stages) == 1 else "<stage>")
    shown = "" if value is None or isinstance(value, (dict, list)) else f"={value}"
    return (f"{key} is not read: the {fld} backend is chosen with backend.{fld} (the whole run), "
            f"model.stages.{stage}.backend.{fld} (one stage) or model.backend.{fld} (the model's default); "
            f"fix: backend.{fld}{shown or '=<name>'} or model.stages.{stage}.backend.{fld}{shown or '=<name>'}")


class StageConflictError(reg.BackendError):
    """A run-level backend value that a stage cannot honour (and the stage sets no value of its own)."""


class BackendConflictWarning(UserWarning):
    """A legacy ``engine_extras`` key differs from the first-class value that wins."""


@dataclass
class StageInfo:
    """What resolution needs to know about a stage.

    Attributes:
        name: stage name (``denoise``).
        roles: attention roles its model declares (FLUX: ``joint``).
        fields: fields the stage's engine can use (FLUX: attention, linear; no MoE layers).
        ctx: capability-check context (platform, dtype, head_dim, mask, sequence parallelism).
        wired: per field, the backends the stage's engine has wiring for; ``auto`` only chooses among them.
        model: the stage's model name (``model.name`` of the stage), named when a field has nothing to run on
            (``backend.moe=TRITON`` on a model without MoE layers).
    """

    name: str
    roles: Sequence[str]
    fields: Sequence[str]
    ctx: reg.SelectionContext
    wired: Optional[Dict[str, Sequence[str]]] = None  # field -> backends the engine can run (auto picks among them)
    names: Optional[Any] = None  # an engine with its own backend names (vLLM): see EngineNames
    model: Optional[str] = None


class EngineNames:
    """Interface of an engine that owns its backend names (an AR stage through vLLM: ``models.vllm.names``).

    When a :class:`StageInfo` carries one, the precedence layers and provenance are resolved exactly as for the
    runner's own backends, but names are normalized, checked and auto-selected by the engine instead of
    ``runner.kernels.registry``.
    """

    engine = "engine"

    def canonical(self, fld: str, value: Any, where: str) -> str:
        """The engine's canonical name of ``value`` (``auto`` stays ``auto``). Raises UnknownBackendError."""
        raise NotImplementedError

    def check(self, fld: str, name: str, where: str) -> None:
        """Fail closed before the engine starts. Raises BackendUnavailableError naming the reason."""
        raise NotImplementedError

    def auto(self, fld: str) -> Tuple[str, str]:
        """``(selected, reason)`` for ``auto``."""
        raise NotImplementedError


@dataclass
class FieldResolution:
    """Resolution of one (stage, field): manifest section ``backends.<stage>.<field>``.

    ``resolved`` is the canonical backend (``linear``/``moe``) or ``{role: {backend, quant, skip_softmax}}``
    (attention). ``selected`` is the implementation that will run, per role for attention.
    """

    stage: str
    field: str
    requested: Any
    layer: str
    explicit: bool
    resolved: Any = None
    selected: Any = None
    reason: Optional[str] = None
    legacy: Optional[Dict[str, Any]] = None
    warnings: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _plain(x: Any) -> Any:
    return OmegaConf.to_container(x, resolve=True) if OmegaConf.is_config(x) else x


def cli_keys(overrides: Iterable[str], groups: Iterable[str] = ()) -> List[str]:
    """Config keys set by CLI overrides (``+``/``++``/``~`` prefixes removed), via Hydra's own parser.

    Args:
        groups: config group names (``backend``, ``model``...). ``backend=<preset>`` selects a YAML file, which is
            YAML content, not a CLI value, so group selections are left out; a dict for a group's node
            (``backend={attention: cudnn}``, merged by Hydra like ``backend.attention=cudnn``) is a CLI value.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = set(groups) or set(CONFIG_GROUPS)
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return [o.key_or_group for o in parsed
            if not (o.key_or_group in groups and o.package is None and not isinstance(o.value(), dict))]


def user_chose(overrides: Iterable[str], model_name: str, key: str, value: Any) -> bool:
    """Whether ``key`` (``model.<...>``) = ``value`` is the user's choice rather than the model's own default: set
    by a CLI override (:func:`cli_keys`), or a value other than the one the model's YAML
    (``conf/model/<model_name>.yaml``) gives it (a user's own YAML: an experiment). A model without a YAML here
    (a config from another search path) counts every value as chosen."""
    from runner.core.paths import CONF_DIR

    if _set_by(cli_keys(overrides), key):
        return True
    yaml = CONF_DIR / "model" / f"{model_name}.yaml"
    default = OmegaConf.select(OmegaConf.load(yaml), key[len("model."):]) if yaml.is_file() else None
    return default is None or default != value


def _set_by(keys: Sequence[str], key: str) -> bool:
    """True when a CLI key sets ``key``, one of its children, or a parent node that contains it."""
    return any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in keys)


def drop_default_stages(cfg: DictConfig, keep: Sequence[str]) -> DictConfig:
    """A copy of ``cfg`` without schema-default stages that are not the model's (the structured schema gives every
    model a ``denoise`` stage); a stage the user configured is kept, so :func:`check_placement` names it. ``cfg``
    itself when there is nothing to drop. (An AR model's engine hands its ``ctx.cfg`` through this to
    :func:`check_placement` and :func:`resolve_stage`, reading nothing of it itself.)"""
    from runner.core.schema import StageConfig

    default = OmegaConf.to_container(OmegaConf.structured(StageConfig), resolve=True)
    stages = _plain(cfg.model.stages) or {}
    drop = [s for s, v in stages.items() if s not in keep and v == default]
    if not drop:
        return cfg
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for s in drop:
        del c.model.stages[s]
    return c


def check_placement(cfg: DictConfig, stages: Optional[Sequence[str]] = None) -> None:
    """Reject backend keys placed where nothing reads them.

    Args:
        stages: the stage names the model's engine has; settings under any other stage name are never read.

    Raises:
        MisplacedBackendKeyError: e.g. ``model.architecture.attention`` (belongs under ``model.backend`` or
        ``model.stages.<stage>.backend``), a first-class name inside ``engine_extras``, a stage the model does not
        have, or an unknown key in a platform overlay.
    """
    model = cfg.model
    if stages is not None:
        for sname in (model.stages or {}):
            if sname not in stages:
                import difflib

                close = difflib.get_close_matches(sname, list(stages), n=1)
                raise MisplacedBackendKeyError(
                    f"model.stages.{sname}: model {model.name} has no stage {sname!r}, so nothing reads it; its "
                    f"stages: {', '.join(stages)}" + (f"; did you mean {close[0]!r}?" if close else ""))
    for key in ("attention", "linear", "moe"):
        if model.get(key) is not None:
            raise MisplacedBackendKeyError(
                f"model.{key} is not read: backend choices belong under model.backend.{key} (the model's "
                f"default) or model.stages.<stage>.backend.{key}; fix: move it there")
    for key in _plain(model.architecture) or {}:
        if key in BACKEND_KEYS or backend_field_of(key):
            raise MisplacedBackendKeyError(misplaced_backend_message(f"model.architecture.{key}")
                                           + " (legacy: model.stages.<stage>.engine_extras.<field>_backend)")
    for sname, stage in (model.stages or {}).items():
        for key in ("attention", "linear", "moe"):
            if stage.get(key) is not None:
                raise MisplacedBackendKeyError(
                    f"model.stages.{sname}.{key} is not read; fix: model.stages.{sname}.backend.{key}")
        for key in (stage.engine_extras or {}):
            if key in reg.FIELDS:
                raise MisplacedBackendKeyError(
                    f"model.stages.{sname}.engine_extras.{key} is not read; fix: model.stages.{sname}.backend.{key} "
                    f"(or the legacy key engine_extras.{LEGACY_KEYS[key]})")
    for mname, overlay in (cfg.platform.overlays or {}).items():
        for key in (overlay or {}):
            if key not in ("backend", "engine_extras"):
                fld = backend_field_of(key, loose=True)
                raise MisplacedBackendKeyError(
                    f"platform.overlays.{mname}.{key} is not read; an overlay takes `backend: {{attention, linear, "
                    f"moe}}` and `engine_extras: {{...}}`"
                    + (f"; fix: platform.overlays.{mname}.backend.{fld}" if fld else ""))
        for key in ((overlay or {}).get("backend") or {}):
            if key not in reg.FIELDS:
                fld = backend_field_of(key, loose=True)
                raise MisplacedBackendKeyError(
                    f"platform.overlays.{mname}.backend.{key} is not read; an overlay's backend takes "
                    f"{', '.join(reg.FIELDS)}" + (f"; fix: platform.overlays.{mname}.backend.{fld}" if fld else ""))
        for key in ((overlay or {}).get("engine_extras") or {}):
            if key in reg.FIELDS:
                raise MisplacedBackendKeyError(
                    f"platform.overlays.{mname}.engine_extras.{key} is not read; fix: "
                    f"platform.overlays.{mname}.backend.{key} (or the legacy key engine_extras.{LEGACY_KEYS[key]})")


def override_hints(argv: Sequence[str]) -> List[str]:
    """For a command line Hydra refused: where each backend-like key that is not a backend place belongs
    (``model.attention_backend=sdpa`` -> ``backend.attention``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hints = []
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        try:
            o = OverridesParser.create().parse_override(arg)
            key, value = o.key_or_group, o.value()
        except Exception:  # noqa: BLE001 - Hydra has already said what is wrong with it
            continue
        msg = misplaced_backend_message(key, value if isinstance(value, (str, int, float)) else None)
        if msg:
            hints.append(msg)
    return hints


def _normalize_attention(value: Any, roles: Sequence[str], where: str) -> Dict[str, Dict[str, Any]]:
    """Turn a name or a ``{default, per_role}`` spec into ``{role: {backend, quant, skip_softmax}}``."""
    def spec(v: Any, w: str) -> Dict[str, Any]:
        if isinstance(v, str):
            return {"backend": reg.normalize("attention", v, w), "quant": None, "skip_softmax": None}
        if isinstance(v, dict):
            unknown = set(v) - {"backend", "quant", "skip_softmax"}
            if unknown:
                raise reg.BackendSpecError(f"{w}: unknown key(s) {sorted(unknown)}; a spec takes backend, quant, "
                                           "skip_softmax")
            if "backend" not in v:
                raise reg.BackendSpecError(f"{w}: a spec needs `backend`")
            return {"backend": reg.normalize("attention", v["backend"], f"{w}.backend"), "quant": v.get("quant"),
                    "skip_softmax": v.get("skip_softmax")}
        raise reg.BackendSpecError(f"{w}={v!r}: expected a backend name or a spec")

    if isinstance(value, dict) and ("default" in value or "per_role" in value):
        unknown = set(value) - {"default", "per_role"}
        if unknown:
            raise reg.BackendSpecError(f"{where}: unknown key(s) {sorted(unknown)}; expected default, per_role")
        default = spec(value.get("default", "auto"), f"{where}.default")
        per_role = value.get("per_role") or {}
        for role in per_role:
            if role not in roles:
                raise reg.BackendSpecError(f"{where}.per_role.{role}: the model has no attention role {role!r}; "
                                           f"its roles: {', '.join(roles)}")
        return {r: (spec(per_role[r], f"{where}.per_role.{r}") if r in per_role else dict(default)) for r in roles}
    s = spec(value, where)
    return {r: dict(s) for r in roles}


def _canonical(fld: str, value: Any, roles: Sequence[str], where: str, names: Optional[EngineNames] = None) -> Any:
    if names is not None:
        return names.canonical(fld, value, where)
    if fld == "attention":
        return _normalize_attention(value, roles, where)
    return reg.normalize(fld, value, where)


def _layers(cfg: DictConfig, cli: Sequence[str], stage: str, fld: str) -> List[Tuple[str, Any]]:
    """Candidate values of (stage, field), highest layer first, skipping layers that do not set it."""
    stage_key = f"model.stages.{stage}.backend.{fld}"
    run_key = f"backend.{fld}"
    stage_val = _plain(OmegaConf.select(cfg, stage_key))
    run_val = _plain(OmegaConf.select(cfg, run_key))
    overlay = _plain(OmegaConf.select(cfg, f"platform.overlays.{cfg.model.name}.backend.{fld}"))
    model_val = _plain(OmegaConf.select(cfg, f"model.backend.{fld}"))
    out: List[Tuple[str, Any]] = []
    if stage_val is not None:
        out.append(("cli_stage" if _set_by(cli, stage_key) else "yaml_stage", stage_val))
    if run_val is not None:
        out.append(("cli_run" if _set_by(cli, run_key) else "yaml_run", run_val))
    out.sort(key=lambda lv: LAYERS.index(lv[0]))
    if overlay is not None:
        out.append(("platform_overlay", overlay))
    if model_val is not None:
        out.append(("model_default", model_val))
    return out


def resolve_stage(cfg: DictConfig, cli: Sequence[str], info: StageInfo) -> Tuple[Dict[str, FieldResolution],
                                                                             Dict[str, Any]]:
    """Resolve every field of one stage and check that what was chosen can run.

    Returns:
        ``({field: FieldResolution}, engine_extras)`` where ``engine_extras`` is the stage's extras after the
        platform overlay merged into it and the legacy backend keys were removed.

    Raises:
        UnknownBackendError, BackendUnavailableError, BackendSpecError, StageConflictError. In a multi-stage
        pipeline, an error about a run-level ``backend.<field>`` names the stage that refused it and the
        per-stage key to use instead.
    """
    try:
        return _resolve_stage(cfg, cli, info)
    except reg.BackendError as e:
        stages = list(OmegaConf.select(cfg, "model.pipeline") or [])
        msg = str(e)
        if len(stages) > 1 and msg.startswith("backend."):
            fld = msg.split("=", 1)[0].split(".")[1]
            raise type(e)(f"stage {info.name!r} of model.pipeline {stages}: {msg}\n(backend.{fld} applies to every "
                          f"stage; to set it for one stage only use model.stages.<stage>.backend.{fld}, e.g. "
                          f"model.stages.{info.name}.backend.{fld})") from None
        raise


def _resolve_stage(cfg: DictConfig, cli: Sequence[str], info: StageInfo) -> Tuple[Dict[str, FieldResolution],
                                                                              Dict[str, Any]]:
    stage_cfg = OmegaConf.select(cfg, f"model.stages.{info.name}")
    extras: Dict[str, Any] = dict(_plain(stage_cfg.engine_extras) if stage_cfg is not None else {})
    overlay_extras = _plain(OmegaConf.select(cfg, f"platform.overlays.{cfg.model.name}.engine_extras")) or {}
    extras = {**extras, **overlay_extras}  # platform overlay merged first ...
    legacy = {f: extras.pop(k) for f, k in LEGACY_KEYS.items() if k in extras}  # ... then removed for good

    out: Dict[str, FieldResolution] = {}
    for fld in reg.FIELDS:
        where_stage = f"model.stages.{info.name}.backend.{fld}"
        layers = _layers(cfg, cli, info.name, fld)
        leg_val = legacy.get(fld)
        leg_canon = None
        if leg_val is not None:
            leg_canon = _canonical(fld, leg_val, info.roles,
                                   f"model.stages.{info.name}.engine_extras.{LEGACY_KEYS[fld]}", info.names)
            idx = next((i for i, (lay, _) in enumerate(layers) if LAYERS.index(lay) > LAYERS.index("engine_extras")),
                       len(layers))
            layers.insert(idx, ("engine_extras", leg_val))
        if layers:
            layer, requested = layers[0]
        else:
            layer, requested = "auto", reg.AUTO
        res = FieldResolution(stage=info.name, field=fld, requested=requested, layer=layer,
                              explicit=layer != "auto")
        where = where_stage if layer in ("cli_stage", "yaml_stage") else (
            f"model.stages.{info.name}.engine_extras.{LEGACY_KEYS[fld]}" if layer == "engine_extras" else
            f"platform.overlays.{cfg.model.name}.backend.{fld}" if layer == "platform_overlay" else
            f"model.backend.{fld}" if layer == "model_default" else f"backend.{fld}")
        canon = _canonical(fld, requested, info.roles, where, info.names)
        res.resolved = canon
        if leg_val is not None:
            res.legacy = {"key": LEGACY_KEYS[fld], "value": leg_val, "normalized": leg_canon,
                          "used": layer == "engine_extras"}
            if layer != "engine_extras" and leg_canon != canon:
                msg = (f"stage {info.name}: engine_extras.{LEGACY_KEYS[fld]}={leg_val!r} (normalized "
                       f"{_short(leg_canon)}) conflicts with {where}={_short(canon)} from layer {layer}; "
                       f"the first-class value wins and the legacy key is dropped")
                res.warnings.append(msg)
                warnings.warn(msg, BackendConflictWarning, stacklevel=2)
        if fld not in info.fields:
            out[fld] = _not_applicable(fld, res, layers, canon, layer, where, where_stage, info)
            continue
        _select(fld, res, canon, where, info)
        out[fld] = res
    return out, extras


def _not_applicable(fld: str, res: FieldResolution, layers: List[Tuple[str, Any]], canon: Any, layer: str,
                    where: str, where_stage: str, info: StageInfo) -> FieldResolution:
    """A field the stage's engine has no layers for: refused when a value other than auto was asked for it
    (naming the key and the fix), else recorded as not applicable.

    Raises:
        StageConflictError: an explicit non-auto value for a field the stage cannot run.
    """
    stage_sets = any(lay in ("cli_stage", "yaml_stage") for lay, _ in layers)
    stage_val = next((v for lay, v in layers if lay in ("cli_stage", "yaml_stage")), None)
    who = f"stage {info.name!r}" + (f" (model={info.model})" if info.model else "")
    none = f"{who} has no {_LABELS.get(fld, fld)} layers"
    if stage_sets:  # the stage's own value governs it: only an explicit non-auto value is an error
        own = _canonical(fld, stage_val, info.roles, where_stage, info.names)
        if _any_not_auto(own):
            raise StageConflictError(f"{where_stage}={_short(own)}: {none}, so no {fld} backend can run "
                                     f"there; fix: remove {where_stage} (or set it to auto)")
        res.selected, res.reason = None, f"not applicable: {none}"
        return res
    if _any_not_auto(canon) and layer in ("cli_run", "yaml_run"):
        raise StageConflictError(
            f"backend.{fld}={_short(canon)} (from {layer}) cannot be honoured: {none}, so its engine runs "
            f"no {fld} backend; fix: drop backend.{fld}, or set {where_stage}=auto")
    if _any_not_auto(canon):
        raise StageConflictError(f"{where}={_short(canon)}: {none}, so no {fld} backend can run there; "
                                 f"fix: remove {where} (or set it to auto)")
    res.selected, res.reason = None, f"not applicable: {none}"
    return res


def _select(fld: str, res: FieldResolution, canon: Any, where: str, info: StageInfo) -> None:
    """Fill ``res.selected`` (and ``res.reason``): the engine's own names choose (vLLM), else ``auto`` through the
    registry's priority, else the named backend checked against the device and the engine's wiring.

    Raises:
        runner.kernels.registry.BackendUnavailableError / BackendSpecError: a named backend that cannot run here.
    """
    if info.names is not None:  # the engine's own names (vLLM): it checks and chooses
        if canon == reg.AUTO:
            res.selected, res.reason = info.names.auto(fld)
        else:
            info.names.check(fld, canon, where)
            res.selected = canon
    elif fld == "attention":
        sel: Dict[str, Dict[str, Any]] = {}
        reasons = {}
        for role, spec in canon.items():
            w = where if len(canon) == 1 else f"{where} (role {role})"
            name = spec["backend"]
            if name == reg.AUTO:
                if spec.get("quant") or spec.get("skip_softmax"):
                    raise reg.BackendSpecError(f"{w}: quant/skip_softmax need a named backend, not auto")
                name, reasons[role] = reg.auto_select("attention", info.ctx, (info.wired or {}).get("attention"))
            else:
                wired = (info.wired or {}).get("attention")
                reg.check("attention", name, info.ctx, where=w, also=[] if wired is None or name in wired else [
                    f"is not wired into the engine of stage {info.name!r} (it runs {', '.join(wired)})"])
            reg.validate_spec(name, spec, w)
            sel[role] = {**spec, "backend": name}
        res.selected = sel
        res.reason = "; ".join(f"{r}: {why}" for r, why in reasons.items()) or None
    else:
        if canon == reg.AUTO:
            res.selected, res.reason = reg.auto_select(fld, info.ctx, (info.wired or {}).get(fld))
        else:
            wired = (info.wired or {}).get(fld)
            reg.check(fld, canon, info.ctx, where=where, also=[] if wired is None or canon in wired else [
                f"is not wired into the engine of stage {info.name!r} (it runs {', '.join(wired)})"])
            res.selected = canon


_LABELS = {"moe": "MoE"}  # how a field's layers are called in messages ("has no MoE layers")


def _any_not_auto(canon: Any) -> bool:
    if isinstance(canon, dict):
        return any(s["backend"] != reg.AUTO for s in canon.values())
    return canon != reg.AUTO


def _short(canon: Any) -> str:
    if isinstance(canon, dict):
        names = {s["backend"] for s in canon.values()}
        return names.pop() if len(names) == 1 else str({r: s["backend"] for r, s in canon.items()})
    return str(canon)
