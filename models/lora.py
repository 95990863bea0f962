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
#: Pipeline components whose LoRA layers the runner loads and checks (the denoiser).
ADAPTED_COMPONENTS = ("transformer",)


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
    """

    name: str
    path: str
    scale: float
    sha256: str
    layers: Tuple[str, ...]
    effect: Optional[Dict[str, Any]] = None

    def record(self) -> Dict[str, Any]:
        """The manifest's entry (``model.source.lora.adapters``)."""
        return {"name": self.name, "path": self.path, "scale": self.scale, "sha256": self.sha256,
                "layers": len(self.layers), **({"effect": self.effect} if self.effect else {})}


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


def check_library(entries: Sequence[Mapping[str, Any]], pipeline_cls: type, linears: Mapping[str, Tuple[int, int]],
                  model: str) -> List[Adapter]:
    """Every ``model.lora`` entry (``{path, scale, name}``) checked (:func:`file_problem`, :func:`target_problems`),
    names unique.

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
        found, layers = target_problems(where, sd, linears, model)
        problems += found
        out.append(Adapter(name, str(path.resolve()), scale, file_sha256(path), layers, effect))
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
        chosen = [{"name": n, "sha256": by_name[n].sha256, "scale": float(by_name[n].scale if scale is None else scale)}
                  for n in names]
        out.append(dataclasses.replace(r, values={**r.values, "lora": chosen}) if library else r)
    if bad:
        raise DatasetError(bad)
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

    def adapted_layers(self, transformer: torch.nn.Module) -> Dict[str, Any]:
        """``{module name: peft LoraLayer}`` of the transformer."""
        from peft.tuners.lora import LoraLayer

        return {n: m for n, m in transformer.named_modules() if isinstance(m, LoraLayer)}

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
                pipe.load_lora_weights(a.path, adapter_name=a.name, use_safetensors=True)
        finally:
            quiet.setLevel(level)
        layers = self.layers = self.adapted_layers(pipe.transformer)
        if self.fuse:
            self.fuse_set(pipe, layers, self.sets[0])
        elif self.observe:
            for lname, layer in layers.items():
                for aname, mod in layer.lora_A.items():
                    self.handles.append(mod.register_forward_hook(self._counter(lname, aname)))
        return {"mode": "fused" if self.fuse else "per_batch", "why": self.why,
                "adapters": [a.name for a in self.library], "layers": len(layers),
                "sets": [[list(p) for p in key] for key in self.sets]}

    def owned(self) -> Tuple[str, ...]:
        """Module-name prefixes of the unfused LoRA branches (``<layer>.lora_A``, ``<layer>.lora_B``): the linear
        backend leaves them alone (they run only for their adapter's batches; this runtime observes them)."""
        return tuple(f"{n}.{part}" for n in self.layers for part in ("lora_A", "lora_B"))

    def _counter(self, layer: str, adapter: str) -> Any:
        def hook(mod: Any, args: Any, out: Any) -> None:
            self.counts[(layer, adapter)] = self.counts.get((layer, adapter), 0) + 1
        return hook

    def fuse_set(self, pipe: Any, layers: Dict[str, Any], key: tuple) -> None:
        """``set_adapters`` + ``fuse_lora`` + ``unload_lora_weights``, with the checksum of every adapted layer before
        and after (module docstring); the result in :attr:`fused`."""
        names, weights = [n for n, _ in key], [s for _, s in key]
        pipe.set_adapters(names, weights)
        deltas = set_deltas(layers, key)
        before = {n: (x, sketch(layers[n].get_base_layer().weight, x)) for n, (x, _) in deltas.items()}
        pipe.fuse_lora(components=list(ADAPTED_COMPONENTS), lora_scale=1.0, adapter_names=names)
        after = {n: sketch(layers[n].get_base_layer().weight, x) for n, (x, _) in before.items()}
        pipe.unload_lora_weights()  # fused weights stay; the LoRA modules go (no per-forward cost)
        mods = dict(pipe.transformer.named_modules())
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
                      "delta_mismatch": bad, "verdict": "verified" if before and not bad and not nil else "mismatch"}
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
        else:
            pipe.disable_lora()
        self.current = key
        self.switches += 1

    def before_call(self) -> None:
        """Reset the per-call execution counts."""
        self.counts.clear()

    def after_call(self, batch_keys: Sequence[str]) -> None:
        """Record what the call's adapters did: per active adapter, the adapted layers that executed it, and any
        other adapter that executed (unfused, observed)."""
        if self.fuse or not self.observe:
            return
        active = {n for n, _ in (self.current or ())}
        want = {(ln, a) for ln, layer in self.layers.items() for a in layer.lora_A if a in active}
        ran = {k for k, v in self.counts.items() if v}
        self.calls.append({"items": list(batch_keys), "set": sorted(active), "missing": sorted(want - ran),
                           "foreign": sorted(ran - want)})

    def evidence(self, stage: str) -> Tuple[Dict[str, Any], List[str]]:
        """``(evidence.stages.<stage>.lora, mismatches)``."""
        mm: List[str] = []
        sec: Dict[str, Any] = {"mode": "fused" if self.fuse else "per_batch", "why": self.why,
                               "switches": self.switches}
        if self.fuse:
            sec["fused"] = self.fused
            if self.fused.get("verdict") != "verified":
                nil, bad = self.fused.get("changed_nothing") or [], self.fused.get("delta_mismatch") or []
                mm.append(f"stage {stage}: fused LoRA set {self.fused.get('set')}: "
                          + "; ".join(([f"{len(nil)} adapted layer(s) whose weights did not change {nil[:5]}"]
                                       if nil else []) + ([f"{len(bad)} whose change is not the adapter's delta "
                                                           f"{bad[:5]}"] if bad else []) or ["no adapted layer"]))
            return sec, mm
        nil = {k: v for k, v in self.nil.items() if v}
        sec["changed_nothing"] = [{"set": [list(p) for p in k], "layers": v} for k, v in nil.items()]
        mm += [f"stage {stage}: unfused LoRA set {[list(p) for p in k]}: {len(v)} adapted layer(s) whose LoRA branch "
               f"changes nothing (scaling * B @ A = 0: an adapter whose lora_B are zero) {v[:5]}"
               for k, v in nil.items()]
        if not self.observe:
            sec["verdict"] = "mismatch" if nil else "limited"
        else:
            bad = [c for c in self.calls if c["missing"] or c["foreign"]]
            sec.update(calls=len(self.calls), verdict="mismatch" if bad or nil else "verified",
                       first_bad=bad[0] if bad else None)
            mm += [f"stage {stage}: items {c['items'][:3]}: adapter set {c['set']}: {len(c['missing'])} adapted "
                   f"layer(s) did not run their LoRA branch ({[tuple(x) for x in c['missing'][:3]]}), "
                   f"{len(c['foreign'])} ran another adapter's ({[tuple(x) for x in c['foreign'][:3]]})"
                   for c in bad]
        return sec, mm
