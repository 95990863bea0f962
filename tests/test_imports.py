"""The project's modules import each other without cycles, and none uses another module's private names.

The import graph is built from the source (AST), over every module under ``runner/``, ``models/`` and
``runner/kernels/``: every import statement counts, module-level or inside a function (a lazy import only defers a
cycle), ``from pkg import mod`` is an edge to ``pkg.mod``, and relative imports are resolved. Only the body of
``if TYPE_CHECKING:`` is skipped (it never runs). Edges to a package's own ancestors (``runner.x`` importing
``runner``) are not counted: the ancestor is already being initialized when ``runner.x`` runs.

A private name is one with a single leading underscore. Using one across modules (``from runner.app.jobs import
_merged_code``, or ``jobs._merged_code`` through an imported module) couples a module to another's internals.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runner", "models")  # runner/kernels/ is under runner/


def _under(mod: str, pkg: str) -> bool:
    """``mod`` is ``pkg`` or one of its submodules (``runner.kernels.moe`` is under ``runner.kernels``)."""
    return mod == pkg or mod.startswith(pkg + ".")

Edge = Tuple[str, str, int]  # importer, imported, line


def project_modules(root: Path = REPO_ROOT) -> Dict[str, Path]:
    """Dotted name -> file of every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below ``node``, less the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield sub
                yield from _walk(sub)
            continue
        yield child
        yield from _walk(child)


def _resolve_relative(module: str, is_pkg: bool, level: int, name: Optional[str]) -> str:
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _known(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The longest prefix of ``name`` that is a project module (``runner.app.execute.run`` -> ``runner.app.execute``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in modules:
            return cand
    return None


def analyse(modules: Dict[str, Path]) -> Tuple[List[Edge], List[str]]:
    """The import edges between project modules, and every use of a private name across modules
    (``"importer:line: uses imported._name"``)."""
    edges: List[Edge] = []
    private: List[str] = []
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        bound: Dict[str, str] = {}  # local name -> project module it is bound to (for `mod._x` uses)

        def add(target: Optional[str], line: int) -> None:
            if target and target != mod and not mod.startswith(target + "."):
                edges.append((mod, target, line))

        nodes = list(_walk(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    target = _known(a.name, modules)
                    add(target, node.lineno)
                    if target and a.asname and a.name == target:
                        bound[a.asname] = target
            elif isinstance(node, ast.ImportFrom):
                src = (_resolve_relative(mod, is_pkg, node.level, node.module) if node.level
                       else node.module or "")
                src_mod = _known(src, modules)
                if src_mod is None:
                    continue
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    if sub in modules:  # `from pkg import mod`
                        add(sub, node.lineno)
                        bound[a.asname or a.name] = sub
                        continue
                    add(src_mod, node.lineno)
                    if a.name.startswith("_") and not a.name.startswith("__") and src_mod != mod:
                        private.append(f"{mod}:{node.lineno}: from {src} import {a.name}")
        for node in nodes:
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and bound[node.value.id] != mod):
                private.append(f"{mod}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return edges, private


def strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's strongly connected components with more than one node (the import cycles), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return sorted(out)


def describe_cycles(edges: List[Edge]) -> List[str]:
    """One line per cycle: its modules, then every import between them (``importer:line -> imported``)."""
    graph: Dict[str, Set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
    lines = []
    for comp in strongly_connected(graph):
        members = set(comp)
        inner = sorted({f"{a}:{ln} -> {b}" for a, b, ln in edges if a in members and b in members})
        lines.append(f"cycle {' <-> '.join(comp)}: " + "; ".join(inner))
    return lines


def test_cycle_finder_finds_cycles():
    """The finder itself: it must report a cycle when there is one (else the main test could never fail)."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert strongly_connected(g) == [["a", "b", "c"], ["e", "f"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}}) == []
    lines = describe_cycles([("x", "y", 3), ("y", "x", 7), ("y", "z", 8)])
    assert lines == ["cycle x <-> y: x:3 -> y; y:7 -> x"]


def test_analysis_sees_lazy_relative_and_private_imports(tmp_path):
    """The edges the main test relies on: function-level imports, ``from pkg import mod``, relative imports,
    ``TYPE_CHECKING`` skipped, private names found both ways."""
    pkg = tmp_path / "runner"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from runner import b\n    return b._hidden\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runner.c import X\n"
                              "from .a import _g, f\n")
    (pkg / "c.py").write_text("import runner.a as ra\n")
    mods = project_modules(tmp_path)
    edges, private = analyse(mods)
    assert sorted((a, b) for a, b, _ in edges) == [("runner.a", "runner.b"), ("runner.b", "runner.a"),
                                                   ("runner.b", "runner.a"), ("runner.c", "runner.a")]
    assert describe_cycles(edges)[0].startswith("cycle runner.a <-> runner.b")
    assert sorted(private) == ["runner.a:3: b._hidden (runner.b)", "runner.b:4: from runner.a import _g"]


def test_no_import_cycles():
    edges, _ = analyse(project_modules())
    cycles = describe_cycles(edges)
    assert not cycles, "import cycles among the project's modules:\n" + "\n".join(cycles)


def test_no_private_names_across_modules():
    _, private = analyse(project_modules())
    assert not private, "private names used across modules:\n" + "\n".join(private)


def test_kernels_import_nothing_from_runner_but_its_errors():
    """``runner/kernels/`` is the backend layer under the engines: from ``runner`` it may import ``runner.core.errors``
    only (every import statement counts, lazy ones too)."""
    edges, _ = analyse(project_modules())
    bad = sorted(f"{a}:{line}: imports {b}" for a, b, line in edges
                 if _under(a, "runner.kernels") and not _under(b, "runner.kernels") and _under(b, "runner")
                 and b != "runner.core.errors")
    assert not bad, "runner/kernels/ imports from runner/ beyond runner.core.errors:\n" + "\n".join(bad)


def test_the_rule_above_sees_a_kernels_import_of_runner(tmp_path):
    """The check can fail: a kernels module importing runner.core.paths is an edge it reports."""
    for pkg, files in {"runner": {"__init__.py": "", "core/__init__.py": "", "core/paths.py": "",
                                  "core/errors.py": "", "kernels/__init__.py": "",
                                  "kernels/x.py": "def f():\n    from runner.core import paths\n"},
                       "models": {"__init__.py": ""}}.items():
        for name, text in files.items():
            f = tmp_path / pkg / name
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
    edges, _ = analyse(project_modules(tmp_path))
    assert ("runner.kernels.x", "runner.core.paths", 2) in edges


# ------------------------------------------------------------------------------------- the engines' config seam
#: Packages whose modules read typed configs only (``runner.core.schema`` dataclasses, plain dicts): the composed
#: ``DictConfig`` stays in ``runner/`` (the precedence resolution of ``runner.core.resolve`` reads its layers).
TYPED_ONLY = ("models", "runner.kernels")


def omegaconf_imports(modules: Dict[str, Path], packages: Tuple[str, ...] = TYPED_ONLY) -> List[str]:
    """``"module:line: import ..."`` for every import of ``omegaconf`` (any name, lazy imports and the body of
    ``if TYPE_CHECKING:`` too) by a module of ``packages``."""
    out = []
    for mod, path in modules.items():
        if not any(_under(mod, p) for p in packages):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                out += [f"{mod}:{node.lineno}: import {a.name}" for a in node.names
                        if a.name.split(".")[0] == "omegaconf"]
            elif (isinstance(node, ast.ImportFrom) and not node.level
                  and (node.module or "").split(".")[0] == "omegaconf"):
                out.append(f"{mod}:{node.lineno}: from {node.module} import "
                           + ", ".join(a.name for a in node.names))
    return sorted(out)


def test_models_and_kernels_import_no_omegaconf():
    """No engine module (nor a kernel) imports ``DictConfig``/``OmegaConf``: engines read ``ctx.run`` and
    ``ctx.model`` (typed), the composed config reaches them only as the opaque handle ``ctx.cfg`` that
    ``runner.core.resolve`` reads."""
    bad = omegaconf_imports(project_modules())
    assert not bad, "models/ or runner/kernels/ import omegaconf (read ctx.run / ctx.model instead):\n" + "\n".join(bad)


def test_the_omegaconf_rule_sees_every_form_of_import(tmp_path):
    """The check can fail: module-level, lazy, ``import omegaconf``, ``from omegaconf.x import`` and a
    ``TYPE_CHECKING`` import are all reported; ``runner/`` may import it."""
    files = {"models/__init__.py": "", "models/a.py": "from omegaconf import DictConfig\n",
             "models/b.py": "def f():\n    from omegaconf import OmegaConf\n    return OmegaConf\n",
             "models/c.py": "import omegaconf.errors as oe\n",
             "models/d.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from omegaconf import DictConfig\n"),
             "runner/kernels/__init__.py": "", "runner/kernels/k.py": "import json, omegaconf\n",
             "runner/__init__.py": "", "runner/r.py": "from omegaconf import DictConfig\n"}
    for name, text in files.items():
        f = tmp_path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    assert sorted(omegaconf_imports(project_modules(tmp_path))) == [
        "models.a:1: from omegaconf import DictConfig", "models.b:2: from omegaconf import OmegaConf",
        "models.c:1: import omegaconf.errors", "models.d:3: from omegaconf import DictConfig",
        "runner.kernels.k:1: import omegaconf"]


# ------------------------------------------------------------------------------------------- function length
MAX_FUNCTION_LINES = 80
#: Offline training scripts of the toy models (run by hand to rebuild their weights, never by the runner).
LONG_FUNCTIONS_ALLOWED = {"models.toy_motion.train:main", "models.toy_shapes.train:main"}


def long_functions(modules: Dict[str, Path], limit: int = MAX_FUNCTION_LINES) -> List[str]:
    """``"module:name: N lines"`` of every function or method (nested ones too) longer than ``limit`` lines,
    decorators excluded, docstring included."""
    out = []
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit and f"{mod}:{node.name}" not in LONG_FUNCTIONS_ALLOWED:
                    out.append(f"{mod}:{node.name}: {n} lines")
    return sorted(out)


def test_no_function_over_80_lines():
    bad = long_functions(project_modules())
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(bad)


def test_the_length_rule_counts_methods(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    body = "".join(f"        x{i} = {i}\n" for i in range(80))
    (tmp_path / "models" / "m.py").write_text(f"class A:\n    def long(self):\n{body}\n    def short(self):\n"
                                             "        pass\n")
    assert long_functions(project_modules(tmp_path)) == ["models.m:long: 81 lines"]


#: The tools that read run dirs (and start ``python -m runner`` where they re-run one): none needs torch to do so,
#: and each ``import torch`` costs a second or more per invocation (a repro tool run imported it through
#: ``runner.core.lossy``'s registry import until it was made lazy).
TORCH_FREE_READERS = ("runner.tools.repro", "runner.tools.report", "runner.tools.gate", "runner.tools.matrix",
                      "runner.tools.sweep", "runner.tools.export", "runner.tools.validate", "runner.core.rundir")


def test_the_run_dir_readers_import_no_torch():
    import subprocess
    import sys

    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, m + ' imports torch'\n")
    p = subprocess.run([sys.executable, "-c", code, *TORCH_FREE_READERS], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr[-2000:]
