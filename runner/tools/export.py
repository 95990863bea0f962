"""Export a run dir to the formats training and evaluation pipelines read: Parquet (Hugging Face ``datasets``
layout) or WebDataset tar shards.

``python -m runner.export <run dir> --format parquet|webdataset|in-toto --out DIR [--shard-items N]``, or
``python -m runner.export <run dir> --verify <statement.intoto.json>`` (an in-toto statement checked back)

One row (sample) per ok item of ``items.jsonl``, in journal order, holding the artifact's bytes and the fields of the
run dir's folder index (``runner.core.sinks.folder_metadata_row``: ``file_name``, ``id``, ``key``, ``prompt``,
``negative_prompt``, ``seed``, ``parameters``, ``model``, ``run_id``, ``file_sha256``; a video's ``num_frames``
and ``fps``; ``meta``; a conditioned item's ``input_file_name`` and ``inputs``, its input files' sha256). Text runs (vLLM stages: no artifact file) export their records' fields alone (``prompt``,
``text``, ``output_token_ids``, ...).

* ``parquet``: ``data-<i>-of-<n>.parquet`` written by ``datasets`` (``Dataset.to_parquet``), so the image column
  carries the ``datasets.Image`` feature: ``datasets.load_dataset("parquet", data_files=...)`` decodes it to PIL,
  and ``pyarrow.parquet.read_table`` reads it as a struct ``{bytes, path}``. ``parameters`` and ``meta`` are
  structs. A video run's ``video`` column carries the ``datasets.Video`` feature (datasets >= 4), stored as the same
  ``{bytes, path}`` struct: ``load_dataset`` gives the feature, and decoding a row to frames needs ``torchcodec``
  (not a dependency: ``pip install torchcodec`` for the installed torch; without it datasets raises "To support
  decoding videos, please install 'torchcodec'"); ``ds.cast_column("video", datasets.Video(decode=False))`` reads
  the bytes and path without it, as does ``pyarrow``.
* ``webdataset``: ``data-<i>.tar`` shards (``webdataset.ShardWriter``); each sample is ``<key>.png`` (or ``.mp4``)
  plus ``<key>.json`` (the fields), its ``__key__`` the item's 6-digit position and file stem (dots replaced: the
  WebDataset convention splits the extension at the first dot).

* ``in-toto``: ``statement.intoto.json``, an in-toto Statement v1 whose subjects are the artifacts (and the journal
  and folder indexes) with their sha256 and whose predicate is SLSA Provenance v1 built from the manifest
  (:func:`intoto_statement`); no artifact bytes are copied.
  ``python -m runner.export <run dir> --verify <statement.intoto.json or its export dir>`` checks one back
  (:func:`verify_statement`): every subject's file (and the ``manifest.json`` byproduct) is re-hashed and must have
  the statement's sha256, and the statement itself the sha256 its ``export.json`` recorded; exit 0 verified, 2
  refused, naming each file whose digest differs.

Every artifact is checked against its recorded ``file_sha256`` before it is exported. The files are written under a
temp name and renamed into ``DIR`` once complete, with ``export.json`` (format, source run id, rows, each file's
sha256) last. Exit codes: 0 exported; 2 bad input (no run dir, no items, a modified or missing artifact, ``DIR`` not
empty, the format's package not installed: ``pip install -e ".[export]"``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from runner.core.dataset import file_sha256
from runner.core.errors import RunnerError, UserInputError
from runner.core.errors import install_fix

FORMATS = ("parquet", "webdataset", "in-toto")
#: in-toto Statement v1 and its predicate (SLSA Provenance v1), for ``--format in-toto``.
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://github.com/runner/runner/run@v1"
#: Fields of a text record exported as they are (the record is the artifact).
TEXT_FIELDS = ("id", "key", "index", "prompt", "prompt_token_ids", "output_token_ids", "text", "finish_reason",
               "seed", "sampling", "meta")


class ExportError(UserInputError, ValueError):
    """The run dir cannot be exported as asked (names the file or argument and the fix); exit 2."""


class StatementMismatchError(ExportError):
    """An in-toto statement does not hold for the run dir it is checked against: a subject's file is missing or
    its sha256 differs from the statement's, or the statement differs from what its ``export.json`` recorded
    (names each file and both digests); exit 2."""


def rows(run_dir: Path) -> Iterator[Dict[str, Any]]:
    """The export rows of a run dir, in ``items.jsonl`` order: the folder-index fields of each ok record plus
    ``data`` (the artifact's bytes) and ``ext`` (``png``, ``mp4``), or a text record's :data:`TEXT_FIELDS`.

    Raises:
        ExportError: no ``manifest.json``/``items.jsonl``, no ok item, or an artifact that is missing or no longer
            has its recorded sha256 (names the file).
    """
    from runner.core.sinks import folder_metadata_row, read_journal

    run_dir = Path(run_dir)
    if not (run_dir / "items.jsonl").is_file() or not (run_dir / "manifest.json").is_file():
        raise ExportError(f"{run_dir} is not a run dir (no items.jsonl and manifest.json); fix: pass the dir a run "
                          "wrote (outputs/runs/<date>/<time>)")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    model = ((manifest.get("config") or {}).get("model") or {}).get("name")
    ok = [r for r in read_journal(run_dir / "items.jsonl") if r.get("status") == "ok"]
    if not ok:
        raise ExportError(f"{run_dir}/items.jsonl lists no ok item; fix: finish the run first (re-run the same "
                          "command to resume it)")
    for r in ok:
        if not r.get("file"):
            yield {k: r[k] for k in TEXT_FIELDS if k in r} | {"model": model, "run_id": manifest.get("run_id")}
            continue
        f = run_dir / r["file"]
        if not f.is_file():
            raise ExportError(f"{f}: the artifact of item {r.get('key')!r} is missing; fix: re-run the same command "
                              "into the run dir (it regenerates missing items)")
        data = f.read_bytes()
        if hashlib.sha256(data).hexdigest() != r.get("file_sha256"):
            raise ExportError(f"{f}: modified after the run (sha256 differs from items.jsonl); fix: re-run the "
                              "same command into the run dir (it regenerates the item)")
        yield {**folder_metadata_row(r, model, manifest.get("run_id")), "data": data, "ext": f.suffix.lstrip("."),
               "folder": Path(r["file"]).parts[0]}


def _chunks(it: Iterator[Dict[str, Any]], n: int) -> Iterator[List[Dict[str, Any]]]:
    buf: List[Dict[str, Any]] = []
    for r in it:
        buf.append(r)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf


def _need(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"the export needs the {module!r} package, which is not installed; fix: "
                          f"{install_fix('export', f'or pip install {module}')}") from None


def _parquet(samples: Iterator[Dict[str, Any]], tmp: Path, shard_items: int) -> List[Path]:
    datasets = _need("datasets")
    _need("pyarrow")
    datasets.disable_progress_bars()
    parts = []
    for chunk in _chunks(samples, shard_items):
        recs = []
        column = None
        for s in chunk:
            s = dict(s)
            data, ext, folder = s.pop("data", None), s.pop("ext", None), s.pop("folder", None)
            if data is not None:
                column = "image" if folder == "images" else "video"
                s = {column: {"bytes": data, "path": s["file_name"]}, **s}
            recs.append(s)
        ds = datasets.Dataset.from_list(recs)
        if column == "image":
            ds = ds.cast_column("image", datasets.Image())
        elif column == "video":  # typed without decoding anything: decoding needs torchcodec (module docstring)
            ds = ds.cast_column("video", datasets.Video())
        p = tmp / f"part-{len(parts):05d}.parquet"
        ds.to_parquet(str(p))
        parts.append(p)
    return parts


def _webdataset(samples: Iterator[Dict[str, Any]], tmp: Path, shard_items: int) -> List[Path]:
    wds = _need("webdataset")
    parts: List[Path] = []
    n = 0
    writer = None
    try:
        for s in samples:
            if writer is None or n % shard_items == 0:
                if writer is not None:
                    writer.close()
                parts.append(tmp / f"part-{len(parts):05d}.tar")
                writer = wds.TarWriter(str(parts[-1]))
            s = dict(s)
            data, ext, _ = s.pop("data", None), s.pop("ext", None), s.pop("folder", None)
            stem = Path(s.get("file_name") or str(s.get("key"))).stem.replace(".", "_")
            sample = {"__key__": f"{n:06d}_{stem}", "json": json.dumps(s, ensure_ascii=False).encode()}
            if data is not None:
                sample[ext] = data
            writer.write(sample)
            n += 1
    finally:
        if writer is not None:
            writer.close()
    return parts


def intoto_statement(run_dir: Path) -> Dict[str, Any]:
    """An in-toto Statement v1 (https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md) about the
    run dir's artifacts: one ``subject`` per ok item's file (``name`` relative to the run dir, ``digest.sha256``,
    each checked against its record first) and per journal/index file (``items.jsonl``, ``images/metadata.jsonl``),
    with an SLSA Provenance v1 predicate: ``buildDefinition`` (``externalParameters``: the overrides and the composed
    config; ``internalParameters``: the run identity; ``resolvedDependencies``: the dataset and the model's weight
    files with their sha256) and ``runDetails`` (builder ``runner``, invocation id = the run id, start and end).

    Raises:
        ExportError: see :func:`rows` (a modified or missing artifact, no ok item, not a run dir).
    """
    from runner.core.sinks import read_journal

    run_dir = Path(run_dir)
    list(rows(run_dir))  # every artifact checked against its record (raises ExportError)
    m = json.loads((run_dir / "manifest.json").read_text())
    subjects = [{"name": r["file"], "digest": {"sha256": r["file_sha256"]}}
                for r in read_journal(run_dir / "items.jsonl") if r.get("status") == "ok" and r.get("file")]
    for rel in ("items.jsonl", "images/metadata.jsonl", "videos/metadata.jsonl"):
        if (run_dir / rel).is_file():
            subjects.append({"name": rel, "digest": {"sha256": file_sha256(run_dir / rel)}})
    ds = m.get("dataset") or {}
    deps = [{"uri": Path(ds["path"]).as_uri() if ds.get("path") else "dataset", "digest": {"sha256": ds["sha256"]},
             "name": "dataset"}] if ds.get("sha256") else []
    source = ((m.get("model") or {}).get("source") or {})
    for name, sha in sorted((source.get("files") or {}).items()):
        if isinstance(sha, str) and len(sha) == 64:
            deps.append({"name": f"model/{name}", "digest": {"sha256": sha}})
    git = m.get("git") or {}
    if git.get("commit"):
        deps.append({"name": "runner", "digest": {"gitCommit": git["commit"]}, "annotations": {"dirty": git.get("dirty")}})
    return {"_type": STATEMENT_TYPE, "subject": subjects, "predicateType": PREDICATE_TYPE, "predicate": {
        "buildDefinition": {"buildType": BUILD_TYPE,
                            "externalParameters": {"overrides": m.get("overrides"), "config": m.get("config")},
                            "internalParameters": {"identity": m.get("identity"), "packages": m.get("packages"),
                                                   "platform": m.get("platform")},
                            "resolvedDependencies": deps},
        "runDetails": {"builder": {"id": BUILD_TYPE.rsplit("/", 1)[0]},
                       "metadata": {"invocationId": m.get("run_id"), "startedOn": m.get("started_at"),
                                    "finishedOn": m.get("ended_at")},
                       "byproducts": [{"name": "manifest.json", "digest": {"sha256": file_sha256(run_dir / "manifest.json")}}]}}}


def _subject_path(run_dir: Path, name: Any) -> Optional[Path]:
    """``run_dir / name`` for a subject name relative to the run dir and inside it; None otherwise."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return None
    return run_dir / name


def verify_statement(statement: Path, run_dir: Path) -> Dict[str, Any]:
    """Check an in-toto statement written by ``--format in-toto`` against ``run_dir``: each ``subject`` (and the
    ``runDetails.byproducts``) names a file inside the run dir whose sha256, computed now from its bytes, is the
    statement's ``digest.sha256``; with the statement's ``export.json`` beside it, the statement's own sha256 is
    the one recorded there.

    Args:
        statement: ``statement.intoto.json``, or the export dir holding it.

    Returns:
        ``{"statement", "run_dir", "subjects": how many were re-hashed, "run_id"}``.

    Raises:
        ExportError: no statement there, not JSON, or not an in-toto Statement v1 with subjects.
        StatementMismatchError: a file is missing or its digest differs (each such file named, with both
            digests), or the statement was modified after the export.
    """
    statement, run_dir = Path(statement), Path(run_dir)
    if statement.is_dir():
        statement = statement / "statement.intoto.json"
    if not statement.is_file():
        raise ExportError(f"{statement}: no in-toto statement there; fix: pass the statement.intoto.json that "
                          "--format in-toto wrote (or its --out dir)")
    try:
        doc = json.loads(statement.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"{statement} is not JSON ({e}); fix: pass the statement that --format in-toto "
                          "wrote") from None
    doc = doc if isinstance(doc, dict) else {}
    subjects = doc.get("subject")
    if doc.get("_type") != STATEMENT_TYPE or doc.get("predicateType") != PREDICATE_TYPE or not subjects \
            or not isinstance(subjects, list):
        raise ExportError(f"{statement} is not an in-toto Statement v1 ({STATEMENT_TYPE}) with a {PREDICATE_TYPE} "
                          "predicate and subjects; fix: pass the statement that --format in-toto wrote")
    bad: List[str] = []
    record = statement.with_name("export.json")
    if record.is_file():
        want = ((json.loads(record.read_text()).get("files") or {}).get(statement.name) or {}).get("sha256")
        got = file_sha256(statement)
        if want and got != want:
            bad.append(f"{statement.name}: sha256 {got} differs from {want} recorded in {record} (the statement was "
                       "modified after the export)")
    byproducts = ((doc.get("predicate") or {}).get("runDetails") or {}).get("byproducts") or []
    checked = 0
    for s in [*subjects, *byproducts]:
        name, want = (s or {}).get("name"), ((s or {}).get("digest") or {}).get("sha256")
        f = _subject_path(run_dir, name)
        if f is None or not isinstance(want, str):
            bad.append(f"{name!r}: not a file name inside the run dir with a sha256 digest")
            continue
        if not f.is_file():
            bad.append(f"{name}: missing from {run_dir}")
            continue
        got = file_sha256(f)
        checked += 1
        if got != want:
            bad.append(f"{name}: sha256 {got} differs from the statement's {want}")
    if bad:
        raise StatementMismatchError(
            f"{statement} does not hold for {run_dir}: {'; '.join(bad)}; fix: the run dir's files changed after "
            "the export (or this is another run's statement): re-run the same command into the run dir to "
            "regenerate modified items, then export the statement again")
    manifest = run_dir / "manifest.json"
    run_id = json.loads(manifest.read_text()).get("run_id") if manifest.is_file() else None
    return {"statement": str(statement), "run_dir": str(run_dir), "subjects": checked, "run_id": run_id}


def export(run_dir: Path, fmt: str, out: Path, shard_items: int = 10_000) -> Dict[str, Any]:
    """Export ``run_dir`` into the new or empty dir ``out`` (see the module docstring).

    Args:
        fmt: ``parquet`` or ``webdataset``.
        shard_items: rows per output file (>= 1).

    Returns:
        The ``export.json`` document: ``format``, ``source`` (run dir, run id, model), ``rows``, ``files``
        (name -> ``{rows, sha256}``).

    Raises:
        ExportError: see :func:`rows`; an unknown format; ``shard_items`` < 1; ``out`` not empty; a missing package.
    """
    from runner.core.artifacts import atomic_write_json, fsync_dir

    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not known; fix: one of {', '.join(FORMATS)}")
    if shard_items < 1:
        raise ExportError(f"--shard-items {shard_items} must be >= 1")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty dir; fix: name a new dir")
    run_dir = Path(run_dir)
    if fmt == "in-toto":
        statement = intoto_statement(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "statement.intoto.json", statement)
        manifest = json.loads((run_dir / "manifest.json").read_text())
        doc = {"format": fmt, "rows": sum(1 for s in statement["subject"] if s["name"].startswith(("images/",
                                                                                                   "videos/"))
                                          and not s["name"].endswith("metadata.jsonl")),
               "source": {"run_dir": str(run_dir.resolve()), "run_id": manifest.get("run_id"),
                          "status": manifest.get("status")},
               "files": {"statement.intoto.json": {"sha256": file_sha256(out / "statement.intoto.json")}}}
        atomic_write_json(out / "export.json", doc)
        return doc
    counted: List[int] = []

    def counting(it: Iterator[Dict[str, Any]]) -> Iterator[Dict[str, Any]]:
        for r in it:
            counted.append(1)
            yield r

    samples = counting(rows(run_dir))
    first = next(samples)  # the run dir's errors before anything is created
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".partial-{os.getpid()}"
    tmp.mkdir()

    def chained() -> Iterator[Dict[str, Any]]:
        yield first
        yield from samples

    try:
        parts = (_parquet if fmt == "parquet" else _webdataset)(chained(), tmp, shard_items)
        files: Dict[str, Any] = {}
        ext = "parquet" if fmt == "parquet" else "tar"
        for i, p in enumerate(parts):
            name = f"data-{i:05d}-of-{len(parts):05d}.{ext}"
            os.replace(p, out / name)
            files[name] = {"sha256": file_sha256(out / name)}
    finally:
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()
    fsync_dir(out)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    doc = {"format": fmt, "rows": len(counted), "shard_items": shard_items,
           "source": {"run_dir": str(run_dir.resolve()), "run_id": manifest.get("run_id"),
                      "status": manifest.get("status"),
                      "model": ((manifest.get("config") or {}).get("model") or {}).get("name")},
           "files": files}
    atomic_write_json(out / "export.json", doc)
    return doc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry: exit 0 exported (prints the ``export.json`` path), 2 bad input (the error and its fix)."""
    ap = argparse.ArgumentParser(prog="python -m runner.export",
                                 description="Export a run dir's ok items (artifact bytes + prompt, seed, parameters) "
                                             "to Parquet (Hugging Face datasets layout) or WebDataset tar shards, or "
                                             "write an in-toto statement (SLSA provenance) about its artifacts, or check one "
                                             "back (--verify).")
    ap.add_argument("run_dir", type=Path, help="a run dir (outputs/runs/<date>/<time>)")
    ap.add_argument("--format", choices=FORMATS, help="output format (required unless --verify)")
    ap.add_argument("--out", type=Path, help="a new or empty output dir (required unless --verify)")
    ap.add_argument("--shard-items", type=int, default=10_000, help="rows per output file (default 10000)")
    ap.add_argument("--verify", type=Path, default=None, metavar="STATEMENT",
                    help="instead of exporting, check an in-toto statement (statement.intoto.json or its export "
                         "dir) against the run dir: every subject's file re-hashed")
    a = ap.parse_args(argv)
    if a.verify is None and (a.format is None or a.out is None):
        ap.error("--format and --out are required (or --verify STATEMENT)")
    if a.verify is not None and (a.format is not None or a.out is not None):
        ap.error("--verify checks a statement: it takes no --format or --out")
    try:
        if a.verify is not None:
            res = verify_statement(a.verify, a.run_dir)
            print(f"verified: {res['subjects']} files of {res['statement']} hold for {res['run_dir']}")
            return 0
        doc = export(a.run_dir, a.format, a.out, a.shard_items)
    except RunnerError as e:
        print(f"export: {type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    print(f"{doc['rows']} rows -> {a.out / 'export.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
