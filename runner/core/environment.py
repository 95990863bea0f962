"""Startup checks of what a run reads from outside its config: environment variables and the directories it will
write, so that a mistake there ends in exit 2 naming the variable or key and the fix, before anything loads,
instead of a library's traceback half-way through (``DIFFUSERS_ATTN_BACKEND=garbage`` made diffusers' dispatcher
fail to import; ``output.dir`` under a regular file raised ``NotADirectoryError`` after startup).

Variables checked (each only when set): ``DIFFUSERS_ATTN_BACKEND`` (a diffusers ``AttentionBackendName``),
``DIFFUSERS_ATTN_CHECKS`` (a boolean diffusers reads; other text silently means false), ``CUDA_VISIBLE_DEVICES``
(device indices or UUIDs; garbage hides every GPU), ``TORCH_CUDNN_SDPA_ENABLED`` (``0``/``1``),
``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``/``PYTORCH_HIP_ALLOC_CONF`` (``key:value,...``; torch's own
parser on a GPU), ``LOCAL_RANK`` and ``VLLM_CPU_KVCACHE_SPACE`` (integers), ``TRITON_INTERPRET`` (``0``/``1``),
``RUNNER_CACHE`` (a directory that can be created) and ``IMAGEIO_FFMPEG_EXE`` (an executable file: the ffmpeg that
encodes videos instead of imageio-ffmpeg's own). Directories: the run dir (``output.dir``, ``run.resume`` or the
Hydra run dir) and the cache of embedded models (``cache_dir``).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from runner.core.errors import UserInputError

log = logging.getLogger("runner")


class EnvironmentVariableError(UserInputError, ValueError):
    """An environment variable the runner or a library it drives reads holds a value they cannot use."""


class OutputPathError(UserInputError, OSError):
    """A directory the run must write cannot be created or written (names the key and the fix)."""


_TRUE = ("1", "ON", "YES", "TRUE")
_FALSE = ("0", "OFF", "NO", "FALSE", "")


def diffusers_attention_backends() -> List[str]:
    """The values diffusers' ``AttentionBackendName`` takes, read without letting an invalid
    ``DIFFUSERS_ATTN_BACKEND`` break the import (diffusers reads it into ``utils.constants`` and builds its
    dispatcher's default from it when ``attention_dispatch`` is first imported)."""
    import importlib
    import sys

    import diffusers.utils.constants as constants

    try:
        mod = importlib.import_module("diffusers.models.attention_dispatch")
    except ValueError:  # the value itself: import once with diffusers' default just to read the names
        sys.modules.pop("diffusers.models.attention_dispatch", None)
        saved = constants.DIFFUSERS_ATTN_BACKEND
        constants.DIFFUSERS_ATTN_BACKEND = "native"
        try:
            mod = importlib.import_module("diffusers.models.attention_dispatch")
        finally:
            constants.DIFFUSERS_ATTN_BACKEND = saved
    return [m.value for m in mod.AttentionBackendName]


def _diffusers_attn_backend(v: str) -> Optional[str]:
    names = diffusers_attention_backends()
    if v in names:
        return None
    import difflib

    close = difflib.get_close_matches(v, names, n=1)
    return (f"diffusers knows no attention backend {v!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; it takes one of {', '.join(names)}. The runner sets every attention call site itself "
            "(backend.attention); fix: unset DIFFUSERS_ATTN_BACKEND and choose backend.attention=<name>")


def _bool(v: str) -> Optional[str]:
    if v.upper() in _TRUE + _FALSE:
        return None
    return f"not a boolean (diffusers reads anything but {'/'.join(_TRUE)} as false); fix: 1 or 0"


def _zero_one(v: str) -> Optional[str]:
    return None if v in ("0", "1") else "takes 0 or 1; fix: 0 or 1, or unset it"


def _int(v: str) -> Optional[str]:
    return None if re.fullmatch(r"\s*\d+\s*", v) else "not a non-negative integer; fix: an integer, or unset it"


def _visible_devices(v: str) -> Optional[str]:
    entry = r"\s*(-?\d+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+)\s*"
    if v.strip() == "" or re.fullmatch(f"{entry}(,{entry})*", v):
        return None
    return ("not a list of device indices or UUIDs (CUDA would hide every GPU and the run would fall back or be "
            "refused for another reason); fix: e.g. CUDA_VISIBLE_DEVICES=0,1, or unset it")


def _alloc_conf_format(v: str) -> Optional[str]:
    """Why an allocator setting is not a ``key:value,...`` list (None: it is). Needs no torch: libc10_cuda parses
    ``PYTORCH_CUDA_ALLOC_CONF`` while it loads and aborts the process (``terminate called after throwing an instance
    of 'c10::Error'``, seen on the H200 with torch 2.11 for ``garbage``), so this runs before torch is imported."""
    depth, parts, cur = 0, [], ""
    for ch in v:  # top-level commas only (roundup_power2_divisions:[256:1,512:2] holds some)
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    if not all(re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*:\s*\S.*", p) for p in parts):
        return ("not a list of key:value options (torch aborts the process when it loads its CUDA library); fix: "
                "e.g. expandable_segments:True, or unset it")
    return None


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def check_before_torch(environ: Optional[Dict[str, str]] = None) -> None:
    """The checks that must run before ``import torch`` (``python -m runner`` calls it first thing): the format of
    the allocator settings, which torch's CUDA library parses while it loads.

    Raises:
        EnvironmentVariableError: naming the variable, its value, why and the fix.
    """
    env = os.environ if environ is None else environ
    problems = [f"{n}={env[n]!r}: {why}" for n in ALLOC_CONF_VARS if n in env
                for why in [_alloc_conf_format(env[n])] if why]
    if problems:
        raise EnvironmentVariableError("environment variable problem(s):\n  " + "\n  ".join(problems))


def _alloc_conf(v: str) -> Optional[str]:
    """:func:`_alloc_conf_format`, then torch's own parser where a GPU is there (unknown options, bad values)."""
    why = _alloc_conf_format(v)
    if why:
        return why
    import torch

    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is not None and torch.cuda.is_available():  # torch's own parser: unknown options, bad values
        try:
            setter(v)
        except RuntimeError as e:
            return f"torch refuses it: {str(e).splitlines()[0]}; fix: correct it, or unset it"
    return None


def _dir_var(v: str) -> Optional[str]:
    why = _dir_problem(Path(v).expanduser())
    return None if why is None else f"{why}; fix: point it at a directory you can write, or unset it"


def _executable(v: str) -> Optional[str]:
    import shutil

    p = Path(v).expanduser()
    if (p.is_file() and os.access(p, os.X_OK)) or (os.sep not in v and shutil.which(v)):
        return None
    return (f"{'is not executable' if p.is_file() else 'is not a file'}; fix: point it at an ffmpeg binary, or unset "
            "it to use the ffmpeg imageio-ffmpeg ships")


def _slow_worker(v: str) -> Optional[str]:
    from runner.core.testing import parse_slow_worker

    try:
        parse_slow_worker(v)
    except ValueError as e:
        return str(e).split(": ", 1)[-1]
    return None


CHECKS: Dict[str, Callable[[str], Optional[str]]] = {
    "DIFFUSERS_ATTN_BACKEND": _diffusers_attn_backend,
    "DIFFUSERS_ATTN_CHECKS": _bool,
    "CUDA_VISIBLE_DEVICES": _visible_devices,
    "TORCH_CUDNN_SDPA_ENABLED": _zero_one,
    "PYTORCH_CUDA_ALLOC_CONF": _alloc_conf,
    "PYTORCH_ALLOC_CONF": _alloc_conf,
    "PYTORCH_HIP_ALLOC_CONF": _alloc_conf,
    "LOCAL_RANK": _int,
    "VLLM_CPU_KVCACHE_SPACE": _int,
    "TRITON_INTERPRET": _zero_one,
    "RUNNER_CACHE": _dir_var,
    "IMAGEIO_FFMPEG_EXE": _executable,
    "RUNNER_TEST_SLOW_WORKER": _slow_worker,  # test-only (runner.core.testing)
}


#: Variables a library reads that never act under the runner: why, and the fix. Each one set is warned about at
#: startup and recorded in the manifest's ``environment_ignored`` (a value that did not act is recorded as ignored,
#: never as applied); its value stays in ``environment``, which ``repro.sh`` exports.
IGNORED = {
    "DIFFUSERS_ATTN_BACKEND": "it sets diffusers' default attention backend, and the runner sets the backend of every "
                              "attention call site itself (backend.attention; the evidence records what ran), so the "
                              "default is never used; fix: backend.attention=<name>, and unset DIFFUSERS_ATTN_BACKEND",
}


def ignored_environment(environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``{variable: "NAME='value' is ignored: why; fix: ..."}`` for each variable of :data:`IGNORED` that is set
    (a valid value: :func:`check_environment` refuses an invalid one first)."""
    env = os.environ if environ is None else environ
    return {k: f"{k}={env[k]!r} is ignored: {why}" for k, why in IGNORED.items() if k in env}


def check_environment(environ: Optional[Dict[str, str]] = None) -> None:
    """Check every variable of :data:`CHECKS` that is set.

    Raises:
        EnvironmentVariableError: listing each bad variable, its value, why and the fix.
    """
    env = os.environ if environ is None else environ
    problems = []
    for name, check in CHECKS.items():
        if name in env:
            why = check(env[name])
            if why:
                problems.append(f"{name}={env[name]!r}: {why}")
    if problems:
        raise EnvironmentVariableError("environment variable problem(s):\n  " + "\n  ".join(problems))


def _dir_problem(path: Path) -> Optional[str]:
    """Why ``path`` cannot be used as a directory to write into (None: it can), found by doing it: the missing
    dirs are created, a file is created in the dir and removed, then the dirs this check created are removed again
    (the run creates them when it writes; a ``--plan`` or a refused run leaves nothing). ``os.access`` alone passes
    for root where nothing can be created (``/proc``, a read-only mount, a full disk)."""
    import random
    import time

    enoent = None
    for _ in range(20):  # concurrent checkers (torchrun ranks) may remove a dir one of them created between our steps
        why = _try_dir(Path(path))
        if why is not None and why.startswith(_ENOENT):
            enoent = why[len(_ENOENT):]
        elif why != _VANISHED:
            return why
        time.sleep(random.uniform(0.005, 0.05))  # let the other checker finish its step
    return enoent or f"{path} vanished while it was being checked (another process removes it)"


_VANISHED = "vanished"
#: :func:`_try_dir`'s prefix of an ENOENT under a parent that exists now: real (``/proc``) or a concurrent checker's
#: removed and re-created dir; :func:`_dir_problem` refuses it only when every try gets it.
_ENOENT = "enoent:"


def _try_dir(path: Path) -> Optional[str]:
    """One attempt of :func:`_dir_problem`; :data:`_VANISHED` when a dir it found was removed meanwhile."""
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory"
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    if p.exists() and not p.is_dir():
        return f"{p} is a file, so no directory can be created under it"
    created: List[Path] = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
                created.append(d)
            except FileExistsError:
                pass  # a concurrent run created it
            except FileNotFoundError as e:
                if not d.parent.is_dir():  # its parent, a concurrent checker's, was removed by that checker meanwhile
                    return _VANISHED
                # /proc answers ENOENT under an existing parent; so does a parent that a concurrent checker removed
                # and another re-created between our mkdir and the look above: _dir_problem tries again
                return _ENOENT + f"{d} cannot be created ({e.strerror or e})"
            except OSError as e:
                return f"{d} cannot be created ({e.strerror or e})"
        probe = path / f".runner-write-check-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.unlink(probe)
        except FileNotFoundError:
            return _VANISHED
        except OSError as e:
            return f"{path} is not writable ({e.strerror or e})" if not created else \
                f"{path} cannot be written ({e.strerror or e})"
        return None
    finally:
        for d in reversed(created):  # what this check created, deepest first; a dir someone wrote into stays
            try:
                os.rmdir(d)
            except OSError:
                pass


def check_dir(path: Path, key: str) -> None:
    """Refuse a directory the run must write when it cannot be created or written.

    Args:
        key: the config key or variable that named it (``output.dir``).

    Raises:
        OutputPathError: naming ``key``, the path, why and the fix.
    """
    why = _dir_problem(Path(path).expanduser())
    if why:
        raise OutputPathError(f"{key}={str(path)!r}: {why}; fix: {key}=<a directory you can write>")


def check_outside(cfg: Any, out_dir: Path, embedded: bool) -> None:
    """What a run reads or writes outside its config, checked at startup: the environment
    (:func:`check_environment`), the run dir, and the cache of embedded models when one is built (``embedded``)
    or ``cache_dir`` is set.

    Raises:
        EnvironmentVariableError, OutputPathError.
    """
    check_environment()
    for line in ignored_environment().values():
        log.warning(line)
    check_dir(out_dir, "run.resume" if cfg.run.resume else "output.dir" if cfg.output.dir else "hydra.run.dir")
    if cfg.cache_dir:
        check_dir(Path(cfg.cache_dir), "cache_dir")
    elif embedded and "RUNNER_CACHE" not in os.environ:
        check_dir(Path("~/.cache/runner").expanduser(), "cache_dir (default ~/.cache/runner)")


def check_launch_dirs(argv: List[str]) -> None:
    """The Hydra run (or sweep) dir of a command line, checked before Hydra creates it (Hydra's own
    ``NotADirectoryError`` is a traceback): the literal part of ``hydra.run.dir`` / ``hydra.sweep.dir`` before any
    interpolation, or ``outputs`` (the default's) when the command line sets none.

    Raises:
        OutputPathError: naming the key and the fix.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in argv) else "hydra.run.dir"
    given = next((a for a in argv if a.split("=", 1)[0] == key), None)
    if given is None:
        check_dir(Path("outputs"), f"{key} (default outputs/...)")
        return
    try:
        value = OverridesParser.create().parse_override(given).value()
    except Exception:  # noqa: BLE001 - Hydra reports a value it cannot parse
        return
    if isinstance(value, str):
        literal = value.split("${", 1)[0]
        if literal and "${" in value and not literal.endswith("/"):
            literal = str(Path(literal).parent)
        if literal:
            check_dir(Path(literal), key)
