"""The AR dataset row (``model.engine=vllm``): a prompt (text or token ids) and per-row ``vllm.SamplingParams``
fields, validated by the one row driver (``runner.core.dataset.validate_rows``) over :data:`AR_ROW`, before the
engine starts.

Rows: ``{"id", "prompt"}`` or ``{"id", "prompt_token_ids": [int, ...]}`` plus optional ``max_tokens``,
``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``n``, ``ignore_eos``, ``stop``. ``txt`` and
``csv`` give text prompts only (a CSV cell of a list is JSON text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from runner.core import dataset as ds
from runner.core.dataset import Field, RowSpec
from runner.core.media import shown
from runner.core.errors import UserInputError

#: vLLM's greedy threshold (``vllm.sampling_params._SAMPLING_EPS``): a temperature below it is greedy sampling, where
#: ``SamplingParams`` resets ``top_p``/``top_k``/``min_p`` and no random number is drawn (the seed is unused).
GREEDY_EPS = 1e-5
#: Sampling fields greedy sampling ignores.
GREEDY_IGNORES = ("top_p", "top_k", "min_p", "seed")
GREEDY_WHY = ("temperature 0 is greedy sampling: vLLM resets top_p/top_k/min_p and draws no random numbers, so the "
              "value changes nothing")
#: vLLM's ``SamplingParams`` defaults the row checks count with when neither the row nor ``model.sampling`` sets
#: the field: ``max_tokens=16``, ``min_tokens=0``, ``temperature=1.0``.
VLLM_DEFAULTS = {"max_tokens": 16, "min_tokens": 0, "temperature": 1.0}


class ARConfigError(UserInputError, ValueError):
    """Bad configuration of an AR stage (names the field, the value and the fix); exit 2 before the engine starts."""


@dataclass
class ARRow:
    """One validated AR dataset row. Exactly one of ``prompt`` / ``prompt_token_ids`` is set; ``sampling`` holds
    the row's ``vllm.SamplingParams`` overrides, ``seed`` the request seed (the row's, else derived from the run
    seed and the id)."""

    id: str
    line: int
    prompt: Optional[str]
    prompt_token_ids: Optional[List[int]]
    seed: int
    sampling: Dict[str, Any] = field(default_factory=dict)
    ignored: Dict[str, Any] = field(default_factory=dict)
    """Row fields vLLM ignores that the run accepted (``dataset.on_ignored=record``): ``{field: {value, why}}``."""
    meta: Dict[str, Any] = field(default_factory=dict)
    """The row's extra fields (``dataset.extra_fields=keep``), recorded with the output, never sent to vLLM."""

    @property
    def key(self) -> str:
        """The item key: the row id (one output per row)."""
        return self.id

    def request(self) -> Dict[str, Any]:
        """The row as :meth:`models.vllm.adapter.VLLMAdapter.generate` takes it."""
        out: Dict[str, Any] = {"id": self.id, **self.sampling, "seed": self.seed}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        else:
            out["prompt"] = self.prompt
        return out


def request_seed(run_seed: int, row_id: str) -> int:
    """Per-request seed of a row without one (vLLM: rows sharing a seed draw the same random stream), in
    [0, 2**31)."""
    return ds.derive_seed(run_seed, row_id) % (1 << 31)


# ------------------------------------------------------------------------------------------------ fields
def parse_token_ids(value: Any, from_text: bool) -> List[int]:
    """``prompt_token_ids``: a list of integers (a CSV cell: its JSON text)."""
    if isinstance(value, str) and from_text:
        value = json.loads(value)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(value)
    return value


def parse_stop(value: Any, from_text: bool) -> List[Any]:
    """``stop``: a list of strings, or one string (a CSV cell: the JSON text of either)."""
    if isinstance(value, str) and from_text:
        value = json.loads(value)  # raises ValueError on text that is no JSON: named as not a list of strings
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise ValueError(value)
    return value


def parse_bool(value: Any, from_text: bool) -> bool:
    """``ignore_eos``: true or false (a CSV cell: ``true``/``false``, any case)."""
    if isinstance(value, str) and from_text and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(value)
    return value


@dataclass(frozen=True)
class RangeCheck:
    """A ``Field.check``: ``why`` when ``rule(value)`` is false (a class, so that the spec pickles)."""

    rule: Callable[[Any], bool]
    why: str

    def __call__(self, value: Any, context: Mapping[str, Any]) -> Optional[str]:
        return None if self.rule(value) else self.why


def at_least_one(v: Any) -> bool:
    """>= 1."""
    return v >= 1


def non_negative(v: Any) -> bool:
    """>= 0."""
    return v >= 0


def probability(v: Any) -> bool:
    """In (0, 1]."""
    return 0 < v <= 1


def top_k_ok(v: Any) -> bool:
    """-1 (off) or >= 0."""
    return v >= -1


def seed_ok(v: Any) -> bool:
    """In [0, 2**63)."""
    return 0 <= v < (1 << 63)


def only_one(v: Any) -> bool:
    """Exactly 1."""
    return v == 1


N_WHY = ("is not supported: one output per row (vLLM's n>1 child requests carry no per-output prefill/decode counts "
         "the evidence can check); fix: drop 'n', or repeat the row under other ids (and seeds)")


def check_n(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """``n``: >= 1, and 1 (one output per row)."""
    return "must be >= 1" if v < 1 else None if v == 1 else N_WHY


def check_token_ids(where: str, vals: Mapping[str, Any], merged: Mapping[str, Any], context: Mapping[str, Any],
                    bad: bool) -> List[str]:
    """Exactly one of a non-empty text ``prompt`` and ``prompt_token_ids``; token ids non-empty and inside the
    model's vocabulary (``context["vocab_size"]``, None: unknown)."""
    text, ids, vocab = vals.get("prompt"), vals.get("prompt_token_ids"), context.get("vocab_size")
    out = []
    if (text is None or not text.strip()) == (ids is None):
        out.append(f"{where}: give exactly one of 'prompt' (non-empty text) and 'prompt_token_ids'; fix: "
                   "e.g. {\"id\": \"a\", \"prompt_token_ids\": [12, 7, 99]}")
    if ids is not None and not ids:
        out.append(f"{where}: field 'prompt_token_ids' is empty; fix: at least one token id")
    elif ids is not None and (min(ids) < 0 or (vocab is not None and max(ids) >= vocab)):
        out.append(f"{where}: field 'prompt_token_ids' has ids outside [0, {vocab}) (the model's vocabulary): "
                   f"min {min(ids)}, max {max(ids)}")
    return out


def effective(vals: Mapping[str, Any], context: Mapping[str, Any], key: str) -> Any:
    """The value a request gets: the row's, else ``model.sampling``'s, else vLLM's default (:data:`VLLM_DEFAULTS`)."""
    sampling = context.get("sampling") or {}
    return vals.get(key, sampling.get(key) or VLLM_DEFAULTS[key])


def check_budget(where: str, vals: Mapping[str, Any], merged: Mapping[str, Any], context: Mapping[str, Any],
                 bad: bool) -> List[str]:
    """``min_tokens <= max_tokens``, and prompt tokens + ``max_tokens`` within ``context["max_model_len"]`` (text
    prompts counted by ``context["count_tokens"]`` when given). Skipped on a row with a problem already."""
    if bad:
        return []
    hi, lo = int(effective(vals, context, "max_tokens")), int(effective(vals, context, "min_tokens"))
    if lo > hi:
        return [f"{where}: min_tokens {lo} exceeds max_tokens {hi} (row or model.sampling); fix: min_tokens <= "
                "max_tokens"]
    text, ids, count = vals.get("prompt"), vals.get("prompt_token_ids"), context.get("count_tokens")
    if ids:
        n_prompt, kind = len(ids), "prompt tokens"
    elif ids is None and text and text.strip() and count is not None:
        n_prompt, kind = count(text), "prompt tokens (the model's tokenizer)"
    else:
        return []
    most = context["max_model_len"]
    if n_prompt + hi > most:
        return [f"{where}: {n_prompt} {kind} + max_tokens {hi} = {n_prompt + hi} exceeds max_model_len={most}; fix: "
                "a shorter prompt or smaller max_tokens, or raise model.stages.generate.engine_extras.max_model_len"]
    return []


def greedy_ignored(vals: Mapping[str, Any], context: Mapping[str, Any]) -> List[str]:
    """The row's fields greedy sampling ignores (:data:`GREEDY_IGNORES`), when its temperature is greedy."""
    sampling = context.get("sampling") or {}
    if float(vals.get("temperature", sampling.get("temperature", 1.0))) >= GREEDY_EPS:
        return []
    return [k for k in GREEDY_IGNORES if k in vals]


def check_greedy(where: str, vals: Mapping[str, Any], merged: Mapping[str, Any], context: Mapping[str, Any],
                 bad: bool) -> List[str]:
    """With ``dataset.on_ignored=error`` (``context["on_ignored"]``), a field greedy sampling ignores is refused."""
    if bad or context.get("on_ignored", "error") != "error":
        return []
    return [f"{where}: field {k!r} = {shown(vals[k])} is ignored: {GREEDY_WHY}; fix: remove {k!r} from the row, a "
            "temperature > 0, or dataset.on_ignored=record to run it and record the value as ignored"
            for k in greedy_ignored(vals, context)]


#: Row fields that are no ``SamplingParams`` override.
NOT_SAMPLING = ("id", "prompt", "prompt_token_ids", "seed")


def build_ar_row(line: int, rid: str, vals: Mapping[str, Any], merged: Mapping[str, Any], meta: Mapping[str, Any],
                 context: Mapping[str, Any]) -> ARRow:
    """The :class:`ARRow` of a valid row: greedy-ignored fields moved to ``ignored`` (``dataset.on_ignored=record``),
    the seed the row's, else ``model.sampling``'s, else :func:`request_seed` of ``context["run_seed"]``."""
    vals = dict(vals)
    where = f"{context['src']}:{line}"
    ignored = {k: {"value": vals.pop(k), "why": GREEDY_WHY, "from": where} for k in greedy_ignored(vals, context)}
    seed = vals.get("seed", (context.get("sampling") or {}).get("seed"))
    ids = vals.get("prompt_token_ids")
    return ARRow(id=rid, line=line, prompt=vals.get("prompt") if ids is None else None, prompt_token_ids=ids,
                 seed=int(seed) if seed is not None else request_seed(context["run_seed"], rid),
                 sampling={k: v for k, v in vals.items() if k not in NOT_SAMPLING}, ignored=ignored, meta=dict(meta))


#: The AR row: a prompt (text or token ids) and per-row ``vllm.SamplingParams`` fields (no defaults here:
#: ``model.sampling`` fills them in vLLM's ``SamplingParams``, and the checks count with it).
AR_ROW = RowSpec("ar", (
    Field("id", str, identity="no"),
    Field("prompt", str, identity="set"),
    Field("prompt_token_ids", list, identity="set", parse=parse_token_ids, kind="a list of integers"),
    Field("max_tokens", int, check=RangeCheck(at_least_one, "must be >= 1"), identity="set"),
    Field("min_tokens", int, check=RangeCheck(non_negative, "must be >= 0"), identity="set"),
    Field("temperature", float, check=RangeCheck(non_negative, "must be >= 0 (0: greedy)"), identity="set"),
    Field("top_p", float, check=RangeCheck(probability, "must be in (0, 1]"), identity="set"),
    Field("top_k", int, check=RangeCheck(top_k_ok, "must be -1 (off) or >= 0"), identity="set"),
    Field("seed", int, check=RangeCheck(seed_ok, "must be in [0, 2**63)"), identity="set"),
    Field("n", int, check=check_n, identity="set"),
    Field("ignore_eos", bool, identity="set", parse=parse_bool),
    Field("stop", list, identity="set", parse=parse_stop),
), (check_token_ids, check_budget, check_greedy), build_ar_row, quote_hint=False)
#: ``{field: type}`` of the AR row.
AR_ROW_FIELDS: Dict[str, type] = AR_ROW.types()


def check_sampling(where: str, sampling: Mapping[str, Any]) -> None:
    """Validate ``model.sampling`` defaults with the row fields' checks (types and ranges, ``n`` must be 1,
    ``min_tokens <= max_tokens``).

    Raises:
        ARConfigError: naming ``<where>.sampling.<key>``, the value and the fix.
    """
    fields = AR_ROW.by_name
    for key, v in sampling.items():
        f = fields.get(key)
        if v is None or f is None or f.type not in (int, float):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (f.type is int and not isinstance(v, int)):
            word = "integer" if f.type is int else "number"
            raise ARConfigError(f"{where}.sampling.{key}={v!r} is not {f.words()}; fix: "
                                f"{where}.sampling.{key}=<{word}>")
        why = f.check(v, {}) if f.check else None
        if why:
            raise ARConfigError(f"{where}.sampling.{key}={v!r} {why}"
                                + ("" if "fix:" in why else f"; fix: set {where}.sampling.{key} in range"))
    lo, hi = sampling.get("min_tokens"), sampling.get("max_tokens")
    if lo is not None and lo > (16 if hi is None else hi):
        raise ARConfigError(f"{where}.sampling.min_tokens={lo} exceeds {where}.sampling.max_tokens="
                            f"{16 if hi is None else hi}{' (vLLM default)' if hi is None else ''}; fix: "
                            "min_tokens <= max_tokens")


def load_rows(cfg: Any, sampling: Mapping[str, Any], vocab_size: Optional[int], max_model_len: int,
              model_cfg: Any, count_tokens: Optional[Callable[[str], int]] = None) -> Tuple[List[ARRow], Path]:
    """Read the run's dataset (``cfg.dataset``) and validate it as :data:`AR_ROW` rows before the engine starts.

    Args:
        cfg: the typed run config (``runner.core.schema.RunConfig``: ``dataset``, ``seed``).
        sampling: the model's ``vllm.SamplingParams`` defaults (``model.sampling``).
        vocab_size: the model's vocabulary (token ids must be below it), None when unknown.
        max_model_len: the engine's limit on prompt + output tokens, in tokens (token-id rows, and text rows when
            ``count_tokens`` is given, are checked against it).
        model_cfg: the stage's typed model config (``builtin_prompts``).
        count_tokens: text -> number of prompt tokens as the engine will tokenize it (the model's tokenizer).

    Returns:
        ``(rows, path)``.

    Raises:
        runner.core.dataset.DatasetError: listing every bad row (file, line, field, value, fix).
    """
    d = cfg.dataset
    src = ds.source_path(d.format, d.path, model_cfg.builtin_prompts)
    raw = ds.read_raw(d.format, src, d.split, ds.columns_option(d.columns), AR_ROW.by_name)
    if d.limit is not None:
        raw = raw[:d.limit]
    context = {"sampling": dict(sampling), "vocab_size": vocab_size, "max_model_len": max_model_len,
               "count_tokens": count_tokens, "on_ignored": str(getattr(d, "on_ignored", None) or "error"), "src": src,
               "run_seed": cfg.seed}
    rows = ds.validate_rows(raw, AR_ROW, src, from_text=ds.reader(d.format).from_text,
                            extra_fields=str(d.extra_fields),
                            context=context)
    return rows, src
