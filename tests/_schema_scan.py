"""Which schema fields does the code read? A static scan of ``runner/``, ``models/``, ``runner/kernels/`` and the conf
YAML interpolations, used by ``test_schema.py``.

A field counts as read only through its *parent key*: ``parallelism.world_size`` is read by ``cfg.parallelism.
world_size``, ``par = cfg.parallelism; par.world_size``, ``OmegaConf.select(cfg, "parallelism.world_size")`` or
``${parallelism.world_size}``, never by an unrelated ``worker.world_size``. Access chains are built from
attributes, ``.get("key")``, ``["key"]``, ``getattr(node, "key")`` and ``OmegaConf.select`` paths; local names
assigned from a chain (or looping over one) stand for it; a name looping over a tuple of strings stands for each of them. ``CONFIG_NAMES``
lists the few objects that hold a config node under a name the scan cannot trace (a constructor argument).
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("runner", "models")  # runner/kernels/ is under runner/
ANY = "*"  # a key computed at run time (a stage name, a formatted path segment)

# name (after dropping a leading ``self.``) -> the config node it holds, where an assignment does not say so:
# the diffusers families (``models.pipelines.PipelineEngine``) keep the model as ``self.cfg``; ``DiffusersEngine`` and ``VLLMEngine`` keep it as ``model_cfg``
# (the vLLM engine: the typed stage model, ``ctx.model``); ``PipelineEngine.optimize(opts)`` gets ``cfg.optimize``;
# the engines keep the typed run config (``ctx.run``) as ``run``.
CONFIG_NAMES: Dict[Tuple[str, str], Tuple[str, ...]] = {
    **{(f"models/{m}.py", "cfg"): ("cfg", "model") for m in ("flux", "pipelines", "sd3", "qwen_image", "wan",
                                                                              "hidream", "source", "prompt_tokens",
                                                                              "diffusion_rows")},
    # the engines' parts (mixins of DiffusersEngine / PipelineEngine) hold the same names as the engine
    **{(f"models/{m}.py", "model_cfg"): ("cfg", "model") for m in ("diffusion_rows", "backend_passes")},
    **{(f"models/{m}.py", "ctx"): () for m in ("diffusion_rows", "backend_passes")},
    **{(f"models/{m}.py", "run"): ("cfg",) for m in ("diffusion_rows", "backend_passes")},
    ("models/pipelines.py", "opts"): ("cfg", "optimize"),
    ("models/vllm/engine.py", "model_cfg"): ("cfg", "model"),
    ("models/diffusers_engine.py", "model_cfg"): ("cfg", "model"),
    # an engine's ``ctx`` (models.base.StageContext) holds the run config as ``ctx.cfg``
    ("models/diffusers_engine.py", "ctx"): (),
    ("models/vllm/engine.py", "ctx"): (),
    ("models/vllm/engine.py", "run"): ("cfg",),
    ("models/diffusers_engine.py", "run"): ("cfg",),
    # models.memory.Fitting / settings get the run's ``memory`` and the model's ``quantization`` nodes
    ("models/memory.py", "mem"): ("cfg", "memory"),
    ("models/memory.py", "qcfg"): ("cfg", "model", "quantization"),
}
ROOTS = {"cfg"}  # names of the run config itself
PASS_THROUGH = {"_plain", "list", "dict", "tuple", "sorted", "bool", "int", "float", "str", "to_container", "create"}
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.(?:\w+|\*))+")


class _Chains:
    def __init__(self, rel: str, tree: ast.AST, tuples: Dict[str, List[str]]):
        self.rel = rel
        self.tuples = tuples  # module-level tuples of strings of every scanned module, by name (``FIELDS``)
        self.aliases: Dict[str, List[Tuple[str, ...]]] = {}
        self.consts: Dict[str, List[str]] = {}
        for node in ast.walk(tree):  # first pass: names bound to chains or to tuples of key strings
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self._bind(node.targets[0].id, node.value)
            elif isinstance(node, (ast.For, ast.comprehension)):
                self._bind_loop(node.target, node.iter)

    def _bind(self, name: str, value: ast.AST) -> None:
        for c in self.chains(value, depth=1):
            if c[:1] != (name,):
                self.aliases.setdefault(name, []).append(c)

    def _bind_loop(self, target: ast.AST, it: ast.AST) -> None:
        named = it.attr if isinstance(it, ast.Attribute) else it.id if isinstance(it, ast.Name) else None
        keys = _strings(it) or self.tuples.get(named, [])
        if keys and isinstance(target, ast.Name):
            self.consts.setdefault(target.id, []).extend(keys)
            return
        # for s, v in X.items() / for s in X / for v in X.values()
        call = it.func.attr if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) else None
        base = it.func.value if call in ("items", "values", "keys") else it
        for c in self.chains(base, depth=1):
            if isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name):
                self.aliases.setdefault(target.elts[1].id, []).append(c + (ANY,))
            elif isinstance(target, ast.Name) and call in ("values", None):  # for e in cfg.model.lora: an element
                self.aliases.setdefault(target.id, []).append(c + (ANY,))

    def _key(self, node: ast.AST) -> List[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Name) and node.id in self.consts:
            return self.consts[node.id]
        return [ANY]

    def chains(self, node: ast.AST, depth: int = 0) -> List[Tuple[str, ...]]:
        """Every access chain ``node`` may stand for (empty: not a config access)."""
        if isinstance(node, ast.Name):
            key = (self.rel, node.id)
            if key in CONFIG_NAMES:
                return [CONFIG_NAMES[key]]
            if depth < 4 and node.id in self.aliases:
                return [c for a in self.aliases[node.id] for c in self._expand(a, depth)]
            return [(node.id,)]
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return self.chains(ast.Name(id=node.attr), depth)
            return [c + (node.attr,) for c in self.chains(node.value, depth)]
        if isinstance(node, ast.Subscript):
            return [c + (k,) for c in self.chains(node.value, depth) for k in self._key(node.slice)]
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name == "get" and isinstance(f, ast.Attribute) and node.args:
                return [c + (k,) for c in self.chains(f.value, depth) for k in self._key(node.args[0])]
            if name == "getattr" and isinstance(f, ast.Name) and len(node.args) >= 2:  # a dataclass's field
                return [c + (k,) for c in self.chains(node.args[0], depth) for k in self._key(node.args[1])]
            if name == "select" and len(node.args) == 2:
                return [c + p for c in self.chains(node.args[0], depth) for p in self.paths(node.args[1])]
            if name in PASS_THROUGH and node.args:
                return self.chains(node.args[0], depth)
            return []
        if isinstance(node, ast.BoolOp):
            return [c for v in node.values for c in self.chains(v, depth)]
        if isinstance(node, ast.IfExp):
            return self.chains(node.body, depth) + self.chains(node.orelse, depth)
        return []

    def _expand(self, chain: Tuple[str, ...], depth: int) -> List[Tuple[str, ...]]:
        head = ast.Name(id=chain[0])
        return [c + chain[1:] for c in self.chains(head, depth + 1)] if chain[0] in self.aliases else [chain]

    def paths(self, node: ast.AST) -> List[Tuple[str, ...]]:
        """The segments of a dotted key path (``"model.backend"``, ``f"model.stages.{s}.backend.{fld}"``: a
        formatted name that loops over key strings stands for each of them, any other for ``*``), else []."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts = [node.value]
        elif isinstance(node, ast.JoinedStr):
            texts = [""]
            for v in node.values:
                if isinstance(v, ast.Constant):
                    texts = [x + str(v.value) for x in texts]
                else:
                    inner = v.value if isinstance(v, ast.FormattedValue) else None
                    keys = self.consts.get(inner.id, [ANY]) if isinstance(inner, ast.Name) else [ANY]
                    texts = [x + k for x in texts for k in keys]
        else:
            return []
        return [tuple(x.split(".")) for x in texts if DOTTED.fullmatch(x)]


def _strings(node: ast.AST) -> List[str]:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        keys = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return keys if len(keys) == len(node.elts) else []
    return []


def read_chains(roots: Iterable[str] = SCANNED) -> Set[Tuple[str, ...]]:
    """Every access chain and dotted key path in the scanned sources, plus ``${...}`` interpolations in conf/."""
    sources = {py.relative_to(REPO).as_posix(): py.read_text(encoding="utf-8")
               for root in roots for py in sorted((REPO / root).rglob("*.py"))}
    sources.pop("runner/core/schema.py", None)
    out = chains_of(sources)
    for y in sorted((REPO / "conf").rglob("*.yaml")):
        for m in re.finditer(r"\$\{([\w.]+)\}", y.read_text(encoding="utf-8")):
            out.add(("cfg",) + tuple(m.group(1).split(".")))
    return out


def chains_of(sources: Dict[str, str]) -> Set[Tuple[str, ...]]:
    """Every access chain and dotted key path in ``{relative path: source}``."""
    out: Set[Tuple[str, ...]] = set()
    trees = {rel: ast.parse(src) for rel, src in sources.items()}
    tuples = {n.targets[0].id: _strings(n.value) for tree in trees.values() for n in tree.body
              if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
              and _strings(n.value)}
    for rel, tree in trees.items():
        scan = _Chains(rel, tree, tuples)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)) and isinstance(
                    getattr(node, "ctx", ast.Load()), ast.Load):
                out.update(scan.chains(node))
            elif isinstance(node, (ast.Constant, ast.JoinedStr)):
                out.update(("cfg",) + p for p in scan.paths(node))
    return out


def _optional_inner(t: object) -> object:
    """``Optional[X]`` -> ``X``; any other type as it is."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t


def schema_fields(module) -> Dict[Tuple[str, str], Set[Tuple[str, ...]]]:
    """``(class, field) -> {parent key paths}`` for every field a schema dataclass declares (inherited fields count
    for the class that declares them): ``("ParallelismConfig", "mode") -> {("parallelism",)}``; a stage's fields have
    the parent ``("stages", "*")``, an element's of a list of dataclasses ``(<list field>, "*")`` (``model.lora``'s
    entries: ``("lora", "*")``); the run config's own fields the parent ``()``."""
    parents: Dict[type, Set[Tuple[str, ...]]] = {module.RunConfig: {()}}
    todo = [module.RunConfig]
    families = [c for c in vars(module).values() if dataclasses.is_dataclass(c) and isinstance(c, type)]
    while todo:
        cls = todo.pop()
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for t in _dataclasses_in(hints[f.name]) | _default_dataclasses(f):
                listed = typing.get_origin(_optional_inner(hints[f.name])) in (list, List)  # List[dataclass]: elements
                key = ("stages", ANY) if f.name == "stages" else (f.name, ANY) if listed else (f.name,)
                for sub in [c for c in families if issubclass(c, t)]:
                    if key not in parents.setdefault(sub, set()):
                        parents[sub].add(key)
                        todo.append(sub)
    out: Dict[Tuple[str, str], Set[Tuple[str, ...]]] = {}
    for cls, ps in parents.items():
        for f in dataclasses.fields(cls):
            owner = next(c for c in cls.__mro__ if f.name in getattr(c, "__annotations__", {}))
            out.setdefault((owner.__name__, f.name), set()).update(parents.get(owner, set()) | ps)
    return out


def _dataclasses_in(t) -> Set[type]:
    if dataclasses.is_dataclass(t) and isinstance(t, type):
        return {t}
    return {c for a in typing.get_args(t) for c in _dataclasses_in(a)}


def _default_dataclasses(f: dataclasses.Field) -> Set[type]:
    """Dataclasses in a field's default (``stages: Any = {"denoise": StageConfig()}``)."""
    if f.default_factory is dataclasses.MISSING:
        return set()
    d = f.default_factory()
    vals = d.values() if isinstance(d, dict) else [d]
    return {type(v) for v in vals if dataclasses.is_dataclass(v)}


def is_read(parents: Set[Tuple[str, ...]], name: str, chains: Set[Tuple[str, ...]]) -> bool:
    """Some chain reads ``name`` right below one of its parent key paths (the run config's fields: right below a
    root name)."""
    for c in chains:
        for i in range(1, len(c)):
            if c[i] != name:
                continue
            for p in parents:
                if p == () and i == 1 and c[0] in ROOTS:
                    return True
                if p and i >= len(p) and all(a == b or b == ANY for a, b in zip(c[i - len(p):i], p)):
                    return True
    return False


def registry_reads() -> Dict[str, Set[str]]:
    """Schema class -> the fields its registry's records read by name, which no access chain shows:
    ``CacheConfig``'s method parameters are read as ``getattr(cfg.cache, f)`` for ``f`` in the chosen method's
    ``reads`` (``models.cache.CacheMethod``), so a field counts as read when a registered method reads it."""
    from models.cache import CACHE_METHODS

    return {"CacheConfig": {f for m in CACHE_METHODS.values() for f in m.reads}}


def unread_fields(module, chains: Set[Tuple[str, ...]] = None,
                  by_registry: Optional[Dict[str, Set[str]]] = None) -> List[str]:
    chains = read_chains() if chains is None else chains
    by_registry = registry_reads() if by_registry is None else by_registry
    return sorted(f"{cls}.{name}" for (cls, name), ps in schema_fields(module).items()
                  if not is_read(ps, name, chains) and name not in by_registry.get(cls, ()))
