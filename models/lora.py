"""LoRA adapters of a diffusion run: the library (``model.lora``), checked before any weight loads; the adapter set of
each row (``lora``, ``lora_scale`` row fields); loading, fusing and switching through diffusers' LoRA loaders (peft
backend); and the evidence that each adapter acted.

* **Library.** Every ``model.lora`` entry is a ``.safetensors`` file (pickle is never read), parsed by the pipeline
  class's own ``lora_state_dict`` (diffusers' converters: peft/diffusers naming, kohya, xlabs, ...). Its transformer
  keys (``transformer.<module>.lora_A.weight`` ``(r, in)``, ``lora_B.weight`` ``(out, r)``) must name Linear layers
  of the model's transformer with those in/out features, read from the transformer built on the meta device from
  its config (no weights). A missing file, a pickle file, a module the model lacks (named), a shape of another
  model, layers of a component the runner does not adapt, an unknown row adapter: exit 2 before loading, every
  problem at once.
* **Rows.** A row without ``lora`` runs every library adapter at its scale; ``lora`` (a name or a list; ``[]``: none)
  picks adapters, ``lora_scale`` replaces the scale of each. The resolved set, ``[{name, sha256, scale}]``, becomes
  the row's ``lora`` value: it enters the item's ``inputs_sha256``, its ``params`` (``items.jsonl``, the PNG's
  ``parameters``, ``metadata.jsonl``) and the batching key (rows batch by adapter set).
* **Fusing** (``model.lora_fuse``, :func:`decide_fuse`): with one adapter set for the whole run the adapters are
  fused at load (``set_adapters`` + ``fuse_lora``, then ``unload_lora_weights`` keeps the fused weights and drops the
  LoRA modules: no per-forward cost); otherwise ``set_adapters`` switches the set between batches, never inside one.
* **Evidence** (:class:`Runtime`): unfused, a forward hook on each active adapter's ``lora_A`` module of every
  adapted layer must see it execute in each pipeline call, and no other adapter; fused, for every adapted layer a
  random-projection checksum ``W @ x`` (x: a seeded ``(in,)`` vector) taken before and after fusing must differ by the
  adapter's own delta ``scaling * B @ (A @ x)``. An adapter set whose delta is zero in an adapted layer
  (:func:`set_deltas`: every ``lora_B`` zero) changes nothing there: a mismatch fused, unfused and per row alike (one
  input, one verdict); adapters at scale 0 run as asked and are not counted.
* **Experts.** On a model of several denoisers (Wan 2.2 A14B) each entry names the expert(s) it loads into
  (``model.lora[i].expert``, :func:`entry_experts`); its layers are checked against that expert's Linears, its record
  and each row's set carry ``experts``, the evidence expects its branches in every forward of its expert and in the
  steps the family's schedule gives that expert, nowhere else (:func:`step_check`), and reads back the scale peft
  applies to it in each expert (:func:`applied_scales`, :func:`scale_problems`); an adapter whose experts run no
  step of a row is left out of the row's set, an ``all`` adapter's part in such an expert is narrowed out, both
  recorded under the item's ``ignored.lora`` (:func:`drop_idle`).
* **Oracle effect.** An adapter file may declare what it does to a toy oracle's attributes in its safetensors
  metadata (``runner.expect``: JSON, e.g. ``{"color": "blue"}``); items that run it at scale 1 are scored against
  that, at scale 0 against the row's own ``expect``, in between not on those attributes (:func:`effective_expect`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from runner.core import dataset as ds
from runner.core.errors import ConfigValueError, DatasetError, UserInputError

#: Suffixes of pickle checkpoints (never loaded: unpickling runs code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: The safetensors metadata key of an adapter's declared oracle effect (:func:`effective_expect`).
EFFECT_KEY = "runner.expect"
#: Pipeline components whose LoRA layers the runner loads and checks (the denoiser). A model with several denoisers
#: (Wan 2.2 A14B: ``transformer`` for the high-noise steps, ``transformer_2`` for the low-noise ones) loads an adapter
#: into the expert(s) its ``model.lora`` entry names (:data:`EXPERT_LOAD_KWARGS`); the file's keys say
#: ``transformer`` either way (diffusers' naming).
ADAPTED_COMPONENTS = ("transformer",)
#: ``load_lora_weights`` keyword arguments that load into each expert (diffusers' ``WanLoraLoaderMixin``:
#: ``load_into_transformer_2``, diffusers PR #12074).
EXPERT_LOAD_KWARGS: Dict[str, Dict[str, Any]] = {"transformer": {}, "transformer_2": {"load_into_transformer_2": True}}
#: ``model.lora[i].expert`` value that loads the adapter into every expert.
ALL_EXPERTS = "all"


class LoraError(UserInputError, ValueError):
    """A ``model.lora`` adapter that cannot run on this model (every problem listed, each with its fix)."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One checked library adapter.

    Attributes:
        name: what rows call it (``model.lora[i].name``, else the file stem).
        path: the resolved file path.
        scale: the library scale (``model.lora[i].scale``).
        sha256: of the file's bytes.
        layers: the transformer modules it adapts (names relative to the transformer).
        effect: the declared oracle effect (:data:`EFFECT_KEY`), or None.
        experts: the denoisers it loads into on a model with several (``model.lora[i].expert``); None on a
            one-denoiser model (``transformer``).
    """

    name: str
    path: str
    scale: float
    sha256: str
    layers: Tuple[str, ...]
    effect: Optional[Dict[str, Any]] = None
    experts: Optional[Tuple[str, ...]] = None

    def record(self) -> Dict[str, Any]:
        """The manifest's entry (``model.source.lora.adapters``)."""
        return {"name": self.name, "path": self.path, "scale": self.scale, "sha256": self.sha256,
                "layers": len(self.layers), **({"effect": self.effect} if self.effect else {}),
                **({"experts": list(self.experts)} if self.experts else {})}

    def loads_into(self) -> Tuple[str, ...]:
        """The denoisers it loads into."""
        return self.experts or ADAPTED_COMPONENTS

    def keys(self) -> List[str]:
        """The adapted layers as :class:`Runtime` names them: ``<module>`` in ``transformer``, ``<expert>.<module>``
        in another expert."""
        return [layer_key(e, m) for e in self.loads_into() for m in self.layers]


def layer_key(expert: str, module: str) -> str:
    """A LoRA layer's name in :class:`Runtime`: the module name, prefixed by its expert unless ``transformer``."""
    return module if expert == ADAPTED_COMPONENTS[0] else f"{expert}.{module}"


def split_key(key: str) -> Tuple[str, str]:
    """``(expert, module)`` of a :func:`layer_key`."""
    head, _, rest = key.partition(".")
    first = ADAPTED_COMPONENTS[0]
    return (head, rest) if head in EXPERT_LOAD_KWARGS and head != first else (first, key)


# ------------------------------------------------------------------------------------------------ the library
def file_problem(where: str, path: Path) -> Optional[str]:
    """Why ``path`` cannot be an adapter file (missing, pickle, not safetensors, damaged header), else None."""
    if not path.is_file():
        return f"{where}: {path} does not exist; fix: the path of a .safetensors LoRA file"
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return (f"{where}: {path} is a pickle file (pickle is never loaded: unpickling runs code); fix: convert it to "
                "safetensors (safetensors.torch.save_file) and point at the .safetensors file")
    if path.suffix.lower() != ".safetensors":
        return f"{where}: {path} is not a .safetensors file; fix: a LoRA saved as safetensors"
    from runner.core.weights import WeightFileError, check_safetensors

    try:
        check_safetensors(path)
    except WeightFileError as e:
        return f"{where}: {e}"
    return None


def base_linears(transformer_cls: str, config: Mapping[str, Any]) -> Dict[str, Tuple[int, int]]:
    """``{module name: (out_features, in_features)}`` of every ``nn.Linear`` of the transformer, built on the meta
    device from its config (no memory, no weights)."""
    import diffusers
    import diffusers.hooks  # noqa: F401  (imported before the meta device context: its module tensors stay real)

    cls = getattr(diffusers, transformer_cls)
    conf = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(conf)
    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def read_adapter(pipeline_cls: type, path: Path) -> Tuple[Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """The adapter's state dict in diffusers naming (the pipeline class's ``lora_state_dict``: its converters for
    community formats), safetensors only, and its declared oracle effect (:data:`EFFECT_KEY`)."""
    from safetensors import safe_open

    out = pipeline_cls.lora_state_dict(str(path), use_safetensors=True)
    sd = out[0] if isinstance(out, tuple) else out
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    effect = json.loads(meta[EFFECT_KEY]) if EFFECT_KEY in meta else None
    return sd, effect


def target_problems(where: str, sd: Mapping[str, torch.Tensor], linears: Mapping[str, Tuple[int, int]],
                    model: str) -> Tuple[List[str], Tuple[str, ...]]:
    """``(problems, adapted layers)`` of a diffusers-named LoRA state dict against the transformer's Linears: keys
    of another component, modules the model lacks (named), in/out features of another model."""
    comps = sorted({k.split(".", 1)[0] for k in sd if ".lora_" in k} - set(ADAPTED_COMPONENTS))
    problems = [f"{where}: has LoRA layers for {', '.join(comps)}, which the runner does not adapt (only the "
                f"transformer); fix: an adapter with transformer layers only"] if comps else []
    a_keys = {k[len("transformer."):-len(".lora_A.weight")]: v for k, v in sd.items()
              if k.startswith("transformer.") and k.endswith(".lora_A.weight")}
    if not a_keys and not comps:
        return [f"{where}: holds no LoRA layers diffusers can read (keys like transformer.<module>.lora_A.weight); "
                f"fix: a LoRA file for model={model}'s family"], ()
    missing = sorted(m for m in a_keys if m not in linears)
    if missing:
        problems.append(f"{where}: targets {len(missing)} module(s) that model={model}'s transformer lacks: "
                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; fix: an adapter trained "
                        "for this model (another family's adapter names other modules)")
    bad = []
    for m, a in sorted(a_keys.items()):
        b = sd.get(f"transformer.{m}.lora_B.weight")
        if m in linears and (b is None or a.shape[1] != linears[m][1] or b.shape[0] != linears[m][0]):
            got = f"{tuple(b.shape[:1]) + tuple(a.shape[1:2])}" if b is not None else "no lora_B"
            bad.append(f"{m} (adapter out x in {got}, model {linears[m]})")
    if bad:
        problems.append(f"{where}: {len(bad)} layer(s) of another shape: {', '.join(bad[:3])}"
                        f"{' ...' if len(bad) > 3 else ''}; fix: an adapter for this model's size (another model "
                        "of the family has other widths)")
    return problems, tuple(sorted(a_keys))


def entry_experts(where: str, value: Optional[str], experts: Sequence[str], model: str
                  ) -> Tuple[Tuple[str, ...], Optional[str]]:
    """``(experts, problem)``: the denoisers a ``model.lora`` entry's ``expert`` names among the model's
    ``experts``: null is the only one (required where there are several: an adapter loaded into one expert alone
    would leave the other's steps unadapted, diffusers' default), :data:`ALL_EXPERTS` is each of them."""
    names = " | ".join([*experts, ALL_EXPERTS])
    if value is None:
        if len(experts) > 1:
            return (), (f"{where}: model={model} has {len(experts)} denoisers ({', '.join(experts)}; each runs its "
                        f"own steps), and the entry names none to load into; fix: {where.split(' ')[0]}.expert="
                        f"<{names}> (one entry per expert for a scale per expert: the same path, two names)")
        return tuple(experts[:1]), None
    if value == ALL_EXPERTS:
        return tuple(experts), None
    if value in experts and value in EXPERT_LOAD_KWARGS:
        return (value,), None
    return (), (f"{where}: expert={value!r} is not a denoiser of model={model}; fix: "
                f"{where.split(' ')[0]}.expert=<{names}>")


def check_library(entries: Sequence[Mapping[str, Any]], pipeline_cls: type,
                  linears: Mapping[str, Mapping[str, Tuple[int, int]]], model: str) -> List[Adapter]:
    """Every ``model.lora`` entry (``{path, scale, name, expert}``) checked (:func:`file_problem`,
    :func:`entry_experts`, :func:`target_problems` against each expert it loads into), names unique.

    Args:
        linears: per denoiser of the model (``transformer`` first), its Linears (:func:`base_linears`).

    Raises:
        LoraError: every problem of every entry, each naming ``model.lora[i]``, the file and the fix.
    """
    problems, out, seen = [], [], {}
    for i, e in enumerate(entries):
        path = Path(str(e["path"])).expanduser()
        name = str(e["name"]) if e.get("name") else path.stem
        where = f"model.lora[{i}] ({name})"
        scale = float(e.get("scale", 1.0))
        if not math.isfinite(scale):
            problems.append(f"{where}: scale={scale} is not a finite number; fix: e.g. scale=1.0")
        if name in seen:
            problems.append(f"{where}: the name {name!r} is also model.lora[{seen[name]}]'s; fix: a unique name")
        seen.setdefault(name, i)
        experts, wrong = entry_experts(where, e.get("expert"), list(linears), model)
        if wrong:
            problems.append(wrong)
        why = file_problem(where, path)
        if why:
            problems.append(why)
            continue
        try:
            sd, effect = read_adapter(pipeline_cls, path)
        except Exception as err:  # noqa: BLE001 - diffusers' converters raise many types for a foreign format
            problems.append(f"{where}: {path} is not a LoRA {pipeline_cls.__name__} can read ({type(err).__name__}: "
                            f"{err}); fix: a LoRA file for model={model}'s family")
            continue
        layers: Tuple[str, ...] = ()
        for ex in experts or tuple(linears)[:1]:
            found, layers = target_problems(where if len(linears) == 1 else f"{where} in {ex}", sd, linears[ex],
                                            model)
            problems += [p for p in found if p not in problems]
        out.append(Adapter(name, str(path.resolve()), scale, file_sha256(path), layers, effect,
                           (experts or None) if len(linears) > 1 else None))
    if problems:
        raise LoraError("model.lora cannot run on model=" + model + ":\n  " + "\n  ".join(problems))
    return out


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (``runner.core.dataset.file_sha256``)."""
    from runner.core.dataset import file_sha256 as sha

    return sha(path)


# ------------------------------------------------------------------------------------------------ rows
def resolve_rows(rows: Sequence[Any], library: Sequence[Adapter], path: Any) -> List[Any]:
    """Each row's adapter set (module docstring), as its ``lora`` value ``[{name, sha256, scale}]``.

    Raises:
        DatasetError: every row naming an adapter the library lacks, or setting ``lora_scale`` with no adapter
            (file:line, the name, the library's names, the fix).
    """
    by_name = {a.name: a for a in library}
    bad, out = [], []
    for r in rows:
        names = r.values.get("lora")
        names = [a.name for a in library] if names is None else names
        unknown = [n for n in names if n not in by_name]
        if unknown:
            bad.append(f"{path}:{r.line}: row {r.id!r}: lora {', '.join(map(repr, unknown))} is not an adapter of "
                       f"model.lora ({', '.join(by_name) or 'none'}); fix: add it to model.lora "
                       "(model.lora=[{name: ..., path: ...}]) or name one of those")
            continue
        if r.values.get("lora_scale") is not None and not names:
            bad.append(f"{path}:{r.line}: row {r.id!r}: lora_scale={r.values['lora_scale']} but the row runs no "
                       "adapter; fix: remove lora_scale, or give model.lora / the row's lora")
            continue
        scale = r.values.get("lora_scale")
        chosen = [{"name": n, "sha256": by_name[n].sha256, "scale": float(by_name[n].scale if scale is None else scale),
                   **({"experts": list(by_name[n].experts)} if by_name[n].experts else {})}
                  for n in names]
        out.append(dataclasses.replace(r, values={**r.values, "lora": chosen}) if library else r)
    if bad:
        raise DatasetError(bad)
    return out


def idle_experts(entry: Mapping[str, Any], steps: Optional[Mapping[str, int]]) -> List[str]:
    """The experts of a row's adapter entry (``{name, sha256, scale, experts}``) that run no step of the row's call
    (``steps``: ``{expert: steps}``, None on a one-denoiser model); none for an adapter at scale 0 (it runs as asked,
    scaled by 0)."""
    if steps is None or not entry.get("experts") or not entry["scale"]:
        return []
    return [e for e in entry["experts"] if not steps.get(e)]


def drop_idle(rows: Sequence[Any], expert_steps: Any, mode: str, path: Any) -> List[Any]:
    """Adapters, or an adapter's part in an expert, that act on no step of a row's call: an expert that runs none of
    its steps (``expert_steps(row)``: ``{expert: steps}``, None on a one-denoiser model; tiny_wan22 at 1 step runs
    ``transformer_2`` on none) changes no byte of the item, so that part is not recorded as applied. A row that
    names such an adapter (its ``lora`` field) is refused under ``dataset.on_ignored=error`` (file:line, why, fix);
    otherwise (the library's default set, or ``record``) an adapter idle in every expert it loads into leaves the
    row's set, one idle in some (``expert: all``) stays with ``experts`` narrowed to those that run (so its identity
    is what acts), and the idle parts are kept under the item's ``ignored.lora`` (``value``: the adapters with their
    idle ``experts``, ``why``, ``from``) beside the set that applied.

    Raises:
        DatasetError: error mode, every row naming such an adapter.
    """
    problems, out = [], []
    for r in rows:
        steps = expert_steps(r)
        chosen = r.values.get("lora") or []
        parts = [idle_experts(d, steps) for d in chosen]
        idle = [{**d, "experts": p} for d, p in zip(chosen, parts) if p]
        if not idle:
            out.append(r)
            continue
        experts = ", ".join(sorted({e for d in idle for e in d["experts"]}))
        still = [f"{d['name']} still acts in {', '.join(e for e in d['experts'] if e not in p)}"
                 for d, p in zip(chosen, parts) if p and len(p) < len(d["experts"])]
        why = (f"{', '.join(d['name'] for d in idle)} load(s) into {experts}, which run(s) no step of the row's "
               f"{r.num_inference_steps} (steps per expert: {steps}){' (' + '; '.join(still) + ')' if still else ''}")
        named = "lora" in r.set_fields
        if mode == "error" and named:
            problems.append(f"{path}:{r.line}: field 'lora' names adapter(s) that act on no step of row {r.id!r}: "
                            f"{why}; fix: drop them from the row's lora, more steps, or dataset.on_ignored=record to "
                            "run it and record them as ignored")
            continue
        kept = [d if not p else {**d, "experts": [e for e in d["experts"] if e not in p]}
                for d, p in zip(chosen, parts) if not p or len(p) < len(d["experts"])]
        ignored = {**(r.ignored or {}), "lora": {"value": idle, "why": why,
                                                 "from": f"{path}:{r.line}" if named else "model.lora"}}
        out.append(dataclasses.replace(r, values={**r.values, "lora": kept}, ignored=ignored))
    if problems:
        raise DatasetError(problems)
    return out


def adapter_sets(rows: Iterable[Any]) -> List[tuple]:
    """The distinct adapter sets (:func:`runner.core.dataset.lora_set_key`) of ``rows``, in first-seen order."""
    seen: Dict[tuple, None] = {}
    for r in rows:
        seen.setdefault(ds.lora_set_key(r.values.get("lora")) or (), None)
    return list(seen)


def decide_fuse(mode: str, sets: Sequence[tuple]) -> Tuple[bool, str]:
    """``(fuse, why)`` for ``model.lora_fuse`` (``auto``/``fused``/``unfused``) over the run's adapter sets.

    Raises:
        ConfigValueError: ``model.lora_fuse=fused`` while rows need several sets (a fused set cannot switch).
    """
    active = [s for s in sets if s]
    if not active:
        return False, "no row runs an adapter"
    if mode == "unfused":
        return False, "model.lora_fuse=unfused: the LoRA branches run unfused"
    if len(sets) == 1 and active and not any(s for _, s in active[0]):
        return False, "every adapter at scale 0: nothing to fuse (the LoRA branches run unfused, scaled by 0)"
    if len(sets) == 1 and active:
        return True, (f"{'auto: ' if mode == 'auto' else ''}every row runs the same adapter set "
                      f"({', '.join(f'{n}@{s:g}' for n, s in active[0])}): fused at load")
    if mode == "fused":
        raise ConfigValueError(f"model.lora_fuse=fused, but the rows run {len(sets)} adapter sets "
                               f"({'; '.join(', '.join(n for n, _ in s) or 'none' for s in sets)}), and fused weights "
                               "cannot switch between batches; fix: model.lora_fuse=auto (switches unfused), or one "
                               "adapter set for every row")
    return False, f"auto: the rows run {len(sets)} adapter sets, switched between batches with set_adapters"


def effective_expect(row: Any, library: Sequence[Adapter]) -> Optional[Dict[str, Any]]:
    """What an oracle should read for ``row``: its ``expect``, with each attribute an adapter in its set declares
    (:data:`EFFECT_KEY`) replaced by the adapter's value at scale 1, kept at scale 0, dropped otherwise."""
    expect = dict(row.expect or {})
    effects = {a.name: a.effect for a in library if a.effect}
    for d in row.values.get("lora") or []:
        for key, value in (effects.get(d["name"]) or {}).items():
            if d["scale"] == 1.0:
                expect[key] = value
            elif d["scale"] != 0.0:
                expect.pop(key, None)
    return expect or None


# ------------------------------------------------------------------------------------------------ at run time
def sketch(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The random-projection checksum ``W @ x`` of a Linear's ``(out, in)`` weight, float32 ``(out,)``."""
    return weight.detach().float() @ x


@torch.no_grad()
def set_deltas(layers: Mapping[str, Any], key: tuple) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (x, delta)}``: for every adapted layer that an adapter of the set ``key`` (``(name, scale)`` pairs)
    at a non-zero scale adapts, a seeded ``(in,)`` vector ``x`` and the set's change of its output
    ``sum_n scaling_n * B_n @ (A_n @ x)`` (float32 ``(out,)``; ``scaling`` as peft holds it after ``set_adapters``:
    the set's scale x alpha / r). The one rule of what an adapter set changes, for fused and unfused runs alike; a
    layer whose delta is zero (every ``lora_B`` zero) changes nothing. Adapters at scale 0 are left out: they run
    as asked, scaled by 0."""
    names = [n for n, sc in key if sc]
    gen = torch.Generator().manual_seed(0)
    out: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for lname, layer in layers.items():
        w = layer.get_base_layer().weight
        x = torch.randn(w.shape[1], generator=gen).to(w.device)  # drawn for every layer: x does not depend on the set
        if not any(n in layer.lora_A for n in names):
            continue
        out[lname] = (x, sum(layer.scaling[n] * (layer.lora_B[n].weight.float() @ (layer.lora_A[n].weight.float() @ x))
                             for n in names if n in layer.lora_A))
    return out


def changes_nothing(deltas: Mapping[str, Tuple[torch.Tensor, torch.Tensor]]) -> List[str]:
    """The layers of :func:`set_deltas` whose delta is exactly zero."""
    return sorted(n for n, (_, d) in deltas.items() if float(torch.as_tensor(d).norm()) == 0.0)


def applied_scales(layers: Mapping[str, Any], names: Iterable[str]) -> Dict[str, Dict[str, Any]]:
    """``{expert: {adapter: scale}}`` as peft's layers hold it after ``set_adapters``, read back from each adapted
    layer: ``scaling / (lora_alpha / r)`` (rsLoRA: ``/ sqrt(r)``), the multiplier of the adapter's ``B @ A`` over
    its own alpha/r (unitless). One float when every layer of the expert agrees (rounded to 6 digits), else the
    sorted distinct values. An expert the adapter did not load into has no entry for it."""
    seen: Dict[str, Dict[str, set]] = {}
    for key, layer in layers.items():
        expert = split_key(key)[0]
        for n in names:
            if n not in layer.scaling:
                continue
            r = layer.r[n]
            unit = layer.lora_alpha[n] / (math.sqrt(r) if layer.use_rslora.get(n, False) else r)
            seen.setdefault(expert, {}).setdefault(n, set()).add(round(float(layer.scaling[n]) / unit, 6))
    return {e: {n: (next(iter(v)) if len(v) == 1 else sorted(v)) for n, v in sorted(by.items())}
            for e, by in sorted(seen.items())}


def scale_problems(applied: Mapping[str, Mapping[str, Any]], key: tuple, experts: Mapping[str, Sequence[str]]
                   ) -> List[str]:
    """What differs between the scales peft applies (:func:`applied_scales`) and the set ``key``'s
    (``(name, scale)`` pairs) in each expert its entry loads it into (``experts``: ``{adapter: experts}``): a scale
    applied to the wrong expert, one expert's adapter missing, or an adapter in an expert its entry does not name."""
    out = []
    for name, scale in key:
        for e in experts.get(name, ()):
            got = applied.get(e, {}).get(name)
            if got is None:
                out.append(f"{name} holds no scale in {e} (not loaded there)")
            elif isinstance(got, list) or not math.isclose(got, float(scale), rel_tol=1e-5, abs_tol=1e-6):
                out.append(f"{name} runs at scale {got} in {e}, its set says {scale:g}")
        out += [f"{name} is loaded into {e} too, which its entry does not name ({', '.join(experts.get(name, ()))})"
                for e in applied if name in applied[e] and e not in experts.get(name, ())]
    return out


def step_groups(log: Sequence[Tuple[str, Optional[float]]]) -> List[int]:
    """The denoising step of each denoiser forward of a call (``log``: ``(expert, timestep)`` per forward, in order):
    consecutive forwards of one expert at one timestep (classifier-free guidance's two passes) are one step; a
    forward without a timestep is a step of its own. Step indices count from 0."""
    out: List[int] = []
    prev: Any = None
    for e, t in log:
        same = prev is not None and t is not None and prev == (e, t)
        out.append(out[-1] if same else (out[-1] + 1 if out else 0))
        prev = (e, t)
    return out


def step_check(log: Sequence[Tuple[str, Optional[float]]], ran: Sequence[set], declared: set,
               expected: Sequence[Tuple[float, str]], experts: Mapping[str, Sequence[str]]
               ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Each active adapter's layers observed in the steps its expert runs, and no other, for one pipeline call.

    Args:
        log: ``(expert, timestep)`` of each denoiser forward, in order (:func:`step_groups` makes steps of them).
        ran: per forward, the ``(layer key, adapter)`` pairs whose ``lora_A`` executed in it.
        declared: the ``(layer key, adapter)`` pairs the active adapters declare (:meth:`Runtime.declared`).
        expected: ``(timestep, expert)`` per step by the family's rule (``WanEngine.expected_experts``: ``transformer``
            at timesteps >= the boundary).
        experts: ``{active adapter: the experts its entry loads it into}``.

    Returns:
        ``(record, bad forwards)``: the record is ``{"expected": {adapter: steps}, "observed": {adapter: steps},
        "experts": {expert: steps it ran}, "timesteps": [each step's timestep]}`` (steps where an adapter's branch
        ran at least once); a bad forward
        ``{"step", "expert", "timestep", "missing", "foreign"}`` lists the declared pairs of its expert that did not
        run in it and the pairs that ran though not declared for that expert.
    """
    steps = step_groups(log)
    names = sorted(experts)
    observed = {n: sorted({steps[i] for i, r in enumerate(ran) if any(a == n for _, a in r)}) for n in names}
    want = {n: [j for j, (_t, e) in enumerate(expected) if e in experts[n]] for n in names}
    ran_by = {e: sorted({steps[i] for i, (x, _t) in enumerate(log) if x == e}) for e in sorted({x for x, _ in log})}
    mine: Dict[str, set] = {}
    for pair in declared:
        mine.setdefault(split_key(pair[0])[0], set()).add(pair)
    bad = []
    for i, ((e, t), r) in enumerate(zip(log, ran)):
        missing, foreign = sorted(mine.get(e, set()) - r), sorted(r - mine.get(e, set()))
        if missing or foreign:
            bad.append({"step": steps[i], "expert": e, "timestep": t, "missing": missing, "foreign": foreign})
    times = [t for i, (_e, t) in enumerate(log) if i == 0 or steps[i] != steps[i - 1]]
    return {"expected": want, "observed": observed, "experts": ran_by, "timesteps": times}, bad


class Runtime:
    """The run's adapters on the loaded pipeline: loads them, fuses or switches them, and observes them."""

    def __init__(self, library: Sequence[Adapter], fuse: bool, why: str, sets: Sequence[tuple],
                 observe: bool) -> None:
        used = {n for s in sets for n, _ in s}
        self.library = [a for a in library if a.name in used]
        self.fuse, self.why, self.sets, self.observe = fuse, why, list(sets), observe
        self.current: Optional[tuple] = None
        self.switches = 0
        self.calls: List[Dict[str, Any]] = []
        self.fused: Dict[str, Any] = {}
        self.counts: Dict[Tuple[str, str], int] = {}
        self.handles: List[Any] = []
        self.layers: Dict[str, Any] = {}
        self.nil: Dict[tuple, List[str]] = {}  # unfused: per adapter set run, the adapted layers it changes nothing in
        self.experts: List[str] = sorted({e for a in self.library for e in a.loads_into()},
                                         key=lambda e: (e != ADAPTED_COMPONENTS[0], e))
        self.multi = any(a.experts for a in self.library)  # a model of several denoisers: each may skip a call
        self.forwards: Dict[str, int] = {}  # per expert, its forwards in the current call (unfused, observed)
        self.missing_layers: List[str] = []  # layers an adapter declares that hold no LoRA branch after loading
        # several experts, unfused and observed: (expert, timestep) of each denoiser forward of the current call and
        # the (layer, adapter) pairs that ran in it (:func:`step_check`); per set, its first call's steps record
        self.fwd_log: List[Tuple[str, Any]] = []
        self.fwd_ran: List[set] = []
        self.step_records: Dict[tuple, Dict[str, Any]] = {}
        self.scales: Dict[tuple, Dict[str, Any]] = {}  # per set: the scales peft applies per expert, what differs

    def adapted_layers(self, pipe: Any) -> Dict[str, Any]:
        """``{layer key: peft LoraLayer}`` of the experts the adapters load into (:func:`layer_key`)."""
        from peft.tuners.lora import LoraLayer

        return {layer_key(e, n): m for e in self.experts for n, m in getattr(pipe, e).named_modules()
                if isinstance(m, LoraLayer)}

    def declared(self, names: Iterable[str]) -> set:
        """``{(layer key, adapter)}`` that adapters ``names`` declare (their files' layers in their experts)."""
        names = set(names)
        return {(k, a.name) for a in self.library if a.name in names for k in a.keys()}

    @torch.no_grad()
    def load(self, pipe: Any) -> Dict[str, Any]:
        """Load every used adapter (``load_lora_weights``, safetensors only); fuse the run's one set, or hook each
        adapter's ``lora_A`` modules to observe it (``observe``). Returns the manifest's ``lora`` load section.
        diffusers' note that an adapter has no text-encoder layers is silenced (the runner adapts the transformer
        only, checked by :func:`check_library`)."""
        import logging

        quiet = logging.getLogger("diffusers.loaders.lora_base")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            for a in self.library:
                for e in a.loads_into():
                    pipe.load_lora_weights(a.path, adapter_name=a.name, use_safetensors=True, **EXPERT_LOAD_KWARGS[e])
        finally:
            quiet.setLevel(level)
        layers = self.layers = self.adapted_layers(pipe)
        found = {(k, n) for k, layer in layers.items() for n in layer.lora_A}
        self.missing_layers = sorted(f"{k} ({n})" for k, n in self.declared(a.name for a in self.library) - found)
        if self.fuse:
            self.fuse_set(pipe, layers, self.sets[0])
        elif self.observe:
            for lname, layer in layers.items():
                for aname, mod in layer.lora_A.items():
                    self.handles.append(mod.register_forward_hook(self._counter(lname, aname)))
            for e in self.experts if self.multi else ():  # one denoiser: it runs in every call
                self.handles.append(getattr(pipe, e).register_forward_pre_hook(self._forward_counter(e),
                                                                                with_kwargs=True))
        return {"mode": "fused" if self.fuse else "per_batch", "why": self.why,
                "adapters": [a.name for a in self.library], "layers": len(layers),
                "sets": [[list(p) for p in key] for key in self.sets],
                **({"experts": {e: [a.name for a in self.library if e in a.loads_into()] for e in self.experts}}
                   if self.multi else {})}

    def owned(self) -> Tuple[str, ...]:
        """Module-name prefixes of the unfused LoRA branches (``<layer>.lora_A``, ``<layer>.lora_B``), relative to
        their expert: the linear backend, installed on each expert, leaves them alone (they run only for their
        adapter's batches; this runtime observes them)."""
        rel = sorted({split_key(k)[1] for k in self.layers})
        return tuple(f"{n}.{part}" for n in rel for part in ("lora_A", "lora_B"))

    def _forward_counter(self, expert: str) -> Any:
        def hook(mod: Any, args: Any, kwargs: Dict[str, Any]) -> None:
            self.forwards[expert] = self.forwards.get(expert, 0) + 1
            t = kwargs.get("timestep")  # a one-element copy, read after the call (no device sync in the loop)
            self.fwd_log.append((expert, t.detach().reshape(-1)[:1].clone() if isinstance(t, torch.Tensor) else t))
            self.fwd_ran.append(set())
        return hook

    def _counter(self, layer: str, adapter: str) -> Any:
        def hook(mod: Any, args: Any, out: Any) -> None:
            self.counts[(layer, adapter)] = self.counts.get((layer, adapter), 0) + 1
            if self.fwd_ran:  # several experts: the forward it ran in
                self.fwd_ran[-1].add((layer, adapter))
        return hook

    def check_scales(self, key: tuple) -> Dict[str, Any]:
        """The scales peft applies in each expert for the set ``key`` (:func:`applied_scales`) against the set's
        (:func:`scale_problems`): ``{"set", "applied": {expert: {adapter: scale}}, "problems"}``, kept per set."""
        if key not in self.scales:
            experts = {a.name: a.loads_into() for a in self.library}
            applied = applied_scales(self.layers, [n for n, _ in key])
            self.scales[key] = {"set": [list(p) for p in key], "applied": applied,
                                "problems": scale_problems(applied, key, experts)}
        return self.scales[key]

    def fuse_set(self, pipe: Any, layers: Dict[str, Any], key: tuple) -> None:
        """``set_adapters`` + ``fuse_lora`` + ``unload_lora_weights``, with the checksum of every adapted layer before
        and after (module docstring); the result in :attr:`fused`."""
        names, weights = [n for n, _ in key], [s for _, s in key]
        pipe.set_adapters(names, weights)
        scales = self.check_scales(key)
        deltas = set_deltas(layers, key)
        before = {n: (x, sketch(layers[n].get_base_layer().weight, x)) for n, (x, _) in deltas.items()}
        pipe.fuse_lora(components=list(self.experts), lora_scale=1.0, adapter_names=names)
        after = {n: sketch(layers[n].get_base_layer().weight, x) for n, (x, _) in before.items()}
        pipe.unload_lora_weights()  # fused weights stay; the LoRA modules go (no per-forward cost)
        mods = {layer_key(e, n): m for e in self.experts for n, m in getattr(pipe, e).named_modules()}
        kept = {n: sketch(mods[n].weight, before[n][0]) for n in before}
        eps = torch.finfo(pipe.transformer.dtype).eps
        bad, nil = [], changes_nothing(deltas)
        for n in before:
            y0, y1, d = before[n][1], after[n], deltas[n][1]
            dn = float(torch.as_tensor(d).norm())
            if n in nil:
                continue
            if torch.equal(y0, y1):
                nil.append(n)
            elif float((y1 - y0 - d).norm()) > 0.05 * dn + 2 * eps * float(y0.norm()) or not torch.equal(y1, kept[n]):
                bad.append(n)
        self.fused = {"set": [list(p) for p in key], "layers": len(before), "changed_nothing": sorted(nil),
                      "delta_mismatch": bad, "not_loaded": self.missing_layers,
                      **({"scales": scales["applied"], "scale_mismatch": scales["problems"]} if self.multi else {}),
                      "verdict": "verified" if before and not bad and not nil and not self.missing_layers
                      and not scales["problems"] else "mismatch"}
        self.current = key

    def activate(self, pipe: Any, key: Optional[tuple]) -> None:
        """Make ``key`` (a batch's :func:`runner.core.dataset.lora_set_key`) the active set before its pipeline call; unfused only, and only
        when it changes (``set_adapters``; ``disable_lora`` for no adapter)."""
        key = key or ()
        if self.fuse or key == self.current:
            return
        if key:
            if self.current == ():
                pipe.enable_lora()
            pipe.set_adapters([n for n, _ in key], [s for _, s in key])
            if key not in self.nil:  # what this set changes, once per set (the fused rule: set_deltas)
                self.nil[key] = changes_nothing(set_deltas(self.layers, key))
                self.check_scales(key)
        else:
            pipe.disable_lora()
        self.current = key
        self.switches += 1

    def before_call(self) -> None:
        """Reset the per-call execution counts."""
        self.counts.clear()
        self.forwards.clear()
        self.fwd_log.clear()
        self.fwd_ran.clear()

    def after_call(self, batch_keys: Sequence[str], expected: Optional[Sequence[Tuple[float, str]]] = None) -> None:
        """Record what the call's adapters did (unfused, observed): per active adapter, the layers it declares in
        each expert that ran in the call (:meth:`declared`: from its file, not from what loaded) that did not
        execute it (``missing``), and any adapter that executed where none was declared active (``foreign``: another
        adapter, or one loaded into another expert than its entry names). With several experts, each one's forwards
        in the call (``forwards``) and, per denoiser forward, its expert's declared layers against what ran
        (:func:`step_check`): each adapter's branches in the steps its expert runs by ``expected`` (``(timestep,
        expert)`` per step, the family's rule; None: not compared), and in no other step."""
        if self.fuse or not self.observe:
            return
        active = {n for n, _ in (self.current or ())}
        ran_experts = {e for e, v in self.forwards.items() if v} if self.multi else set(self.experts)
        declared = self.declared(active)
        want = {(k, a) for k, a in declared if split_key(k)[0] in ran_experts}
        ran = {k for k, v in self.counts.items() if v}
        call = {"items": list(batch_keys), "set": sorted(active), "missing": sorted(want - ran),
                "foreign": sorted(ran - declared)}
        if self.multi:
            call["forwards"] = {e: self.forwards.get(e, 0) for e in self.experts}
            log = [(e, float(t.float().item()) if isinstance(t, torch.Tensor) else t) for e, t in self.fwd_log]
            experts = {a.name: a.loads_into() for a in self.library if a.name in active}
            record, bad = step_check(log, self.fwd_ran, declared, expected or [], experts)
            if expected is None:
                record.pop("expected")
            kept = [{**b, "missing": b["missing"][:10], "foreign": b["foreign"][:10],  # the first 3, 10 pairs each
                     "missing_count": len(b["missing"]), "foreign_count": len(b["foreign"])} for b in bad[:3]]
            call.update(steps=record, bad_forwards=kept, bad_forward_count=len(bad),
                        steps_differ=expected is not None and record["observed"] != record["expected"])
            self.step_records.setdefault(self.current or (), {"set": [list(p) for p in self.current or ()],
                                                              "items": list(batch_keys)[:3], **record})
        self.calls.append(call)

    def call_problem(self, stage: str, c: Dict[str, Any]) -> Optional[str]:
        """A call's mismatch in words (:meth:`after_call`), or None."""
        bad = c.get("bad_forwards") or []
        if not (c["missing"] or c["foreign"] or bad or c.get("steps_differ")):
            return None
        out = (f"stage {stage}: items {c['items'][:3]}: adapter set {c['set']}: {len(c['missing'])} adapted layer(s) "
               f"did not run their LoRA branch ({[tuple(x) for x in c['missing'][:3]]}), {len(c['foreign'])} ran "
               f"another adapter's ({[tuple(x) for x in c['foreign'][:3]]})")
        if c.get("steps_differ"):
            out += (f"; the adapters ran in steps {c['steps']['observed']}, their experts' steps are "
                    f"{c['steps']['expected']} (experts ran {c['steps']['experts']})")
        if bad:
            f = bad[0]
            out += (f"; {c['bad_forward_count']} denoiser forward(s) ran other LoRA branches than their expert's, "
                    f"first: step {f['step']} ({f['expert']}, timestep {f['timestep']}): {f['missing_count']} missing "
                    f"{[tuple(x) for x in f['missing'][:3]]}, {f['foreign_count']} foreign "
                    f"{[tuple(x) for x in f['foreign'][:3]]}")
        return out

    def evidence(self, stage: str) -> Tuple[Dict[str, Any], List[str]]:
        """``(evidence.stages.<stage>.lora, mismatches)``."""
        mm: List[str] = []
        sec: Dict[str, Any] = {"mode": "fused" if self.fuse else "per_batch", "why": self.why,
                               "switches": self.switches}
        if self.missing_layers:  # fused or not: an adapter's declared layers that did not load (another expert)
            mm.append(f"stage {stage}: {len(self.missing_layers)} layer(s) an adapter declares hold no LoRA branch "
                      f"after loading {self.missing_layers[:5]}")
        mm += [f"stage {stage}: LoRA set {s['set']}: the scales peft applies differ from the set's: "
               f"{'; '.join(s['problems'][:4])}" for s in self.scales.values() if s["problems"]]
        if self.fuse:
            sec["fused"] = self.fused
            nil, bad = self.fused.get("changed_nothing") or [], self.fused.get("delta_mismatch") or []
            if nil or bad or not self.fused.get("layers"):
                mm.append(f"stage {stage}: fused LoRA set {self.fused.get('set')}: "
                          + "; ".join(([f"{len(nil)} adapted layer(s) whose weights did not change {nil[:5]}"]
                                       if nil else []) + ([f"{len(bad)} whose change is not the adapter's delta "
                                                           f"{bad[:5]}"] if bad else []) or ["no adapted layer"]))
            return sec, mm
        nil = {k: v for k, v in self.nil.items() if v}
        sec["changed_nothing"] = [{"set": [list(p) for p in k], "layers": v} for k, v in nil.items()]
        if self.missing_layers:
            sec["not_loaded"] = self.missing_layers
        if self.multi:  # per set: the scales peft applies in each expert, and its first call's steps per adapter
            sec["scales"] = [{"set": s["set"], "applied": s["applied"]} for s in self.scales.values()]
            sec["steps"] = list(self.step_records.values())
        mm += [f"stage {stage}: unfused LoRA set {[list(p) for p in k]}: {len(v)} adapted layer(s) whose LoRA branch "
               f"changes nothing (scaling * B @ A = 0: an adapter whose lora_B are zero) {v[:5]}"
               for k, v in nil.items()]
        wrong = nil or self.missing_layers or any(s["problems"] for s in self.scales.values())
        if not self.observe:
            sec["verdict"] = "mismatch" if wrong else "limited"
            return sec, mm
        said = [(c, self.call_problem(stage, c)) for c in self.calls]
        bad = [c for c, why in said if why]
        sec.update(calls=len(self.calls), verdict="mismatch" if bad or wrong else "verified",
                   first_bad=bad[0] if bad else None)
        return sec, mm + [why for _, why in said if why]


# ------------------------------------------------------------------------------------------------- the pass
from models.passes import Pass  # noqa: E402


class LoraPass(Pass):
    """``model.lora`` on a diffusion stage (:mod:`models.passes`): the library checked before any weight loads
    (:func:`check_library`, recorded in ``source.lora``), each row's adapter set and the fuse decision, the adapters
    loaded first among the installs (fused weights are what the backends then wrap), the batch's set made active
    before each call, the evidence, and the oracle's expectations of the items that ran an adapter.

    The engine provides ``pipeline_cls()``, ``component_class(name)``, ``component_config(name)``,
    ``declared_experts()``, ``row_expert_steps(row)`` and, with several experts, ``expected_experts(row)``.

    Attributes:
        library: the checked :class:`Adapter` s (None before :meth:`prepare`).
        plan: ``(fuse, why, adapter sets)`` once the rows are resolved.
        runtime: the :class:`Runtime` once loaded with adapters.
    """

    name = "lora"
    in_plan = True

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.library: Optional[List[Adapter]] = None
        self.plan: Optional[Tuple[bool, str, List[tuple]]] = None
        self.runtime: Optional[Runtime] = None

    def loader(self) -> Tuple[type, Dict[str, Dict[str, Tuple[int, int]]]]:
        """``(pipeline class, {denoiser: {Linear: (out, in)}})`` the adapters are checked against: the task's
        pipeline class, when it has diffusers' LoRA loader (``load_lora_weights``), and each denoiser's Linears
        (``declared_experts``: Wan 2.2 A14B's ``transformer`` and ``transformer_2``) built on the meta device from
        its config (:func:`base_linears`).

        Raises:
            LoraError: the pipeline class has no LoRA loader.
        """
        e = self.engine
        cls = e.pipeline_cls()
        if not hasattr(cls, "load_lora_weights"):
            raise LoraError(f"model.lora: {cls.__name__} (model={e.model_cfg.name}) has no diffusers LoRA loader; "
                            "fix: model.lora=[], or a family whose pipeline loads LoRA (FLUX, SD3, Qwen-Image, Wan)")
        return cls, {x: base_linears(e.component_class(x), e.component_config(x)) for x in e.declared_experts()}

    def prepare(self) -> None:
        """``model.lora`` checked before any weight loads (:func:`check_library`), recorded in the model source
        (``source.lora``: each adapter's name, path, sha256, scale).

        Raises:
            LoraError: every problem of every adapter (missing or pickle file, modules the model lacks, another
                shape, a pipeline without a LoRA loader).
            runner.core.requirements.DependencyVersionError: peft missing or outside its tested range.
        """
        e = self.engine
        entries = [{"path": x.path, "scale": x.scale, "name": x.name, "expert": x.expert} for x in e.model_cfg.lora]
        self.library = []
        if not entries:
            return
        from runner.core.requirements import check_feature

        check_feature("peft", "model.lora")
        pipe_cls, linears = self.loader()
        self.library = check_library(entries, pipe_cls, linears, str(e.model_cfg.name))
        e.source["lora"] = {"adapters": [a.record() for a in self.library]}

    def prepare_rows(self, rows: List[Any], path: Any) -> List[Any]:
        """Each row's adapter set (:func:`resolve_rows`, :func:`drop_idle`) and whether the run fuses
        (``model.lora_fuse``, :func:`decide_fuse`): ``source.lora.fused`` (so in the run identity; the sets and why
        are in the manifest's ``model.lora``, written at load).

        Raises:
            DatasetError: a row naming an adapter the library lacks.
            ConfigValueError: ``lora_fuse=fused`` with several sets; unfused adapters under a linear backend that
                replaces the adapted Linears.
        """
        e = self.engine
        if self.library is None:  # read without prepare (runner.app.execute.DatasetItems.read, benchmarks)
            self.prepare()
        if not self.library and not any("lora" in r.values or "lora_scale" in r.values for r in rows):
            return rows
        rows = resolve_rows(rows, self.library, path)
        rows = drop_idle(rows, e.row_expert_steps, str(e.ctx.run.dataset.on_ignored), path)
        sets = adapter_sets(rows)
        fuse, why = decide_fuse(str(e.model_cfg.lora_fuse), sets)
        self.plan = (fuse, why, sets)
        if self.library:
            e.source["lora"]["fused"] = fuse  # changes the bytes (W + BA rounds unlike Wx + B(Ax)): in the identity
        linear = e.resolutions.get("linear")
        if not fuse and linear is not None and str(linear.selected).upper() != "TORCH":
            raise ConfigValueError(f"model.lora runs unfused ({why}), and backend.linear={linear.selected} replaces "
                                   "the Linears the LoRA branches wrap; fix: backend.linear=torch, or one adapter set "
                                   "for every row (fused)")
        return rows

    def install(self, sections: Dict[str, Any]) -> None:
        """The run's adapters on the loaded pipeline (:class:`Runtime`): fused, or hooked per adapter; the
        manifest's ``model.lora``."""
        if not self.library or self.plan is None:
            return
        fuse, why, sets = self.plan
        self.runtime = Runtime(self.library, fuse, why, sets, observe=self.engine.observe)
        sections["model"]["lora"] = self.runtime.load(self.engine.pipe)

    def owned_linears(self) -> Tuple[str, ...]:
        """The unfused LoRA branches' Linears (they run only for their adapter's batches)."""
        return self.runtime.owned() if self.runtime is not None else ()

    def activate(self, batch: Sequence[Any]) -> None:
        """The batch's adapter set made active (every item of a batch shares it)."""
        if self.runtime is not None:
            self.runtime.activate(self.engine.pipe, ds.lora_set_key(batch[0].row.values.get("lora")))
            self.runtime.before_call()

    def before_warmup(self, batch: Sequence[Any]) -> None:
        self.activate(batch)

    def before_call(self, batch: Sequence[Any]) -> None:
        self.activate(batch)

    def after_call(self, batch: Sequence[Any], want: Optional[int]) -> None:
        """The call's record (:meth:`Runtime.after_call`); with several experts, against the family's schedule of
        the batch's row (the engine's ``expected_experts``: which expert runs each step)."""
        if self.runtime is not None:
            expected = self.engine.expected_experts(batch[0].row) if self.runtime.multi else None
            self.runtime.after_call([it.key for it in batch], expected)

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        """``lora``: each adapter observed in the calls of its batches (:meth:`Runtime.evidence`)."""
        if self.runtime is None:
            return []
        section["lora"], mm = self.runtime.evidence(self.engine.stage)
        return mm

    def expect(self, items: List[Any]) -> List[Any]:
        """The items with the oracle expectations their adapters declare (:func:`effective_expect`)."""
        if not self.library:
            return items
        return [dataclasses.replace(it, row=dataclasses.replace(it.row, expect=effective_expect(it.row, self.library)))
                for it in items]
