"""Outputs people can load (issue #20): every item record keeps its prompt, negative prompt and ``file_name``;
``images/metadata.jsonl`` follows Hugging Face's imagefolder convention and ``datasets.load_dataset("imagefolder")``
(the real library) reads image + prompt + seed + parameters from a run dir; the index follows ``items.jsonl``
through resume and compaction; PNG text chunks and MP4 tags carry the same fields and keep the bytes a function of
the inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _helpers import import_extra  # noqa: E402

TOY = ["model=toy_shapes"]


def _lines(p: Path):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def _load_imagefolder(run_dir: Path, cache: Path):
    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    return datasets.load_dataset("imagefolder", data_dir=str(run_dir / "images"), cache_dir=str(cache))["train"]


def test_records_index_and_png_text_load_with_datasets(execute, tmp_path):
    from PIL import Image

    r = execute([*TOY, "dataset.limit=3"], tmp_path / "run")
    assert r.code == 0
    items = r.items
    meta = _lines(r.run_dir / "images" / "metadata.jsonl")
    run_id = r.manifest["run_id"]
    assert r.manifest["folder_metadata"] == {"images/metadata.jsonl": 3}
    assert [m["file_name"] for m in meta] == [it["file_name"] for it in items]
    for it, m in zip(items, meta):
        assert it["file"] == f"images/{it['file_name']}" and it["prompt"].startswith("a ")
        assert it["negative_prompt"] is None
        assert (m["prompt"], m["seed"], m["parameters"], m["model"], m["run_id"], m["file_sha256"]) == (
            it["prompt"], it["seed"], it["params"], "toy_shapes", run_id, it["file_sha256"])
        text = Image.open(r.run_dir / it["file"]).text
        assert text["prompt"] == it["prompt"] and int(text["seed"]) == it["seed"] and text["model"] == "toy_shapes"
        # the params as applied, less the batch composition (kept in the record: the bytes do not depend on it)
        assert json.loads(text["parameters"]) == {k: v for k, v in it["params"].items() if k != "batch_size"}
        assert it["params"]["batch_size"] == 1
        assert "negative_prompt" not in text  # none applied
    ds = _load_imagefolder(r.run_dir, tmp_path / "hf_cache")
    assert len(ds) == 3
    by_prompt = {row["prompt"]: row for row in ds}
    for it in items:
        row = by_prompt[it["prompt"]]
        assert row["seed"] == it["seed"] and row["parameters"]["width"] == it["params"]["width"] == 64
        assert row["model"] == "toy_shapes" and row["run_id"] == run_id
        want = np.asarray(Image.open(r.run_dir / it["file"]).convert("RGB"))
        assert np.array_equal(np.asarray(row["image"].convert("RGB")), want)


def test_png_bytes_stay_a_function_of_the_inputs(execute, tmp_path):
    """Two runs (two run ids) write byte-identical PNGs: the embedded fields hold nothing per run."""
    a = execute([*TOY, "dataset.limit=2"], tmp_path / "a")
    b = execute([*TOY, "dataset.limit=2"], tmp_path / "b")
    assert a.code == b.code == 0 and a.manifest["run_id"] != b.manifest["run_id"]
    assert a.pngs() == b.pngs()


def test_index_follows_the_journal_through_resume_and_compaction(execute, tmp_path):
    d = tmp_path / "run"
    assert execute([*TOY, "dataset.limit=3"], d).code == 0
    (d / "images" / "metadata.jsonl").write_text('{"file_name": "stale.png", "prompt": "x"}\n')  # a killed run's
    r = execute([*TOY, "dataset.limit=2"], d)  # a smaller limit: one file is no longer an item of the run
    assert r.code == 0 and r.manifest["counts"]["reused"] == 2
    meta = _lines(d / "images" / "metadata.jsonl")
    assert [m["file_name"] for m in meta] == [it["file_name"] for it in r.items] and len(meta) == 2
    assert all(m["run_id"] == r.manifest["run_id"] for m in meta)  # the run whose journal lists them
    assert len(_lines(d / "items.unlisted.jsonl")) == 1 and len(list((d / "images").glob("*.png"))) == 3
    ds = _load_imagefolder(d, tmp_path / "hf_cache")
    assert sorted(ds["prompt"]) == sorted(it["prompt"] for it in r.items)  # the unlisted file is not loaded
    r = execute([*TOY, "dataset.limit=3"], d)
    assert r.code == 0 and len(_lines(d / "images" / "metadata.jsonl")) == 3
    assert not list(d.rglob(".*.tmp*"))


def test_negative_prompt_is_kept_in_the_record_index_and_png(execute, tmp_path, write_jsonl):
    from PIL import Image

    rows = write_jsonl([{"id": "neg", "prompt": "a red fox", "negative_prompt": "blurry, ünïcode"}])
    r = execute(["dataset=jsonl", f"dataset.path={rows}", "model.generation.true_cfg_scale=2",
                 "model.generation.num_inference_steps=2"], tmp_path / "run")
    assert r.code == 0
    (it,) = r.items
    assert it["negative_prompt"] == "blurry, ünïcode" == it["params"]["negative_prompt"]
    assert _lines(r.run_dir / "images" / "metadata.jsonl")[0]["negative_prompt"] == "blurry, ünïcode"
    assert Image.open(r.run_dir / it["file"]).text["negative_prompt"] == "blurry, ünïcode"


# ------------------------------------------------------------------------------------------------ runner.tools.export
@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, compose):
    from runner.app.execute import run

    d = tmp_path_factory.mktemp("export") / "run"
    ov = ["platform=cpu", *TOY, "dataset.limit=3"]
    assert run(compose(ov), d, ov) == 0
    return d


def _export(args):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    import os

    env = dict(os.environ, PYTHONPATH=str(repo))
    return subprocess.run([sys.executable, "-m", "runner.export", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_export_parquet_reads_back_with_pyarrow_and_datasets(toy_run, tmp_path):
    import io

    pq = import_extra("export", "pyarrow.parquet")
    from PIL import Image

    p = _export([toy_run, "--format", "parquet", "--out", tmp_path / "pq", "--shard-items", "2"])
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "pq" / "export.json").read_text())
    items = _lines(toy_run / "items.jsonl")
    assert doc["rows"] == 3 and sorted(doc["files"]) == ["data-00000-of-00002.parquet", "data-00001-of-00002.parquet"]
    assert doc["source"]["run_id"] == json.loads((toy_run / "manifest.json").read_text())["run_id"]
    table = pq.read_table([tmp_path / "pq" / f for f in sorted(doc["files"])][0]).to_pylist() + pq.read_table(
        [tmp_path / "pq" / f for f in sorted(doc["files"])][1]).to_pylist()
    assert [r["file_name"] for r in table] == [it["file_name"] for it in items]
    for row, it in zip(table, items):
        assert row["image"]["bytes"] == (toy_run / it["file"]).read_bytes()
        assert (row["prompt"], row["seed"], row["model"]) == (it["prompt"], it["seed"], "toy_shapes")
        assert row["parameters"]["num_inference_steps"] == it["params"]["num_inference_steps"]
        Image.open(io.BytesIO(row["image"]["bytes"])).verify()
    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files=sorted(str(tmp_path / "pq" / f) for f in doc["files"]),
                               cache_dir=str(tmp_path / "hf"))["train"]
    assert ds[0]["image"].size == (64, 64) and ds[0]["prompt"] == items[0]["prompt"]


def test_export_webdataset_reads_back_with_webdataset(toy_run, tmp_path):
    wds = import_extra("export", "webdataset")

    p = _export([toy_run, "--format", "webdataset", "--out", tmp_path / "wds"])
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "wds" / "export.json").read_text())
    (tar,) = doc["files"]
    samples = list(wds.WebDataset(str(tmp_path / "wds" / tar), shardshuffle=False))
    items = _lines(toy_run / "items.jsonl")
    assert len(samples) == len(items) == 3
    for s, it in zip(samples, items):
        fields = json.loads(s["json"])
        assert s["png"] == (toy_run / it["file"]).read_bytes()
        assert (fields["prompt"], fields["seed"], fields["file_name"]) == (it["prompt"], it["seed"], it["file_name"])


def test_export_refuses_a_modified_artifact_and_a_non_empty_out(toy_run, tmp_path):
    import shutil

    import_extra("export", "datasets")  # the parquet export needs it (the "export" extra)

    d = tmp_path / "copy"
    shutil.copytree(toy_run, d)
    f = d / _lines(d / "items.jsonl")[1]["file"]
    f.write_bytes(f.read_bytes() + b"\0")
    p = _export([d, "--format", "parquet", "--out", tmp_path / "x"])
    assert p.returncode == 2 and "modified after the run" in p.stderr and f.name in p.stderr and "fix:" in p.stderr
    assert not (tmp_path / "x" / "export.json").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    p = _export([toy_run, "--format", "webdataset", "--out", tmp_path / "full"])
    assert p.returncode == 2 and "not an empty dir" in p.stderr
    p = _export([tmp_path, "--format", "parquet", "--out", tmp_path / "y"])
    assert p.returncode == 2 and "not a run dir" in p.stderr


def test_export_in_toto_statement_names_every_artifact_and_the_run(toy_run, tmp_path):
    import hashlib

    p = _export([toy_run, "--format", "in-toto", "--out", tmp_path / "att"])
    assert p.returncode == 0, p.stderr
    st = json.loads((tmp_path / "att" / "statement.intoto.json").read_text())
    m = json.loads((toy_run / "manifest.json").read_text())
    assert st["_type"] == "https://in-toto.io/Statement/v1" and st["predicateType"] == "https://slsa.dev/provenance/v1"
    subjects = {s["name"]: s["digest"]["sha256"] for s in st["subject"]}
    items = _lines(toy_run / "items.jsonl")
    assert {it["file"]: it["file_sha256"] for it in items}.items() <= subjects.items()
    for name in ("items.jsonl", "images/metadata.jsonl"):
        assert subjects[name] == hashlib.sha256((toy_run / name).read_bytes()).hexdigest()
    pred = st["predicate"]
    assert pred["runDetails"]["metadata"]["invocationId"] == m["run_id"]
    assert pred["buildDefinition"]["internalParameters"]["identity"]["sha256"] == m["identity"]["sha256"]
    deps = {d["name"]: d["digest"] for d in pred["buildDefinition"]["resolvedDependencies"]}
    assert deps["dataset"]["sha256"] == m["dataset"]["sha256"]


def _flip(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def test_export_in_toto_refuses_a_modified_artifact_and_writes_no_statement(toy_run, tmp_path):
    """The in-toto export checks every artifact against its record before it states its digest: a file modified
    after the run is refused (exit 2, naming it) and no statement is written."""
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(toy_run, d)
    f = d / _lines(d / "items.jsonl")[2]["file"]
    _flip(f)
    p = _export([d, "--format", "in-toto", "--out", tmp_path / "att"])
    assert p.returncode == 2 and "modified after the run" in p.stderr and f.name in p.stderr, p.stderr
    assert not (tmp_path / "att" / "statement.intoto.json").exists()


def test_in_toto_statement_is_verified_by_rehashing_the_artifacts(toy_run, tmp_path, capsys):
    """Issue 29: ``--verify`` re-hashes every subject of an exported statement (and the manifest byproduct)
    against the run dir. It holds right after the export; one artifact modified afterwards is refused naming that
    file and both digests (and no other file); a digest edited in the statement is refused naming that subject
    and the statement's own sha256 against its export.json; a missing file and a subject outside the run dir are
    refused too."""
    import hashlib
    import shutil

    from runner.tools.export import main

    d = tmp_path / "copy"
    shutil.copytree(toy_run, d)
    att = tmp_path / "att"
    assert main([str(d), "--format", "in-toto", "--out", str(att)]) == 0
    st = json.loads((att / "statement.intoto.json").read_text())
    names = [s["name"] for s in st["subject"]]
    capsys.readouterr()
    assert main([str(d), "--verify", str(att)]) == 0
    assert f"verified: {len(names) + 1} files" in capsys.readouterr().out  # the subjects and manifest.json

    # one artifact modified after the export, through the real command line: refused, naming it and both digests
    item = _lines(d / "items.jsonl")[1]
    f = d / item["file"]
    original = f.read_bytes()
    _flip(f)
    p = _export([d, "--verify", att / "statement.intoto.json"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert "StatementMismatchError" in p.stderr and "fix:" in p.stderr
    assert f"{item['file']}: sha256 {hashlib.sha256(f.read_bytes()).hexdigest()} differs from the statement's " \
           f"{item['file_sha256']}" in p.stderr, p.stderr
    assert not [n for n in names if n != item["file"] and f"{n}: " in p.stderr], p.stderr
    f.write_bytes(original)
    assert main([str(d), "--verify", str(att)]) == 0
    manifest = (d / "manifest.json").read_bytes()  # the byproduct is re-hashed too
    (d / "manifest.json").write_bytes(manifest + b"\n")
    capsys.readouterr()
    assert main([str(d), "--verify", str(att)]) == 2
    assert "manifest.json: sha256" in capsys.readouterr().err
    (d / "manifest.json").write_bytes(manifest)

    # a digest edited in the statement: the subject and the statement's own record both disagree
    other = _lines(d / "items.jsonl")[0]["file"]
    forged = json.loads((att / "statement.intoto.json").read_text())
    for s in forged["subject"]:
        if s["name"] == other:
            s["digest"]["sha256"] = hashlib.sha256(b"forged").hexdigest()
    (att / "statement.intoto.json").write_text(json.dumps(forged))
    capsys.readouterr()
    assert main([str(d), "--verify", str(att)]) == 2
    err = capsys.readouterr().err
    assert "statement.intoto.json: sha256" in err and "modified after the export" in err
    assert f"{other}: sha256 {hashlib.sha256((d / other).read_bytes()).hexdigest()} differs" in err, err
    alone = tmp_path / "alone.intoto.json"  # without its export.json: the re-hash alone refuses it
    alone.write_text(json.dumps(forged))
    assert main([str(d), "--verify", str(alone)]) == 2
    err = capsys.readouterr().err
    assert f"{other}: sha256" in err and "modified after the export" not in err

    # a missing artifact, and a subject that points outside the run dir
    (d / item["file"]).unlink()
    assert main([str(d), "--verify", str(att / "statement.intoto.json")]) == 2
    assert f"{item['file']}: missing from {d}" in capsys.readouterr().err
    shutil.copy(toy_run / item["file"], d / item["file"])
    outside = json.loads((att / "statement.intoto.json").read_text())
    outside["subject"] = [{"name": "../copy/manifest.json",
                           "digest": {"sha256": hashlib.sha256((d / "manifest.json").read_bytes()).hexdigest()}}]
    alone.write_text(json.dumps(outside))
    assert main([str(d), "--verify", str(alone)]) == 2
    assert "'../copy/manifest.json': not a file name inside the run dir" in capsys.readouterr().err
    assert main([str(d), "--verify", str(tmp_path / "nope.json")]) == 2
    assert "no in-toto statement there" in capsys.readouterr().err


def test_png_whose_size_differs_from_its_record_fails_and_is_not_written(tmp_path):
    """Issue 29 (a record that disagrees with its artifact), the PNG sink: the size read back from the encoded PNG
    must equal the record's ``params.width``/``height``; a mismatch fails the item naming both values and writes
    no file, on the writer threads as inline; a matching image and a record without a size are written."""
    from models.base import ImageOutput
    from runner.core.sinks import ImageSink, read_journal

    img = np.full((32, 48, 3), 0.5, np.float32)  # height 32, width 48
    for workers in (0, 2):
        d = tmp_path / f"w{workers}"
        sink = ImageSink(d, workers=workers)
        sink.submit({"key": "ok", "params": {"width": 48, "height": 32}}, ImageOutput(img))
        sink.submit({"key": "tall", "params": {"width": 48, "height": 64}}, ImageOutput(img))
        sink.submit({"key": "both", "params": {"width": 32, "height": 48}}, ImageOutput(img))
        sink.submit({"key": "unsized", "params": {}}, ImageOutput(img))
        sink.close()
        by = {r["key"]: r for r in read_journal(d / "items.jsonl")}
        assert by["ok"]["status"] == by["unsized"]["status"] == "ok"
        assert by["tall"]["status"] == "failed" and by["tall"]["file"] is None
        assert "ArtifactMismatchError" in by["tall"]["reason"]
        assert "height: record 64, artifact 32" in by["tall"]["reason"]
        assert "width" not in by["tall"]["reason"]
        assert "width: record 32, artifact 48" in by["both"]["reason"]
        assert "height: record 48, artifact 32" in by["both"]["reason"]
        assert sorted(p.name for p in (d / "images").iterdir()) == ["ok.png", "unsized.png"]
        assert sink.counts == {"ok": 2, "failed": 2}


def test_video_export_is_typed_with_datasets_video_feature(compose, tmp_path):
    """A video run's parquet export carries ``datasets.Video`` (not an untyped struct); its bytes read back
    without torchcodec through ``Video(decode=False)`` and equal the run's MP4."""
    datasets = import_extra("export", "datasets")
    from runner.app.execute import run

    d = tmp_path / "run"
    ov = ["platform=cpu", "model=toy_motion", "dataset.limit=1"]
    assert run(compose(ov), d, ov) == 0
    p = _export([d, "--format", "parquet", "--out", tmp_path / "pq"])
    assert p.returncode == 0, p.stderr
    files = json.loads((tmp_path / "pq" / "export.json").read_text())["files"]
    ds = datasets.load_dataset("parquet", data_files=[str(tmp_path / "pq" / f) for f in files], split="train")
    assert isinstance(ds.features["video"], datasets.Video)
    row = ds.cast_column("video", datasets.Video(decode=False))[0]
    rec = next(json.loads(x) for x in (d / "items.jsonl").read_text().splitlines() if '"ok"' in x)
    assert row["video"]["bytes"] == (d / rec["file"]).read_bytes()
