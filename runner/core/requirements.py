"""The dependency versions the runner is tested with, checked at startup (``python -m runner``), so that an
untested release is refused with the fix (exit 2) instead of failing deep inside a run.

``diffusers``: the runner uses its context parallelism (``ParallelConfig``, ``enable_parallelism``: 0.36) and its
cache hooks (``diffusers.hooks``' first-block/MagCache/TaylorSeer caches: 0.37), and imports private names
(``diffusers.models._modeling_parallel.ParallelConfig``, ``diffusers.hooks._helpers.TransformerBlockRegistry``,
``diffusers.models.attention_dispatch._AttentionBackendRegistry``) that a later release may move: the range has an
upper bound, the newest release tested here plus one. :data:`TESTED` must equal ``pyproject.toml``'s pins
(``tests/test_cli.py`` checks it); the installed metadata of an editable install may predate the checkout, so the
check reads this table, not ``importlib.metadata.requires("runner")``.
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict, List, Optional

from runner.core.errors import EXTRAS, UserInputError, install_fix  # noqa: F401  (re-exported)

#: ``{distribution: specifier}``: the tested range of each dependency whose API the runner relies on beyond its
#: stable surface (PEP 440 specifiers, as in ``pyproject.toml``).
TESTED: Dict[str, str] = {"diffusers": ">=0.37,<0.43"}
#: ``{distribution: specifier}`` of dependencies a feature needs, checked only when a run uses it
#: (:func:`check_feature`): ``peft``, diffusers' LoRA backend (``model.lora``: ``load_lora_weights``,
#: ``set_adapters``, ``fuse_lora``; tested with 0.21); ``ray``, ``launcher=ray`` (Ray Data's ``ActorPoolStrategy``
#: with ``max_tasks_in_flight_per_actor``, ``map_batches(compute=...)``; tested with 2.60); ``submitit``,
#: ``launcher=slurm`` (``helpers.Checkpointable``, ``LocalExecutor``'s requeue on exit 144; tested with 1.5.4). The
#: same ranges as ``pyproject.toml``'s extras (``lora``, ``scale``).
FEATURES: Dict[str, str] = {"peft": ">=0.21,<0.22", "ray": ">=2.40", "submitit": ">=1.5"}
#: The project's extra that installs each of :data:`FEATURES` (``pyproject.toml``).
FEATURE_EXTRAS: Dict[str, str] = {"peft": "lora", "ray": "scale", "submitit": "scale"}
class DependencyVersionError(UserInputError):
    """An installed dependency is outside the tested range (exit 2)."""


def version_problems(installed: Optional[Dict[str, Optional[str]]] = None,
                     tested: Optional[Dict[str, str]] = None) -> List[str]:
    """One message per dependency of :data:`TESTED` whose installed version is outside its range, naming the
    package, the version, the range and the fix.

    Args:
        installed: ``{distribution: version or None (not installed)}``; default: the environment's.
        tested: ``{distribution: specifier}`` to check (default :data:`TESTED`).
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    out = []
    for dist, spec in (TESTED if tested is None else tested).items():
        if installed is not None:
            have = installed.get(dist)
        else:
            try:
                have = metadata.version(dist)
            except metadata.PackageNotFoundError:
                have = None
        extra = FEATURE_EXTRAS.get(dist) if tested is not None else None
        fix = install_fix(extra) if extra else f"pip install '{dist}{spec}'"
        if have is None:
            out.append(f"{dist} is not installed; the runner needs {dist}{spec}; fix: {fix}")
        elif Version(have) not in SpecifierSet(spec):
            out.append(f"{dist}=={have} is outside the tested range {dist}{spec}; fix: {fix}")
    return out


def check_versions(installed: Optional[Dict[str, Optional[str]]] = None) -> None:
    """Raise :class:`DependencyVersionError` when :func:`version_problems` finds any."""
    problems = version_problems(installed)
    if problems:
        raise DependencyVersionError("; ".join(problems))


def check_feature(dist: str, feature: str, installed: Optional[Dict[str, Optional[str]]] = None) -> None:
    """The feature's dependency ``dist`` (:data:`FEATURES`) is installed in its tested range.

    Raises:
        DependencyVersionError: naming the feature, the package, the version, the range and the fix (exit 2).
    """
    problems = version_problems(installed, {dist: FEATURES[dist]})
    if problems:
        raise DependencyVersionError(f"{feature}: " + "; ".join(problems))
