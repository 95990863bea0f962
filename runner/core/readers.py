"""The registry of dataset sources (``dataset.format``): one :class:`Reader` record per source, read by
``runner.core.dataset`` (``read_raw``, ``source_path``, ``load_rows``) and by the schema, whose
``runner.core.schema.DatasetFormat`` choices are this registry's names (a misspelt ``dataset.format`` is refused at
compose time, listing them).

A new source is one record here: its name, its reading function (``"module:function"``, imported when the source is
read, so a heavy library loads only for runs that use it) and how its path and cells are taken. Where the bytes
live (a local path or a URL) is the reader function's concern, not the record's: the key is the source's format.

Import-light: the schema imports this module.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

#: ``(line or row number from 1, raw row)`` pairs, as a reader returns them.
RawRows = List[Tuple[int, Dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Reader:
    """One dataset source.

    Attributes:
        name: the ``dataset.format`` value.
        read: ``read(path, split, columns) -> raw rows`` (``(number, row)`` pairs, before ``dataset.columns`` renames
            the source columns; ``split``: ``dataset.split``; ``columns``: ``dataset.columns``, for a reader whose
            error messages name the column mapping), or its ``"module:function"`` path.
        from_text: its cells are text (CSV): typed fields are parsed from strings.
        path: what ``dataset.path`` must name: ``file``, ``file_or_dir`` (``hf``: a ``save_to_disk`` dir or a data
            file) or ``builtin`` (no path: the model's ``builtin_prompts`` under ``runner/data``).
        example: the example path a missing ``dataset.path`` fix quotes.
    """

    name: str
    read: Union[str, Callable[[Any, Optional[str], Optional[Dict[str, str]]], RawRows]]
    from_text: bool = False
    path: str = "file"
    example: str = ""

    def __post_init__(self) -> None:
        if self.path not in ("file", "file_or_dir", "builtin"):
            raise ValueError(f"Reader {self.name!r}: path={self.path!r} is not one of file, file_or_dir, builtin")

    def reader(self) -> Callable[[Any, Optional[str], Optional[Dict[str, str]]], RawRows]:
        """The reading function (imported on first use when given as a path)."""
        if callable(self.read):
            return self.read
        mod, _, attr = self.read.partition(":")
        return getattr(importlib.import_module(mod), attr)

    def example_path(self) -> str:
        """:attr:`example`, or ``/path/to/prompts.<name>``."""
        return self.example or f"/path/to/prompts.{self.name}"


#: ``dataset.format`` -> record, in the order messages list them; a new source is one entry.
READERS: Dict[str, Reader] = {r.name: r for r in (
    Reader("builtin", "runner.core.dataset:read_jsonl", path="builtin"),
    Reader("jsonl", "runner.core.dataset:read_jsonl"),
    Reader("csv", "runner.core.dataset:read_csv", from_text=True),
    Reader("txt", "runner.core.dataset:read_txt"),
    Reader("parquet", "runner.core.dataset:read_parquet"),
    Reader("hf", "runner.core.dataset:read_hf", path="file_or_dir", example="/path/to/saved_dataset"),
)}
