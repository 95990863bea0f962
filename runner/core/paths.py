"""Where the runner's files are, whether it runs from a checkout or from an installed package.

In a checkout, ``conf/`` is the repository's top-level folder, beside ``runner/`` and ``models/``.
An installed package (``pip install .``, not editable) has no checkout: the wheel ships ``conf/`` inside the
package as ``runner/conf`` (package data, see ``pyproject.toml``). The toy weights live inside their package
(``models/toy_shapes/weights``) in both cases, under :data:`PROJECT_ROOT`.
"""

from __future__ import annotations

import shlex
import site
import sysconfig
from pathlib import Path
from typing import List

RUNNER_DIR = Path(__file__).resolve().parent.parent
"""The ``runner`` package folder (its ``data/`` and ``schemas/`` sit here)."""

PROJECT_ROOT = RUNNER_DIR.parent
"""The folder holding the ``runner`` and ``models`` packages: the checkout's root, or the
site-packages (or ``--target``) folder of an installed package."""

_SHIPPED_CONF = RUNNER_DIR / "conf"  # only in an installed package
CONF_DIR = _SHIPPED_CONF if _SHIPPED_CONF.is_dir() else PROJECT_ROOT / "conf"
"""The config tree of ``python -m runner`` (Hydra's primary config directory)."""


def _on_default_path(folder: Path) -> bool:
    """True when this interpreter finds packages in ``folder`` without PYTHONPATH (its site-packages)."""
    dirs = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    dirs |= set(getattr(site, "getsitepackages", lambda: [])())
    dirs.add(site.getusersitepackages())
    return any(Path(d).resolve() == folder for d in dirs if d)


def repro_location() -> List[str]:
    """Lines of ``repro.sh`` that put the re-run where the original ran, before it calls ``python -m runner``.

    * A relative ``NEW_RUN_DIR`` argument is made absolute against the caller's working directory.
    * ``cd`` to the original's working directory: relative paths in its overrides (``dataset.path=...``) and the
      default ``outputs/`` resolve as they did (with a warning, and the caller's directory, when it is gone).
    * The same runner code: when the original imported ``runner`` from a checkout (or a ``--target`` folder)
      that the interpreter does not find by itself, that folder goes first on ``PYTHONPATH``; an installed
      package (site-packages) is found by the interpreter (``$PYTHON``) as it is.
    """
    lines = ['case "${1:-}" in ""|/*) ;; *) set -- "$PWD/$1" ;; esac  # NEW_RUN_DIR relative to the caller',
             f"ORIG_CWD={shlex.quote(str(original_cwd()))}",
             'cd "$ORIG_CWD" 2>/dev/null || echo "repro.sh: the original working directory $ORIG_CWD is gone; '
             'running from $PWD" >&2']
    if not _on_default_path(PROJECT_ROOT):
        lines.append(f"export PYTHONPATH={shlex.quote(str(PROJECT_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"
                     "  # the runner code of the original run")
    return lines


def original_cwd() -> Path:
    """The working directory the run was started from (Hydra's, when ``hydra.job.chdir`` moved the process)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.cwd)
    except Exception:  # noqa: BLE001 - no Hydra context (a Ray worker, a test calling run() directly)
        pass
    return Path.cwd()


def hydra_quote(value: str) -> str:
    """``value`` as a Hydra override value that composes to exactly ``value``, whatever characters it holds
    (parentheses, brackets, braces, commas, quotes, spaces, ``$``, ``=``, ``:``, ``\\``, unicode): a single-quoted
    Hydra string (Hydra's own escaping of quotes and of backslashes before a quote), with OmegaConf's
    interpolation opener ``${`` escaped so it stays text."""
    import re

    from hydra.core.override_parser.types import Quote, QuotedString

    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)  # OmegaConf: \${ is a literal ${
    return QuotedString(text=text, quote=Quote.single).with_quotes()


#: Options of the ``model`` group that are schemas (``runner.core.schema``), not models: ``--help`` leaves them out.
SCHEMA_BASES = ("base_diffusion", "base_ar", "base_pipeline", "base_pipeline_stage")


def help_choices(axis: str) -> str:
    """The ``--help`` values of a closed setting, read from its registry (the OmegaConf resolver
    ``${runner_help_choices:<axis>}``): ``offload`` (``memory.offload``: ``runner.core.memory.OFFLOAD_MODES`` and
    auto), ``quantization`` (``model.quantization.<component>``: ``runner.kernels.quantization.METHODS``), joined by
    ``|``. (``cache.method``'s registry, ``models.cache``, imports torch: over a second for ``--help``; its list is
    written in ``conf/config.yaml`` and ``tests/test_console.py`` checks it against the registry.)

    Raises:
        KeyError: another axis."""
    if axis == "offload":
        from runner.core.memory import OFFLOAD_MODES

        values = [*OFFLOAD_MODES, "auto"]
    elif axis == "quantization":
        from runner.kernels.quantization import METHODS

        values = list(METHODS)
    else:
        raise KeyError(f"runner_help_choices: no axis {axis!r} (offload, quantization)")
    return "|".join(values)


def help_groups() -> str:
    """The ``--help`` list of config groups: ``  group: option, option`` per group of :data:`CONF_DIR`, one line each,
    the model schema bases (:data:`SCHEMA_BASES`) left out (the OmegaConf resolver ``${runner_help_groups:}``)."""
    lines = []
    for d in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        opts = sorted(p.stem for p in d.glob("*.yaml") if p.stem not in SCHEMA_BASES)
        if opts:
            lines.append(f"  {d.name}: {', '.join(opts)}")
    return "\n".join(lines)
