"""Validate a run dir's ``manifest.json`` and journal records against the published JSON Schemas
(``runner/schemas/manifest.schema.json``, ``runner/schemas/item.schema.json``; Draft 2020-12), with ``jsonschema``.

``python -m runner.validate <run dir> [...]``: exit 0 when every manifest and every record of ``items.jsonl`` (and
``items.unlisted.jsonl``) is valid, 1 when one is not (each problem printed: file, line, JSON path, message), 2 for
bad input (no such run dir, ``jsonschema`` not installed: ``pip install -e ".[validate]"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from runner.core.errors import UserInputError
from runner.core.errors import install_fix
from runner.core.paths import RUNNER_DIR

SCHEMA_DIR = RUNNER_DIR / "schemas"
SCHEMAS = {"manifest": "manifest.schema.json", "item": "item.schema.json"}


class SchemaValidationSetupError(UserInputError, RuntimeError):
    """``jsonschema`` is not installed, or the path is not a run dir (names the fix); exit 2."""


def schema(name: str) -> Dict[str, Any]:
    """The published schema ``name`` (``manifest`` or ``item``) as a dict, its closed choices' ``enum`` lists taken
    from the config schema's enums (``runner.core.schema.JSON_SCHEMA_ENUMS``), so a value added there (a dataset
    format) validates without a second edit.

    Raises:
        KeyError: an unknown name, or a JSON pointer of ``JSON_SCHEMA_ENUMS`` the published schema does not hold.
    """
    from runner.core.schema import JSON_SCHEMA_ENUMS

    doc = json.loads((SCHEMA_DIR / SCHEMAS[name]).read_text())
    for pointer, choice in JSON_SCHEMA_ENUMS.get(name, {}).items():
        node = doc
        for part in pointer.strip("/").split("/"):
            node = node[part]
        node["enum"] = [c.value for c in choice]
    return doc


@lru_cache(maxsize=None)
def _validator(name: str) -> Any:
    try:
        import jsonschema
    except ImportError:
        raise SchemaValidationSetupError("validating needs jsonschema, which is not installed; fix: "
                                         f"{install_fix('validate')}") from None
    cls = jsonschema.validators.validator_for(schema(name))
    cls.check_schema(schema(name))
    return cls(schema(name), format_checker=cls.FORMAT_CHECKER)


def problems(doc: Any, name: str) -> List[str]:
    """Every violation of schema ``name`` by ``doc``: ``"<JSON path>: <message>"``, sorted by path; [] when valid.

    Raises:
        SchemaValidationSetupError: jsonschema is not installed.
    """
    errs = sorted(_validator(name).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{e.json_path}: {e.message}" for e in errs]


def validate_run_dir(run_dir: Path) -> List[str]:
    """Validate ``manifest.json`` and every line of ``items.jsonl`` and ``items.unlisted.jsonl`` (when present).

    Returns:
        One ``"<file>[:<line>]: <JSON path>: <message>"`` per violation; [] when everything is valid.

    Raises:
        SchemaValidationSetupError: not a run dir (no ``manifest.json``), or jsonschema is not installed.
    """
    run_dir = Path(run_dir)
    m = run_dir / "manifest.json"
    if not m.is_file():
        raise SchemaValidationSetupError(f"{run_dir} holds no manifest.json; fix: pass a run dir")
    try:
        out = [f"{m}: {p}" for p in problems(json.loads(m.read_text(encoding="utf-8")), "manifest")]
    except ValueError as e:  # empty or truncated (JSONDecodeError), not UTF-8 (UnicodeDecodeError): a violation
        out = [f"{m}: not JSON ({getattr(e, 'msg', None) or type(e).__name__})"]
    for name in ("items.jsonl", "items.unlisted.jsonl"):
        path = run_dir / name
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                out.append(f"{path}:{n}: not JSON ({e.msg})")
                continue
            out += [f"{path}:{n}: {p}" for p in problems(rec, "item")]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m runner.validate",
                                 description="Validate run dirs against the published JSON Schemas of the manifest "
                                             "and the item records (runner/schemas/).")
    ap.add_argument("run_dirs", nargs="+", type=Path)
    a = ap.parse_args(argv)
    bad = 0
    for d in a.run_dirs:
        try:
            found = validate_run_dir(d)
        except SchemaValidationSetupError as e:
            print(f"validate: {e}", file=sys.stderr)
            return e.exit_code
        for p in found:
            print(p)
        bad += len(found)
        if not found:
            print(f"{d}: valid (the records' schemas only; the files' bytes are checked against their sha256 by a "
                  "resume and by python -m runner.export --verify)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
