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

TOY = ["model=toy_shapes"]


def _lines(p: Path):
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def _load_imagefolder(run_dir: Path, cache: Path):
    datasets = pytest.importorskip("datasets")
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
        assert json.loads(text["parameters"]) == it["params"] and text["key"] == it["key"]
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

