"""Row checks that need no engine, run before any engine module (diffusers, transformers, vLLM, torch) is imported,
so that the commonest row mistake, a conditioning input file that does not exist, is refused in about a second
instead of after the libraries load (issue #38). The engine's own row checks (``read_rows``: every field of every
row, the inputs decoded and sized) still run later and stay the reference; this pass only refuses earlier what they
would refuse, with their message (``runner.core.media.read_input``'s reasons, ``file:line: field 'image' = 'x.png'
does not exist ...; fix: ...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

#: The tasks whose rows carry input files (``runner.core.schema.Task``); other tasks' rows with an ``image`` are the
#: engine's to refuse (with its own message: the task takes no such field).
CONDITIONING_TASKS = ("image_to_image", "inpaint", "edit", "image_to_video")
#: The input-file problems this pass decides without decoding (``runner.core.media.read_input``'s reasons).
FILE_PROBLEMS = ("does not exist", "is a URL", "cannot be read")


def missing_inputs(cfg: Any) -> List[str]:
    """The input files of a file dataset's rows (``jsonl``, ``csv``) that are missing, unreadable or URLs, for a
    model whose ``model.task`` is a conditioning task: ``file:line: field 'image' = 'x.png' does not exist (resolved
    to ...); fix: ...``, every one at once. Empty when the check does not apply or anything else is wrong with the
    file (the engine's checks say what)."""
    from runner.core import dataset as ds
    from runner.core import media
    from runner.core.errors import RunnerError

    model = cfg.get("model") or {}
    data = cfg.get("dataset") or {}
    task = model.get("task")
    if task is None or str(task) not in CONDITIONING_TASKS or "pipeline" in model:
        return []
    fmt = str(data.get("format"))
    if fmt not in ("jsonl", "csv") or not data.get("path"):
        return []
    path = Path(str(data.get("path"))).expanduser()
    try:
        raw = ds.read_raw(fmt, path, columns=ds.columns_option(data.get("columns")))
    except (RunnerError, OSError, ValueError):
        return []  # the engine's read of the file names what is wrong with it
    limit = data.get("limit")
    problems: List[str] = []
    for line, row in raw[:int(limit)] if limit else raw:
        for field in media.media_fields(ds.DIFFUSION_ROW):
            value = row.get(field)
            if value is None:
                continue
            try:
                value = media.parse_media(value, from_text=ds.reader(fmt).from_text)
            except (RunnerError, ValueError, TypeError):
                continue  # a malformed value: the engine's message
            many = isinstance(value, list)
            for i, v in enumerate(value if many else [value]):
                if not isinstance(v, (str, dict)):
                    continue
                _, given, _, why = media.read_input(field, v, path, data.get("media_root"))
                if why is not None and why.startswith(FILE_PROBLEMS):
                    name = f"{field}[{i}]" if many else field
                    problems.append(f"{path}:{line}: field {name!r} = {media.shown(given)} {why}; fix: "
                                    f"{media.fix_of(why)}")
    return problems


def check_rows_before_engines(cfg: Any) -> None:
    """Refuse (exit 2) the rows :func:`missing_inputs` finds.

    Raises:
        runner.core.errors.DatasetError: every such row problem, as the engine's check words it.
    """
    problems = missing_inputs(cfg)
    if problems:
        from runner.core.errors import DatasetError

        raise DatasetError(problems)
