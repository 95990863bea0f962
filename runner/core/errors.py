"""The exception hierarchy of user-facing errors: every mistake a user can make ends in one of these.

Each class carries what the CLI needs to end the run without a traceback:

* ``exit_code``: the process exit code (2 bad input or a refusal, 3 evidence contradicts the resolution);
* ``outcome``: the ``job_status.json`` outcome (``invalid``, ``refused``, ``evidence_mismatch``);
* ``fix``: optionally, what to do about it (``RunnerError(msg, fix="...")``); most messages already end in
  ``"; fix: ..."`` and give none separately.

``runner.app.jobs.run_job`` and the other CLIs classify by these attributes alone (``isinstance(e, RunnerError)``),
so a new error class only has to derive from the right base. Classes defined elsewhere keep their old builtin
base as a mixin (``class DatasetError(UserInputError, ValueError)``) so callers catching ``ValueError`` still do.

This module imports nothing from the project (every module may import it).
"""

from __future__ import annotations

from typing import Dict, List, Optional


class RunnerError(Exception):
    """Base of every error a user can cause: bad input, a refused request, evidence contradicting a run.

    Attributes:
        exit_code: process exit code of a run that stops with this error.
        outcome: the ``job_status.json`` outcome it records.
        fix: what the user should do, or None when the message already says it (or there is nothing to do).
    """

    exit_code: int = 2
    outcome: str = "invalid"
    fix: Optional[str] = None

    def __init__(self, *args: object, fix: Optional[str] = None) -> None:
        super().__init__(*args)
        if fix is not None:
            self.fix = fix

    def __str__(self) -> str:
        # BaseException's text, not a mixin's (KeyError would quote the message).
        msg = BaseException.__str__(self)
        if self.fix and "fix:" not in msg:
            return f"{msg}; fix: {self.fix}"
        return msg


class UserInputError(RunnerError):
    """Bad input: an unknown name, a malformed dataset row, a value out of range, a path that is not there.
    Outcome ``invalid``, exit 2; nothing is written but a ``status: invalid`` manifest."""

    exit_code = 2
    outcome = "invalid"


class RefusedError(UserInputError):
    """A documented refusal: a valid, explicit request (e.g. ``backend.attention=trtllm``) that cannot run on this
    platform. Outcome ``refused``, exit 2; a sweep counts it as accepted (the matrix shows ``unsupported``)."""

    exit_code = 2
    outcome = "refused"


class EvidenceMismatchError(RunnerError):
    """What executed contradicts what was resolved (``evidence.strict=true``). Outcome ``evidence_mismatch``,
    exit 3."""

    exit_code = 3


class EvidenceError(EvidenceMismatchError, RuntimeError):
    """The run's evidence contradicts its resolution (strict mode); names the layer and what ran instead (built by
    the engines' evidence, e.g. ``models.denoiser_evidence``, raised by the run loop)."""
    outcome = "evidence_mismatch"


class ConfigValueError(UserInputError, ValueError):
    """A run-level config value is out of range (names the field, the value and the fix)."""


class StorageError(RunnerError, OSError):
    """The run dir cannot be written: disk full (``ENOSPC``), quota (``EDQUOT``), read-only (``EROFS``), permission
    (``EACCES``/``EPERM``). The run stops at the first such error instead of failing every further item; what was
    already written durably is kept (no partial file is left: the temp file is removed), and re-running the same
    command resumes once the cause is fixed. Outcome ``storage_error``, exit 1 (the input was fine)."""

    exit_code = 1
    outcome = "storage_error"


class RunDirLockError(RunnerError):
    """The run dir cannot be held for this run: it cannot be created, or another run holds it
    (:class:`RunDirInUseError`). Exit 2; nothing is written into the dir, not even ``job_status.json`` (the dir may
    belong to the run that holds it)."""

    exit_code = 2
    outcome = "invalid"


class RunDirInUseError(RunDirLockError):
    """Another run (another process, or another data-parallel run) holds the run dir's lock (names the dir, the
    holder's pid, host, start time and command, and the fix)."""

    outcome = "in_use"


class ForeignDirError(RunDirLockError):
    """The run dir named by the user is an existing folder that holds no run but files the runner did not write
    (``runner.core.rundir.check_own_dir``): refused before anything is written there (names the key, the dir, a few
    of its files and the fix)."""


class DatasetError(UserInputError, ValueError):
    """Raised for bad dataset input (``runner.core.dataset``, ``runner.core.media``). ``problems`` lists one message
    per bad field, each naming file, line, field, value and the fix. ``rows``: a reader's readable rows beside the
    lines it could not read (``(line, raw row)`` pairs), so the rows are validated too and every problem of the
    file is reported at once (``runner.core.dataset.load_rows``); None when nothing past the problem was read."""

    def __init__(self, problems: List[str], rows: Optional[list] = None):
        self.problems = problems
        self.rows = rows
        head = f"{len(problems)} problem(s) in the dataset:" if len(problems) > 1 else "dataset problem:"
        super().__init__(head + "\n  " + "\n  ".join(problems))

    def __reduce__(self):  # pickled by Ray: rebuild from the problems, not from the joined message
        return type(self), (self.problems,), self.__dict__


#: ``{extra: its requirements}``: the optional extras of ``pyproject.toml`` a refusal names (``tests/test_cli.py``
#: checks they are pyproject's), shown beside the extra so that the range stays visible.
EXTRAS: Dict[str, str] = {
    "scale": "ray[data]>=2.40, submitit>=1.5", "export": "datasets>=4.0, pyarrow>=15, webdataset>=0.2.86",
    "validate": "jsonschema>=4.18", "mlflow": "mlflow-skinny>=2.10", "torchao": "torchao>=0.18",
    "lora": "peft>=0.21,<0.22", "cache-dit": "cache-dit>=1.5.3", "storage": "s3fs>=2025.3.0"}


def install_fix(extra: str, note: str = "") -> str:
    """The fix of a missing optional dependency, worded one way by every refusal: the project's extra as the README
    installs the project (``pip install -e ".[lora]"``: the checkout's extra; ``runner[...]`` would name an unrelated
    ``runner`` on PyPI), then its requirements from :data:`EXTRAS` and ``note``: ``pip install -e ".[lora]"
    (peft>=0.21,<0.22)``."""
    return f'pip install -e ".[{extra}]"  (' + "; ".join(x for x in (EXTRAS[extra], note) if x) + ")"
