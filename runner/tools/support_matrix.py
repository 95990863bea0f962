"""Support matrix generated from what ran: feature x family x platform, read from the committed GPU results.

``python -m runner.support_matrix`` (this module) reads ``benchmarks/results/`` and writes
``docs/support_matrix.md``; ``--check`` compares the committed page with what it would write now and exits 1 when
they differ (CI: ``tests/test_support_matrix.py``); ``--print`` writes the page to stdout.

Rows come from the registries, never from a list kept here (:func:`axes`): the model families
(``models.registry.FAMILIES``), the attention/linear/MoE backends (``runner.kernels.registry.BACKENDS``), the weight
quantization methods (``runner.kernels.quantization.METHODS``), the step-cache methods (``models.cache.CACHE_METHODS``),
the offload plans (``memory.offload``: ``runner.core.schema.OffloadMode``), LoRA fusing (``model.lora_fuse``:
``LoraFuse``), the conditioning tasks (``models.family.TASKS``), the metrics (``runner.core.metrics.REGISTRY``) and
the parallelism modes (``ParallelismMode``). Columns: the families, plus the non-family engines a model config
names as its engine (``vllm``) in the backend tables.

Evidence (:func:`collect`), every file under the results dir:

* ``cuda_tests_*.log`` (``scripts/ci/cuda.sh`` output): per-test outcomes where the log names them (``PASSED``/
  ``FAILED``/``ERROR`` lines of ``-rA``/``-v``, failure headers ``___ test_x[...] ___`` with their first ``E`` line,
  ``SKIPPED [n] file:line: reason``), the device from the header, the totals line;
* ``*.jsonl`` (``GPU_E2E_SUMMARY`` lines of ``tests/test_gpu_e2e.py``): one verified run per line (``model``,
  ``attention``, ``linear``, ``moe``, ``verdict``, ``device_name``, the test id; ``overrides``/``commit`` if present);
* ``*.json`` (benchmark results): every object holding an ``overrides`` list and an outcome (``exit_code``,
  ``exit_codes``, ``status``, ``verdict`` or ``evidence.verdict``, ``error``, ``refused``).

What a run exercised is read from what it names: its overrides (``model=``, ``experiment=`` expanded from
``conf/experiment``, ``backend.<field>=``, ``model.quantization.<c>=``, ``cache.method=``, ``memory.offload=``,
``model.lora_fuse=``, ``model.task=``, ``parallelism=``, ``metrics.names=``), a record's ``memory_plan`` (the
offload plan ``auto`` took, the quantization methods), the summary line's resolved backends,
and a test id's parameters (``[tiny_flux_hd64-SAGE_ATTN-FP8]``: a model config, or its name plus ``_suffix``, and
canonical names that belong to exactly one axis). Nothing is inferred from a registry entry or an import.

A run passed when its exit code is 0 (all of ``exit_codes``), its evidence verdict (if recorded) is ``verified`` and
its status (if recorded) is ``completed``; a test passed on a ``PASSED`` line or a summary line with verdict
``verified``. Exit code 2 with an error is a refusal; a skip is a skip with its reason. Runs named as negative controls
(``negative_control`` in their key or test id) are deliberate failures and are not evidence.

Cell of (feature, column) on an sm90 GPU, an H100 or H200 (:func:`decide`; the two are one column: the same compute
capability, so the same kernels, backends and refusals; only their memory differs, and each note names the card): the evidence from the newest result (date, then the time of
the commit that added the file) among passes and failures — ``verified``, ``failed`` or both when one result holds
both — else the newest skip; else ``refused`` when the registries' own checks refuse it on sm90 (bf16, the
family's head_dim, mask and MoE shape; packages assumed installed, so a refusal is the hardware's or the model's);
else ``CPU only`` when the CPU accepts it, else ``not run``. The CPU column is the registries' verdict for a CPU.
Each result file's commit and date are its own (``commit``/``git.commit``, ``date``/``started``) where it records
them, else the date in its name and the commit that added it (``git log --diff-filter=A``); a shallow clone falls
back to the table of result files in the page being replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import re
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from runner.core.errors import UserInputError

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path("benchmarks/results")
PAGE = Path("docs/support_matrix.md")
COMMAND = "python -m runner.support_matrix"
GPU = "H200"  # the refusal context of the sm90 column (sm90, bf16)
#: The cards of the sm90 column (Hopper): a result from either decides its cells, its note names which.
SM90 = ("H200", "H100")
SM90_TITLE = "sm90 (H100/H200)"
PASSED, FAILED, SKIPPED, REFUSED = "passed", "failed", "skipped", "refused"
_DATE = re.compile(r"(20\d\d)[-_](\d\d)[-_](\d\d)")
_FIX = "; fix: repair or remove the file (a results file is JSON, JSON lines or a cuda.sh log)"
_MISSING = re.compile(r"\bis not installed\b|\bNo module named\b")


class SupportMatrixError(UserInputError, ValueError):
    """A result file that cannot be read (names the file, the problem and the fix)."""


# ---------------------------------------------------------------------------------------------------- axes


@dataclass(frozen=True)
class Axis:
    """One feature dimension: its rows enumerated from a registry.

    Attributes:
        key: short name (``attention``).
        title: section heading.
        setting: the config key that selects a value (for the page).
        values: the registry's canonical values, in its order.
        source: where the values come from (for the page).
    """

    key: str
    title: str
    setting: str
    values: Tuple[str, ...]
    source: str


def axes() -> List[Axis]:
    """Every feature axis with its values, read from the registries at call time (a value registered later, e.g. a
    new cache method, is a new row)."""
    from runner.kernels import quantization
    from runner.kernels.registry import BACKENDS
    from models import cache, family, registry
    from runner.core import metrics, schema

    def enum(e: Any) -> Tuple[str, ...]:
        return tuple(str(m.value) for m in e)

    return [
        Axis("family", "Model families", "model.engine", tuple(registry.family_names()), "models.registry.FAMILIES"),
        Axis("attention", "Attention backends", "backend.attention", tuple(BACKENDS["attention"]),
             "runner.kernels.registry.BACKENDS"),
        Axis("linear", "Linear backends", "backend.linear", tuple(BACKENDS["linear"]), "runner.kernels.registry.BACKENDS"),
        Axis("moe", "MoE backends", "backend.moe", tuple(BACKENDS["moe"]), "runner.kernels.registry.BACKENDS"),
        Axis("quantization", "Weight quantization", "model.quantization.<component>", tuple(quantization.METHODS),
             "runner.kernels.quantization.METHODS"),
        Axis("cache", "Step caches", "cache.method", tuple(cache.CACHE_METHODS), "models.cache.CACHE_METHODS"),
        Axis("offload", "Offload plans", "memory.offload", enum(schema.OffloadMode), "runner.core.schema.OffloadMode"),
        Axis("lora", "LoRA", "model.lora_fuse (with model.lora set)", enum(schema.LoraFuse),
             "runner.core.schema.LoraFuse"),
        Axis("task", "Conditioning tasks", "model.task", tuple(family.TASKS), "models.family.TASKS"),
        Axis("metric", "Metrics", "metrics.names", tuple(metrics.REGISTRY), "runner.core.metrics.REGISTRY"),
        Axis("parallelism", "Parallelism modes", "parallelism", enum(schema.ParallelismMode),
             "runner.core.schema.ParallelismMode"),
    ]


BACKEND_AXES = ("attention", "linear", "moe")


# ----------------------------------------------------------------------------------------- model configs


@dataclass(frozen=True)
class ModelConfig:
    """A ``conf/model`` config: its engine (a family or another engine) and the task it sets (None: the
    family's)."""

    name: str
    engine: str
    task: Optional[str]


def model_configs(root: Path) -> Dict[str, ModelConfig]:
    """``{config name: ModelConfig}`` of ``conf/model/*.yaml`` under ``root`` (a config without an engine, such as
    a multi-stage pipeline, takes its first stage's)."""
    import yaml

    out = {}
    for f in sorted((root / "conf" / "model").glob("*.yaml")):
        d = yaml.safe_load(f.read_text()) or {}
        engine = d.get("engine")
        if engine is None:
            stages = d.get("stages") or {}
            first = next(iter(stages.values()), {}) if isinstance(stages, dict) else {}
            engine = (first or {}).get("engine")
        if engine:
            out[f.stem] = ModelConfig(f.stem, str(engine), d.get("task"))
    return out


def columns(root: Path) -> List[str]:
    """The families, then the engines other model configs name (``vllm``)."""
    from models import registry

    fams = registry.family_names()
    engines = sorted({c.engine for c in model_configs(root).values()} - set(fams) - {"diffusers"})
    return [*fams, *[e for e in engines if e in registry.ENGINES]]


def experiment_overrides(root: Path, name: str) -> List[str]:
    """The overrides ``experiment=<name>`` stands for: its ``override /model: X`` defaults and its keys, flattened
    (``backend.attention=CUDNN_ATTN``); [] for an unknown experiment."""
    import yaml

    f = root / "conf" / "experiment" / f"{name}.yaml"
    if not f.is_file():
        return []
    d = yaml.safe_load(f.read_text()) or {}
    out = []
    for entry in d.pop("defaults", None) or []:
        if isinstance(entry, dict):
            for k, v in entry.items():
                out.append(f"{str(k).replace('override', '').strip().lstrip('/')}={v}")

    def flat(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                flat(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            out.append(f"{prefix}={v}")

    flat("", d)
    return out


# ---------------------------------------------------------------------------------------------- features


@dataclass
class Run:
    """One run (or test) a result file records, with what it exercised and how it ended.

    Attributes:
        file: the result file, relative to the repository root.
        detail: the test id or the key path of the record in the file.
        column: family or engine (None: unknown).
        features: axis -> values it set.
        platform: ``H200``, ``H100``, ``CPU``, another device name, or None (unknown).
        status: ``passed`` | ``failed`` | ``skipped`` | ``refused``.
        reason: why it failed, was skipped or refused ('' for a pass).
        date, commit: the file's (or the record's) own, else from git (:class:`Provenance`).
    """

    file: str
    detail: str
    column: Optional[str]
    features: Dict[str, List[str]]
    platform: Optional[str]
    status: str
    reason: str = ""
    date: str = ""
    commit: str = ""
    order: float = 0.0


class Features:
    """Reads feature values from overrides and test ids, normalised through the registries."""

    def __init__(self, root: Path):
        from models import registry

        self.root = root
        self.configs = model_configs(root)
        self.axes = {a.key: a for a in axes()}
        self.families = set(registry.family_names())
        bare: Dict[str, List[str]] = {}
        for a in self.axes.values():
            if a.key == "family":
                continue
            for v in a.values:
                bare.setdefault(v, []).append(a.key)
        # a bare token counts only when it names one value of one axis and is no generic word
        self.bare = {v: ks[0] for v, ks in bare.items() if len(ks) == 1 and v not in ("none", "auto", "single")}

    def column_of(self, model: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
        """``(column, task)`` of a model config name, a family name, or a config name plus ``_suffix``."""
        if not model:
            return None, None
        if model in self.configs:
            c = self.configs[model]
            return c.engine, c.task
        if model in self.families:
            return model, None
        best = max((n for n in self.configs if model.startswith(n + "_")), key=len, default=None)
        return (self.configs[best].engine, self.configs[best].task) if best else (None, None)

    def _norm(self, axis: str, value: str) -> Optional[str]:
        from runner.kernels import quantization
        from runner.kernels import registry as reg
        from models import cache

        value = value.strip().strip("'\"")
        try:
            if axis in BACKEND_AXES:
                v = reg.normalize(axis, value)
            elif axis == "quantization":
                v = quantization.normalize(value, "model.quantization")
            elif axis == "cache":
                m = cache.method_of(value)
                v = m.name if m is not None else "none"
            else:
                v = value
        except Exception:  # noqa: BLE001 - an unknown name is not evidence of any row
            return None
        return v if v in self.axes[axis].values else None

    def from_overrides(self, overrides: Sequence[str], into: Dict[str, List[str]]) -> Dict[str, Optional[str]]:
        """Add the features ``overrides`` set to ``into``; returns ``{"model": config, "task": task}`` seen."""
        seen: Dict[str, Optional[str]] = {"model": None, "task": None, "engine": None}
        expanded: List[str] = []
        for o in overrides:
            o = str(o).lstrip("+~")
            if o.startswith("experiment="):
                expanded += experiment_overrides(self.root, o.split("=", 1)[1])
            expanded.append(o)
        lora = False
        for o in expanded:
            if "=" not in o:
                continue
            key, value = o.split("=", 1)
            m = re.fullmatch(r"(?:.*\.)?backend\.(attention|linear|moe)(?:\.[\w.]+)?", key)
            if m:
                self._add(into, m.group(1), value)
            elif key == "model":
                seen["model"] = value
            elif key in ("model.engine", "model.adapter"):  # adapter: results recorded before issue #39
                seen["engine"] = value
            elif key == "model.task":
                seen["task"] = value
            elif key.startswith("model.quantization.") and key != "model.quantization.gguf_file":
                self._add(into, "quantization", value)
            elif key == "cache.method":
                self._add(into, "cache", value)
            elif key == "cache":
                mm = re.search(r"method\s*:\s*([\w+-]+)", value)
                if mm:
                    self._add(into, "cache", mm.group(1))
            elif key == "memory.offload":
                self._add(into, "offload", value)
            elif key == "model.lora_fuse":
                self._add(into, "lora", value)
            elif key == "model.lora" and value.strip() not in ("[]", "null", ""):
                lora = True
            elif key in ("parallelism", "parallelism.mode"):
                self._add(into, "parallelism", value)
            elif key == "metrics.names":
                for name in re.findall(r"[\w]+", value):
                    self._add(into, "metric", name)
        if lora and "lora" not in into:
            self._add(into, "lora", "auto")
        return seen

    def from_test_id(self, test: str, into: Dict[str, List[str]]) -> Optional[str]:
        """Add the features a test id's parameters name; returns the model config or family it names (or None)."""
        params = test[test.index("[") + 1:test.rindex("]")] if "[" in test and test.endswith("]") else ""
        model = None
        overrides = []
        for tok in re.split(r"[-\s]+", params):
            if not tok:
                continue
            if "=" in tok:
                overrides.append(tok)
            elif self.column_of(tok)[0] is not None:
                model = model or tok
            elif tok in self.bare:
                self._add(into, self.bare[tok], tok)
        seen = self.from_overrides(overrides, into)
        return seen["model"] or model

    def _add(self, into: Dict[str, List[str]], axis: str, value: str) -> None:
        v = self._norm(axis, value)
        if v is not None and v not in into.setdefault(axis, []):
            into[axis].append(v)


def platform_of(text: Any, file: str) -> Optional[str]:
    """``H200`` / ``H100`` for those cards, ``CPU`` for a CPU, another GPU's name without ``NVIDIA ``; from the
    file's name (``_h200``, ``_h100``, ``_cpu``) when ``text`` says nothing."""
    if isinstance(text, dict):
        text = text.get("name") or text.get("device_name") or ""
    s = str(text or "")
    for card in SM90:
        if re.search(card, s, re.I):
            return card
    if re.fullmatch(r"\s*cpu\b.*", s, re.I):
        return "CPU"
    if s and "cuda" not in s.lower():
        return s.replace("NVIDIA ", "").strip()
    name = Path(file).name.lower()
    for card in SM90:
        if f"_{card.lower()}" in name:
            return card
    if "_cpu" in name:
        return "CPU"
    return None


# ------------------------------------------------------------------------------------------------ parsers


def _short(s: Any, n: int = 240) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[:n - 3] + "..."


def parse_log(path: Path, rel: str, feats: Features) -> Tuple[List[Run], Dict[str, Any]]:
    """Runs of a ``cuda.sh`` log, and the log's summary (``device``, ``totals``, ``skips``, ``failed``).

    Raises:
        SupportMatrixError: the file cannot be read as text.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise SupportMatrixError(f"{rel}: {e}" + _FIX) from None
    lines = text.splitlines()
    dev = re.search(r"device 0: ([^;\n]+)", text)
    platform = platform_of(dev.group(1) if dev else None, rel)
    outcomes: Dict[str, Tuple[str, str]] = {}
    for i, line in enumerate(lines):
        line = re.sub(r"\s+\[\s*\d+%\]$", "", line)  # pytest -v's progress column (cuda.sh runs -v)
        m = re.match(r"^(PASSED|FAILED|ERROR)\s+(\S+::.+?)(?:\s+-\s+(.*))?$", line) or \
            re.match(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)\b(?:\s*\(?(.*?)\)?)?$", line)
        if m:
            a, b, why = m.group(1), m.group(2), m.group(3) or ""
            status, test = (a, b) if a in ("PASSED", "FAILED", "ERROR") else (b, a)
            if status == "SKIPPED":
                continue  # skips are read from the SKIPPED [n] lines with their reasons
            st = PASSED if status == "PASSED" else FAILED
            if st == FAILED or test not in outcomes:
                outcomes[test] = (st, why or outcomes.get(test, ("", ""))[1])
            continue
        m = re.match(r"^_{1,}\s+(test_\S+(?:\[.*\])?)\s+_{1,}$", line)
        if m:
            why = next((x[1:].strip() for x in lines[i + 1:i + 400] if x.startswith("E ")), "")
            test = m.group(1)
            prev = next((t for t in outcomes if t.split("::")[-1] == test), None)
            outcomes[prev or test] = (FAILED, why or (outcomes.get(prev, ("", ""))[1] if prev else ""))
    runs: List[Run] = []
    for test, (st, why) in outcomes.items():
        if "negative_control" in test:
            continue
        f: Dict[str, List[str]] = {}
        model = feats.from_test_id(test, f)
        col, task = feats.column_of(model)
        runs.append(_with_family(Run(rel, test, col, f, platform, st, _short(why)), feats, task))
    skips = []
    for m in re.finditer(r"^SKIPPED \[(\d+)\] (\S+?):(\d+): (.*)$", text, re.M):
        n, where, reason = int(m.group(1)), m.group(2), m.group(4).strip()
        skips.append({"count": n, "where": where, "reason": reason})
        f = {}
        seen = feats.from_overrides(re.findall(r"\S+=\S+", reason), f)
        col, _ = feats.column_of(seen["model"])
        if f:  # a skip is evidence only about the features it names, not about the family
            runs.append(Run(rel, f"{where} (skipped x{n})", col, f, platform, SKIPPED, _short(reason)))
    totals = {}
    tail = next((x for x in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|deselected)", x)), "")
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail):
        totals[what.rstrip("s") if what.startswith("error") else what] = int(n)
    return runs, {"device": dev.group(1).strip() if dev else None, "platform": platform, "totals": totals,
                  "skips": skips, "failed": sorted(t for t, (s, _) in outcomes.items() if s == FAILED)}


def _with_family(run: Run, feats: Features, task: Optional[str]) -> Run:
    """Add the run's family to its features (axis ``family``) and its task (the config's, else the family's
    generation task) when it has a family column."""
    from models import registry

    if run.column in feats.families:
        run.features.setdefault("family", [run.column])
        if "task" not in run.features:
            t = task or registry.family_spec(run.column).generation_task
            run.features["task"] = [t]
    return run


def parse_jsonl(path: Path, rel: str, feats: Features) -> List[Run]:
    """Runs of a ``GPU_E2E_SUMMARY`` file: one JSON object per line.

    Raises:
        SupportMatrixError: a line that is not a JSON object.
    """
    runs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as e:
            raise SupportMatrixError(f"{rel}:{i}: not JSON ({e})" + _FIX) from None
        if not isinstance(d, dict):
            raise SupportMatrixError(f"{rel}:{i}: not a JSON object" + _FIX)
        test = str(d.get("test") or f"line {i}")
        if "negative_control" in test:
            continue
        f: Dict[str, List[str]] = {}
        model = feats.from_test_id(test, f)
        seen = feats.from_overrides(d.get("overrides") or [], f)
        model = d.get("model") or seen["model"] or model
        att = d.get("attention")
        for v in (att.values() if isinstance(att, dict) else [att]):
            if v:
                feats._add(f, "attention", str(v))
        for k in ("linear", "moe"):
            if d.get(k):
                feats._add(f, k, str(d[k]))
        col, task = feats.column_of(model)
        ok = d.get("verdict") == "verified"
        run = Run(rel, test, col, f, platform_of(d.get("device_name"), rel), PASSED if ok else FAILED,
                  "" if ok else f"evidence verdict {d.get('verdict')!r}",
                  date=str(d.get("date") or "")[:10], commit=str(d.get("commit") or "")[:7])
        runs.append(_with_family(run, feats, seen["task"] or task))
    return runs


def _outcome(node: Mapping[str, Any]) -> Optional[Tuple[str, str]]:
    """``(status, reason)`` of a benchmark record, or None when it records no outcome. A record stopped by a signal
    (exit code 128 + N, status ``interrupted``: a device call's time limit) is skipped, not failed: it says nothing
    of the feature. A lossy lane whose quality gate failed (``verdict: fail``, ``runner.tools.gate``) ran: it passes,
    with the gate's first reason as its note."""
    ev = node.get("evidence") if isinstance(node.get("evidence"), dict) else {}
    verdict = node.get("verdict") if node.get("verdict") in ("verified", "mismatch", "not_collected") else None
    verdict = ev.get("verdict", verdict)
    codes = node.get("exit_codes")
    codes = list(codes.values()) if isinstance(codes, dict) else codes if isinstance(codes, list) else None
    code = node.get("exit_code")
    status = node.get("status")
    error = node.get("refused") or node.get("error")
    if code is None and codes is None and verdict is None and status is None and not error:
        return None
    if error:
        if _MISSING.search(str(error)):  # the machine lacked a package: not run there, as pytest skips it
            return SKIPPED, _short(error)
        refused = node.get("refused") or code == 2 or status == "refused"
        return (REFUSED if refused else FAILED), _short(error)
    bad = [c for c in ([code] if code is not None else []) + (codes or []) if c != 0]
    if status == "interrupted" or any(128 < c < 160 for c in bad):  # a signal stopped it (the call's time limit)
        return SKIPPED, _short(f"interrupted before it finished (exit code {bad[0] if bad else '?'}: 128 + signal, "
                               "runner.app.run); no outcome of the feature")
    if bad:
        return FAILED, _short(f"exit code {bad[0]}" + (f", status {status}" if status else "")
                              + (f", evidence {verdict}" if verdict else ""))
    if status is not None and status != "completed":
        return (REFUSED if status == "refused" else FAILED), f"status {status}"
    if verdict is not None and verdict != "verified":
        mism = ev.get("mismatches") or node.get("mismatches") or []
        return FAILED, _short(f"evidence verdict {verdict}" + (f": {mism[0]}" if mism else ""))
    if node.get("verdict") == "fail":  # a lossy lane's quality gate (runner.tools.gate): it ran, its quality did not pass
        why = node.get("reasons") or []
        return PASSED, _short("ran, but its quality gate failed" + (f": {why[0]}" if why else ""))
    return PASSED, ""


def parse_json(path: Path, rel: str, feats: Features) -> List[Run]:
    """Runs of a benchmark JSON: every object with an ``overrides`` list and an outcome (:func:`_outcome`); the
    device, date, commit and model of a record come from it or its nearest enclosing object, else from the key
    path (a model config name in it) and the file.

    Raises:
        SupportMatrixError: the file is not JSON.
    """
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise SupportMatrixError(f"{rel}: not JSON ({e})" + _FIX) from None
    runs: List[Run] = []

    def walk(node: Any, keys: List[str], ctx: Dict[str, Any]) -> None:
        if isinstance(node, list):
            for i, x in enumerate(node):
                walk(x, [*keys, str(i)], ctx)
            return
        if not isinstance(node, dict):
            return
        ctx = dict(ctx)
        for k in ("device", "device_name", "date", "started", "family", "model"):
            if node.get(k) and (k != "model" or isinstance(node[k], str)):
                ctx[k] = node[k]
        if isinstance(node.get("git"), dict) and node["git"].get("commit"):
            ctx["commit"] = node["git"]["commit"]
        for k in ("commit", "after_commit"):
            if isinstance(node.get(k), str) and re.fullmatch(r"[0-9a-f]{7,40}", node[k]):
                ctx["commit"] = node[k]
        out = _outcome(node) if isinstance(node.get("overrides"), list) else None
        detail = "/".join(keys)
        if out is not None and "negative_control" not in detail:
            f: Dict[str, List[str]] = {}
            seen = feats.from_overrides(node["overrides"], f)
            plan = node.get("memory_plan")
            if isinstance(plan, dict):  # the plan memory.offload=auto took, and the methods it quantized with
                if plan.get("offload"):
                    feats._add(f, "offload", str(plan["offload"]))
                for method in (plan.get("quantization") or {}).values():
                    feats._add(f, "quantization", str(method))
            model = seen["model"] or seen["engine"]
            if model is None:  # nearest enclosing record, then the key path (gate_toy_shapes/jobs/fp8)
                model = ctx.get("model") or ctx.get("family")
            if feats.column_of(model)[0] is None:
                model = next((m for k in reversed(keys) for m in feats.configs
                              if k == m or k.endswith("_" + m) or k.startswith(m + "_")), model)
            col, task = feats.column_of(model)
            if out[0] == REFUSED:  # evidence only about what its message names, not about the family
                f = {k: [v for v in vs if v in out[1]] for k, vs in f.items()}
                f = {k: vs for k, vs in f.items() if vs}
            date = _DATE.search(str(ctx.get("date") or ctx.get("started") or ""))
            run = Run(rel, detail or "(top level)", col, f,
                      platform_of(ctx.get("device") or ctx.get("device_name"), rel), out[0], out[1],
                      date="-".join(date.groups()) if date else "", commit=str(ctx.get("commit") or "")[:7])
            runs.append(_with_family(run, feats, seen["task"] or task) if out[0] != REFUSED else run)
        for k, v in node.items():
            if k != "overrides":
                walk(v, [*keys, str(k)], ctx)

    walk(doc, [], {})
    return runs


# --------------------------------------------------------------------------------------------- provenance


class Provenance:
    """Commit and date of each result file: the commit that added it (``git log --diff-filter=A``) and its date,
    the name's date preferred; in a shallow clone (or outside git) the values the previous page recorded."""

    def __init__(self, root: Path, previous: Optional[str] = None):
        self.root = root
        self.previous: Dict[str, Tuple[str, str]] = {}
        for m in re.finditer(r"^\| `([^`]+)` \| ([^|]*?) \| ([^|]*?) \|", previous or "", re.M):
            self.previous[m.group(1)] = (m.group(2).strip().strip("`"), m.group(3).strip())
        self.shallow = self._git("rev-parse", "--is-shallow-repository") != "false"

    def _git(self, *args: str) -> Optional[str]:
        try:
            p = subprocess.run(["git", "-C", str(self.root), *args], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    def of(self, rel: str) -> Tuple[str, str, float]:
        """``(short commit, date YYYY-MM-DD, commit time)``; commit ``uncommitted`` for a file git does not have."""
        named = _DATE.search(Path(rel).name)
        named_date = "-".join(named.groups()) if named else ""
        out = None if self.shallow else self._git("log", "--diff-filter=A", "-1", "--format=%h,%cs,%ct", "--", rel)
        if out:
            h, d, t = out.split(",")
            return h[:7], named_date or d, float(t)
        if rel in self.previous:
            c, d = self.previous[rel]
            return c, d, 0.0
        return "uncommitted", named_date, float("inf")


# ------------------------------------------------------------------------------------------------ collect


@dataclass
class Evidence:
    """Everything read from the results dir: the runs, the cuda.sh logs' summaries, the files read and skipped."""

    runs: List[Run] = field(default_factory=list)
    logs: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    files: Dict[str, Tuple[str, str, int]] = field(default_factory=dict)  # file -> (commit, date, runs found)


def collect(root: Path, results: Optional[Path] = None, previous: Optional[str] = None) -> Evidence:
    """Read every result file under ``results`` (default ``<root>/benchmarks/results``).

    Args:
        root: the repository root (configs, git).
        results: the results dir (tests pass a synthetic one).
        previous: the page being replaced (its table of result files: provenance in a shallow clone).

    Raises:
        SupportMatrixError: a result file that cannot be parsed.
    """
    results = results or root / RESULTS
    feats = Features(root)
    prov = Provenance(root, previous)
    ev = Evidence()
    for path in sorted(p for p in results.rglob("*") if p.is_file()):
        try:
            rel = str(path.resolve().relative_to(root.resolve()))
        except ValueError:
            rel = str(path)
        if path.suffix == ".log" and path.name.startswith("cuda_tests"):
            runs, summary = parse_log(path, rel, feats)
            ev.logs[rel] = summary
        elif path.suffix == ".jsonl":
            runs = parse_jsonl(path, rel, feats)
        elif path.suffix == ".json":
            runs = parse_json(path, rel, feats)
        else:
            continue
        commit, date, order = prov.of(rel)
        for r in runs:
            r.commit = r.commit or commit
            r.date = r.date or date
            r.order = order
        gpu = [r for r in runs if r.platform not in (None, "CPU")]
        ev.runs += gpu
        if gpu or rel in ev.logs:
            ev.files[rel] = (commit, date, len(gpu))
    return ev


# ------------------------------------------------------------------------------------------------ refusals


@contextlib.contextmanager
def packages_assumed() -> Iterator[None]:
    """Inside the block every package entry point counts as installed (``runner.kernels.registry.has_symbol`` is True),
    so a refusal names the hardware or the model, not what this machine happens to have installed."""
    from runner.kernels import registry

    real = registry.has_symbol
    registry.has_symbol = lambda path: True
    try:
        yield
    finally:
        registry.has_symbol = real


def _arch(root: Path, family: str) -> Dict[str, Any]:
    import yaml

    f = root / "conf" / "model" / f"{family}.yaml"
    return (yaml.safe_load(f.read_text()) or {}).get("architecture") or {} if f.is_file() else {}


@functools.lru_cache(maxsize=None)
def family_facts(root: Path, column: str, dtype: Any) -> Dict[str, Any]:
    """``backend_fields``, ``head_dim``, ``needs_mask`` and ``moe_dims`` of family ``column``'s full-size config
    (``conf/model/<family>.yaml``), computed by its engine class's own methods on that config (no weights); a value
    the engine cannot compute from the config alone is None (unknown: requirements on it pass)."""
    import inspect

    from models import registry

    eng = registry.engine_class(column)
    arch = _arch(root, column)
    fake = types.SimpleNamespace(component_config=lambda n: dict(arch.get(n) or {}), cfg=types.SimpleNamespace(
        name=column), device="meta", dtype=dtype)

    def attr(name: str) -> Any:
        a = inspect.getattr_static(eng, name, None)
        with contextlib.suppress(Exception):
            return a.fget(fake) if isinstance(a, property) else (getattr(eng, name)(fake) if callable(a) else a)
        return None

    fields = tuple(attr("backend_fields") or registry.family_spec(column).backend_fields)
    moe = attr("moe_dims") if "moe" in fields else None
    hd = attr("head_dim")
    return {"backend_fields": fields, "head_dim": int(hd) if hd is not None else None,
            "needs_mask": bool(attr("needs_mask")), "moe_dims": tuple(moe) if moe is not None else None}


def selection_context(root: Path, column: Optional[str], platform: str) -> Any:
    """The ``SelectionContext`` of ``column``'s full-size config on ``platform``: ``H200`` (cuda, sm90, bf16) or
    ``CPU`` (float32); head_dim, mask and MoE shape from :func:`family_facts` (a non-family column: none)."""
    import torch

    from runner.kernels.registry import SelectionContext
    from models import registry

    if platform == "CPU":
        base = dict(platform_kind="cpu", sm=None, dtype=torch.float32)
    else:
        base = dict(platform_kind="cuda", sm=90, dtype=torch.bfloat16)
    if column not in registry.FAMILIES:
        return SelectionContext(**base)
    f = family_facts(root, column, base["dtype"])
    return SelectionContext(**base, head_dim=f["head_dim"], needs_mask=f["needs_mask"], moe_dims=f["moe_dims"])


def refusal(root: Path, axis: str, value: str, column: Optional[str], platform: str) -> Optional[str]:
    """Why the registries' own checks refuse ``value`` of ``axis`` for ``column`` (None: any family) on
    ``platform`` (``H200`` | ``CPU``), or None when they accept it (packages assumed installed)."""
    from models import registry

    spec = registry.family_spec(column) if column in registry.FAMILIES else None
    with packages_assumed():
        if axis in BACKEND_AXES:
            return _backend_refusal(root, axis, value, column, spec, platform)
        if column is not None and spec is None:
            return None
        if axis == "quantization":
            from runner.kernels import quantization

            why = quantization.get(value).unmet(selection_context(root, column, platform))
            return "; ".join(why) or None
        if axis == "offload":
            from models import memory

            mem = types.SimpleNamespace(offload=value, use_stream=False, blocks_per_group=1, vae_tiling=False,
                                        vae_slicing=False, max_gpu_gb=None)
            return _message(lambda: memory.settings(mem, "cpu" if platform == "CPU" else "cuda", None))
        if axis == "parallelism" and spec is None:
            return _parallel_refusal(root, value, None, None)
        if spec is None:
            return None
        if axis == "task" and value not in spec.tasks:
            return f"{column} has no pipeline for {value} (its tasks: {', '.join(spec.tasks)})"
        if axis == "metric":
            from runner.core import metrics

            kind = "video" if spec.video else "image"
            m = metrics.REGISTRY[value]
            return None if kind in m.kinds else f"scores {'/'.join(m.kinds)}s; {column} writes {kind}s"
        if axis == "cache":
            return _cache_refusal(value, column, spec)
        if axis == "parallelism":
            return _parallel_refusal(root, value, column, spec)
    return None


def _message(fn: Callable[[], Any]) -> Optional[str]:
    """The message of the refusal ``fn`` raises (a ``RunnerError``), or None when it returns."""
    from runner.core.errors import RunnerError

    try:
        fn()
    except RunnerError as e:
        return str(e)
    return None


def _backend_refusal(root: Path, axis: str, value: str, column: Optional[str], spec: Any,
                     platform: str) -> Optional[str]:
    from runner.kernels import registry as reg

    import torch

    b = reg.get(axis, value)
    fields = family_facts(root, column, torch.bfloat16)["backend_fields"] if spec is not None else BACKEND_AXES
    if axis not in fields:
        return f"the family's stages take no backend.{axis} (its backend fields: {', '.join(fields)})"
    if column is not None and spec is None:  # an AR engine
        if b.vllm is None:
            return f"no vLLM equivalent of {value}"
    elif column is not None and axis != "linear" and b.diffusers is None:
        return "not wired into diffusers stages (vLLM only)"
    why = b.unmet(selection_context(root, column, platform))
    return "; ".join(why) or None


def _cache_refusal(value: str, column: str, spec: Any) -> Optional[str]:
    from models import cache

    m = cache.CACHE_METHODS[value]
    if m.supports is not None:  # cache-dit decides from its own adapters at startup (needs it installed)
        return None
    s = cache.CacheSettings(method=m, schedule=m.schedule, params=dict(m.defaults))
    transformer = spec.components.get("transformer", ("", "", None))[1]
    return _message(lambda: cache.check_support(s, transformer, column, spec.tasks[spec.generation_task]))


def _parallel_refusal(root: Path, value: str, column: Optional[str], spec: Any) -> Optional[str]:
    import diffusers
    from omegaconf import OmegaConf

    from models import context_parallel
    from runner.app import checks
    from runner.core.distributed import CONTEXT_MODES, Layout

    if value in CONTEXT_MODES and spec is not None:
        lay = Layout(value, 1, 2 if value == "ring" else 1, 2 if value == "ulysses" else 1)
        transformer = spec.components.get("transformer", ("", "", None))[1]
        why = _message(lambda: context_parallel.check_model(column, transformer, _arch(root, column).get(
            "transformer") or {}, lay))
        return why.replace(f" {diffusers.__version__}", "") if why else None
    cfg = OmegaConf.create({"batch_size": 1, "dataset": {"limit": None}, "num_images_per_prompt": 1, "max_pixels": 1,
                            "output": {"write_workers": 0}, "parallelism": {"mode": value},
                            # data runs need a launcher (ray, slurm or torchrun); the other modes run under the
                            # default one (launcher=ray refuses parallelism=single: every single cell said refused)
                            "launcher": {"name": "ray" if value == "data" else "local"},
                            "evidence": {"enabled": False, "profile": False}})
    try:
        return _message(lambda: checks.check_run_values(cfg))
    except Exception:  # noqa: BLE001 - a mode whose check needs more than this config refuses nothing here
        return None


# -------------------------------------------------------------------------------------------------- cells


@dataclass
class Cell:
    """One (feature, column) on one platform: its state, the runs that decide it and the reason."""

    state: str  # verified | failed | verified+failed | skipped | refused | CPU only | not run | accepted
    runs: List[Run] = field(default_factory=list)
    reason: str = ""


def decide(runs: Sequence[Run], refused: Optional[str], cpu_refused: Optional[str]) -> Cell:
    """The sm90 cell from the runs of one (feature, column) on an H100 or H200 and the registries' verdicts.

    Args:
        runs: the runs that exercised the feature in that column on an H100 or H200.
        refused: the registries' refusal on sm90 (None: accepted).
        cpu_refused: the registries' refusal on a CPU (None: accepted).

    Returns:
        The newest passes/failures (same date and commit time: both kept), else the newest skips, else
        ``refused`` / ``CPU only`` / ``not run``.
    """
    ran = [r for r in runs if r.status in (PASSED, FAILED, REFUSED)]
    pool = ran or [r for r in runs if r.status == SKIPPED]
    if pool:
        key = max((r.date, r.order) for r in pool)
        newest = [r for r in pool if (r.date, r.order) == key]
        states = {r.status for r in newest}
        state = "+".join(name for st, name in ((PASSED, "verified"), (FAILED, "failed"), (REFUSED, "refused"),
                                               (SKIPPED, "skipped")) if st in states)
        return Cell(state, newest, next((r.reason for r in newest if r.status != PASSED), ""))
    if refused:
        return Cell("refused", [], refused)
    return Cell("not run", [], cpu_refused) if cpu_refused else Cell("CPU only")


# ------------------------------------------------------------------------------------------------- render


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


class Page:
    """Builds the Markdown page: numbered notes for evidence and reasons, shared by the cells."""

    def __init__(self) -> None:
        self.notes: Dict[str, str] = {}

    def note(self, prefix: str, text: str) -> str:
        for k, v in self.notes.items():
            if v == text and k.startswith(prefix):
                return k
        k = f"{prefix}{sum(1 for x in self.notes if x.startswith(prefix)) + 1}"
        self.notes[k] = text
        return k

    def cell(self, c: Cell) -> str:
        if c.runs:
            refs = []
            for r in sorted(c.runs, key=lambda r: (r.status != PASSED, r.file, r.detail)):
                what = "verified" if r.status == PASSED else r.status
                text = (f"{what} on the {r.platform} at commit `{r.commit}` on {r.date}: `{r.file}` "
                        f"({_esc(r.detail)})" + (f": {_esc(r.reason)}" if r.reason else ""))
                ref = self.note("E", text)
                if ref not in refs:
                    refs.append(ref)
            shown = refs[:3] + (["..."] if len(refs) > 3 else [])
            return f"{c.state} " + " ".join(f"[{x}](#{x.lower()})" if x != "..." else x for x in shown)
        if c.reason:
            ref = self.note("R", _esc(c.reason))
            return f"{c.state} [{ref}](#{ref.lower()})"
        return c.state


def cells(root: Path, ev: Evidence) -> Dict[Tuple[str, str, str], Cell]:
    """Every cell: ``(axis, value, column) -> Cell`` for sm90 (column: a family, or an engine in the backend
    axes; the family axis has its own family as the column) and ``(axis, value, "CPU") -> Cell`` (``accepted`` or
    ``refused``, the registries' verdict for a CPU)."""
    cols = columns(root)
    fams = [c for c in cols if c in _families()]
    gpu_runs = [r for r in ev.runs if r.platform in SM90]
    out: Dict[Tuple[str, str, str], Cell] = {}
    for ax in axes():
        for v in ax.values:
            if ax.key == "family":
                out[(ax.key, v, "CPU")] = Cell("accepted")
                out[(ax.key, v, v)] = decide([r for r in gpu_runs if v in r.features.get("family", [])], None, None)
                continue
            cpu_why = refusal(root, ax.key, v, None, "CPU")
            out[(ax.key, v, "CPU")] = Cell("refused", [], cpu_why) if cpu_why else Cell("accepted")
            for col in (cols if ax.key in BACKEND_AXES else fams):
                runs = [r for r in gpu_runs if r.column == col and v in r.features.get(ax.key, [])]
                out[(ax.key, v, col)] = decide(runs, refusal(root, ax.key, v, col, GPU), cpu_why)
    return out


def render(root: Path, ev: Evidence) -> str:
    """The page (Markdown) from the evidence and the registries."""
    cols = columns(root)
    fams = [c for c in cols if c in _families()]
    page = Page()
    out = [
        "# Support matrix",
        "",
        f"Generated by `{COMMAND}` from the GPU results committed under `{RESULTS}/` (cuda.sh logs, "
        "`GPU_E2E_SUMMARY` lines, benchmark JSONs) and the registries' own requirement checks; **do not edit**. "
        f"After committing new results, regenerate with `{COMMAND}` and commit the page; CI checks it is current "
        f"(`{COMMAND} --check`, `tests/test_support_matrix.py`).",
        "",
        f"States of an {SM90_TITLE} cell (per family column; H100 and H200 share the compute capability, so the "
        "same kernels, backends and refusals: a result from either card decides the cell, and its note names the "
        "card):",
        "",
        "* **verified** — a result file shows it ran and passed on an H100 or H200 (test passed, exit 0, evidence verdict "
        "`verified`); the note names the file, its commit and date, and a lossy lane's failed quality gate "
        "(`runner.gate`) with its first reason.",
        "* **failed** — the newest result shows it failed (the note has the reason); **refused** with a note `E…`: "
        "the run itself was refused at startup (exit 2). States joined by `+` (`verified+failed`): the newest "
        "results, of one date and commit, hold both.",
        "* **skipped** — only skips on an H100 or H200, with their reason (a missing package, typically, or a run "
        "a signal stopped before it finished: exit 128 + N).",
        "* **refused** — the registries' own checks refuse it on sm90 (bf16, the family's shapes; packages "
        "assumed installed) or for the family (no such stage field, task or output kind).",
        "* **CPU only** — no GPU result; the CPU accepts it (exercised by CPU tests with tiny models).",
        "* **not run** — no GPU result, and the CPU refuses it too.",
        "",
        "The **CPU** column is the registries' verdict for a CPU (any family): **accepted** or **refused**. "
        "Which test, benchmark or lane a run came from is in its note; only what a run names (overrides, the "
        "summary line's backends, a test id's parameters) counts as exercised.",
        "",
    ]
    table = cells(root, ev)
    for ax in axes():
        table_cols = cols if ax.key in BACKEND_AXES else fams
        out += [f"## {ax.title} (`{ax.setting}`)", "", f"Rows: `{ax.source}`.", ""]
        if ax.key == "family":
            out += [f"| family | CPU | {SM90_TITLE} |", "|---|---|---|"]
            for v in ax.values:
                out.append(f"| `{v}` | {page.cell(table[(ax.key, v, 'CPU')])} | {page.cell(table[(ax.key, v, v)])} |")
            out.append("")
            continue
        out += ["| " + " | ".join([ax.key, "CPU", *table_cols]) + " |",
                "|" + "---|" * (len(table_cols) + 2)]
        for v in ax.values:
            row = [f"`{v}`", page.cell(table[(ax.key, v, "CPU")])]
            row += [page.cell(table[(ax.key, v, col)]) for col in table_cols]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    others = sorted({r.platform for r in ev.runs if r.platform not in (*SM90, None, "CPU")})
    if others:
        out += [f"Results from other GPUs ({', '.join(others)}) are listed under the result files below and not "
                f"placed in the {SM90_TITLE} cells.", ""]
    out += ["## cuda.sh runs", "", "| log | commit | date | device | passed | failed | skipped | failed tests |",
            "|---|---|---|---|---|---|---|---|"]
    for rel, s in sorted(ev.logs.items(), key=lambda kv: (ev.files[kv[0]][1], kv[0])):
        t = s["totals"]
        device = _esc(s["device"] or s["platform"] or "?")
        out.append(f"| `{rel}` | `{ev.files[rel][0]}` | {ev.files[rel][1]} | {device} | "
                   f"{t.get('passed', 0)} | {t.get('failed', 0) + t.get('error', 0)} | {t.get('skipped', 0)} | "
                   + (", ".join(f"`{_esc(x)}`" for x in s["failed"]) or "—") + " |")
    out += ["", "## Result files read", "",
            "Commit and date: the file's own where it records them, else the date in its name and the commit that "
            "added it (`git log --diff-filter=A -1 --format=%h,%cs -- FILE`).", "",
            "| file | commit | date | GPU runs read |", "|---|---|---|---|"]
    for rel, (commit, date, n) in sorted(ev.files.items()):
        out.append(f"| `{rel}` | `{commit}` | {date} | {n} |")
    out += ["", "## Notes", ""]
    for k, text in page.notes.items():
        out.append(f"* <a id=\"{k.lower()}\"></a>**{k}**: {text}")
    return "\n".join(out) + "\n"


def _families() -> List[str]:
    from models import registry

    return registry.family_names()


# --------------------------------------------------------------------------------------------------- main


def generate(root: Path = ROOT, results: Optional[Path] = None, page: Optional[Path] = None) -> str:
    """The page as it would be written now (the current page, if any, supplies provenance in a shallow clone)."""
    page = page or root / PAGE
    previous = page.read_text() if page.is_file() else None
    return render(root, collect(root, results, previous))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write (default), check (``--check``: exit 1 when the committed page differs) or print the page.

    Returns:
        0 written / current; 1 ``--check`` found the page stale (a diff on stderr); 2 a result file is unreadable.
    """
    ap = argparse.ArgumentParser(prog=COMMAND, description="Write docs/support_matrix.md from benchmarks/results.")
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed page is not what would be written")
    ap.add_argument("--print", action="store_true", help="write the page to stdout instead of the file")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    ap.add_argument("--results", type=Path, default=None, help=f"results dir (default: <root>/{RESULTS})")
    ap.add_argument("--out", type=Path, default=None, help=f"page (default: <root>/{PAGE})")
    a = ap.parse_args(argv)
    out = a.out or a.root / PAGE
    try:
        text = generate(a.root, a.results, out)
    except SupportMatrixError as e:
        print(f"support_matrix: {type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    if a.print:
        sys.stdout.write(text)
        return 0
    if a.check:
        have = out.read_text() if out.is_file() else ""
        if have == text:
            return 0
        diff = difflib.unified_diff(have.splitlines(), text.splitlines(), str(out), "generated", lineterm="", n=0)
        print("\n".join(list(diff)[:60]), file=sys.stderr)
        print(f"support_matrix: {out} is stale; fix: {COMMAND} (and commit the page)", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"support_matrix: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
