"""The oracles by ``model.oracle`` name, and the merge of the workers' ``accuracy`` sections of a data-parallel run.

Each oracle module has ``check_expectations(rows, path)``, ``accuracy_section(items, records, out_dir)`` and
``section(got, expect, prompt)``: the section from its per-item entries (item key -> what it read, the expectation,
and for toy_edit the prompt), which ``accuracy_section`` calls too, so that a merge recomputes the run's figures from
the workers' sections alone (:func:`merged_section`; no engine, no dataset: the Ray driver has neither).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, List, Optional, Sequence

from runner.core.errors import ConfigValueError

#: ``model.oracle`` -> module with ``check_expectations``, ``accuracy_section`` and ``section``
ORACLES = {"toy_shapes": "models.toy_shapes.oracle", "toy_motion": "models.toy_motion.oracle",
           "toy_edit": "models.toy_edit.oracle"}

#: The per-item entries of a section, item key -> value (``prompt``: toy_edit only).
ENTRIES = ("read", "expect", "prompt")


def oracle(name: Any) -> Any:
    """The oracle module of ``model.oracle``.

    Raises:
        ConfigValueError: an unknown oracle, naming the known ones.
    """
    key = str(getattr(name, "value", name))
    if key not in ORACLES:
        raise ConfigValueError(f"model.oracle={key!r} is not known; fix: one of {', '.join(ORACLES)}, or null")
    return importlib.import_module(ORACLES[key])


def _read_something(got: Any) -> bool:
    return isinstance(got, dict) and any(v is not None for v in got.values())


def union_entries(sections: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The per-item entries of ``sections`` (``read``, ``expect``, ``prompt`` maps), one per item key: an item that
    two workers scored (a retried batch) counts once, the entry whose read found something (the ok record's: a
    failed item reads all None) and else the first."""
    out: Dict[str, Dict[str, Any]] = {e: {} for e in ENTRIES}
    for sec in sections:
        for k, exp in sec["expect"].items():
            got = sec["read"][k]
            if k in out["expect"] and (_read_something(out["read"][k]) or not _read_something(got)):
                continue
            out["read"][k], out["expect"][k] = got, exp
            if k in (sec.get("prompt") or {}):
                out["prompt"][k] = sec["prompt"][k]
    return out


def merged_section(sections: List[Dict[str, Any]], keys_in_order: Sequence[str], gaps: Sequence[str] = ()
                   ) -> Optional[Dict[str, Any]]:
    """The run's ``accuracy`` from the workers' sections: the oracle's ``section`` over :func:`union_entries`, items
    in dataset order; None when no worker has one. Where it cannot be computed (``gaps``: why some workers' items
    are not in ``sections``, e.g. a worker manifest missing; or a section without per-item entries), the section is
    ``{oracle, incomplete: <why>}`` with no figures, rather than a part of the run's passed off as the run's."""
    if not sections:
        return None
    name = sections[0].get("oracle")
    why = list(gaps) + [f"an accuracy section of the {s.get('oracle')} oracle has no per-item entries (read, expect)"
                        for s in sections if not all(isinstance(s.get(e), dict) for e in ("read", "expect"))]
    if why:
        return {"oracle": name, "incomplete": "; ".join(why)}
    u = union_entries(sections)
    order = {k: i for i, k in enumerate(keys_in_order)}
    keys = sorted(u["expect"], key=lambda k: order.get(k, len(order)))
    return oracle(name).section({k: u["read"][k] for k in keys}, {k: u["expect"][k] for k in keys},
                                {k: u["prompt"][k] for k in keys if k in u["prompt"]})
