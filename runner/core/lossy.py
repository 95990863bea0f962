"""Which lanes of a run are lossy by design: a step cache (``cache.method``), a lossy linear backend (``FP8``), a
lossy attention backend (``SAGE_ATTN``: INT8 Q/K) or an attention spec with ``quant``/``skip_softmax``.

The manifest's ``lossy`` section (``{"lossy": bool, "lanes": [...]}``) is written from here at startup; the report
labels such jobs and ``runner.tools.gate`` compares each with the lossless job of the same rows. A manifest written before
the section existed is labelled from its ``backends`` and ``config`` the same way (:func:`of_manifest`).

Lanes are strings: ``cache=<method>``, ``<stage>.linear=<backend>``, ``<stage>.attention.<role>=<backend>`` (with
``+quant``/``+skip_softmax`` when the spec sets them).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from kernels.registry import is_lossy


def _cache_method(config: Optional[Mapping[str, Any]]) -> Optional[str]:
    c = (config or {}).get("cache") or {}
    name = str(c.get("method") or "none")
    return None if name.strip().lower() in ("none", "", "null", "off") else name


def lanes(backends: Mapping[str, Mapping[str, Any]], config: Optional[Mapping[str, Any]]) -> List[str]:
    """The lossy lanes of a run.

    Args:
        backends: the manifest's ``backends``: ``{stage: {field: resolution dict with "selected"}}``.
        config: the resolved run config (its ``cache`` section).
    """
    out: List[str] = []
    method = _cache_method(config)
    if method is not None:
        out.append(f"cache={method}")
    for stage, fields in (backends or {}).items():
        for fname, res in (fields or {}).items():
            sel = (res or {}).get("selected") if isinstance(res, Mapping) else None
            if sel is None:
                continue
            specs = sel.items() if isinstance(sel, Mapping) else [(None, sel)]
            for role, spec in specs:
                if isinstance(spec, Mapping):
                    name = str(spec.get("backend"))
                    extra = [k for k in ("quant", "skip_softmax") if spec.get(k)]
                else:
                    name, extra = str(spec), []
                if is_lossy(fname, name) or extra:
                    key = f"{stage}.{fname}" + (f".{role}" if role is not None else "")
                    out.append(f"{key}={name}" + "".join(f"+{k}" for k in extra))
    return out


def section(backends: Mapping[str, Mapping[str, Any]], config: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The manifest's ``lossy``: ``{"lossy": bool, "lanes": [...]}``."""
    found = lanes(backends, config)
    return {"lossy": bool(found), "lanes": found}


def of_manifest(manifest: Mapping[str, Any]) -> Dict[str, Any]:
    """A manifest's ``lossy`` section, or the one its ``backends`` and ``config`` imply (older manifests)."""
    doc = manifest.get("lossy")
    if isinstance(doc, Mapping) and "lossy" in doc:
        return {"lossy": bool(doc["lossy"]), "lanes": list(doc.get("lanes") or [])}
    return section(manifest.get("backends") or {}, manifest.get("config") or {})
