"""Inputs people already have (issue #20): GenEval-style JSONL (``tag``, ``include`` beside ``prompt``), a CSV with
a ``Prompt`` header (PartiPrompts), parquet files and local Hugging Face datasets, read through a documented column
mapping (``dataset.columns``) and ``dataset.extra_fields=keep`` (extra fields recorded under ``meta``). A typo of a
row field is still refused, in either mode, naming the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.core.dataset import DatasetError, load_rows
from _helpers import import_extra  # noqa: E402

TOY = ["model=toy_shapes"]
DEFAULTS = dict(width=64, height=64, num_inference_steps=2, guidance_scale=None, num_images_per_prompt=1)
GENEVAL = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
     "prompt": "a photo of a cat and a dog"},
]


def _load(fmt, path, **kw):
    return load_rows(fmt, str(path), defaults=DEFAULTS, size_multiple=8, max_pixels=1 << 20, **kw)[0]


def test_geneval_jsonl_is_refused_by_default_and_kept_under_meta_with_keep(write_jsonl):
    p = write_jsonl(GENEVAL, "geneval.jsonl")
    with pytest.raises(DatasetError) as e:
        _load("jsonl", p)
    msg = str(e.value)
    assert "unknown field 'tag'" in msg and "dataset.extra_fields=keep" in msg and "geneval.jsonl:1" in msg
    rows = _load("jsonl", p, extra_fields="keep")
    assert [r.meta for r in rows] == [{k: v for k, v in g.items() if k != "prompt"} for g in GENEVAL]
    assert rows[1].prompt == "a photo of a cat and a dog"


@pytest.mark.parametrize("typo,field", [("promt", "prompt"), ("Prompt", "prompt"), ("seeds", "seed"),
                                        ("negative_promt", "negative_prompt"), ("widht", "width")])
def test_a_typo_of_a_row_field_is_refused_even_with_keep(write_jsonl, typo, field):
    p = write_jsonl([{"prompt": "a cat", typo: "x", "tag": "kept"}])
    for mode in ("error", "keep"):
        with pytest.raises(DatasetError) as e:
            _load("jsonl", p, extra_fields=mode)
        msg = str(e.value)
        assert f"unknown field {typo!r}" in msg and f"did you mean {field!r}" in msg, msg
        assert f"dataset.columns={{{field}: {typo}}}" in msg


def test_csv_with_a_prompt_header_needs_the_mapping_and_names_it(tmp_path):
    p = tmp_path / "parti.csv"
    p.write_text("Prompt,Category,Challenge\n\"a red fox, asleep\",Animals,Basic\na blue cube,Artifacts,Colors\n")
    with pytest.raises(DatasetError) as e:
        _load("csv", p)
    assert "no 'prompt' column" in str(e.value) and "dataset.columns={prompt: Prompt}" in str(e.value)
    with pytest.raises(DatasetError) as e:  # mapped, but the other columns are extra
        _load("csv", p, columns={"prompt": "Prompt"})
    assert "unknown field 'Category'" in str(e.value)
    rows = _load("csv", p, columns={"prompt": "Prompt"}, extra_fields="keep")
    assert [(r.prompt, r.meta) for r in rows] == [("a red fox, asleep", {"Category": "Animals", "Challenge": "Basic"}),
                                                  ("a blue cube", {"Category": "Artifacts", "Challenge": "Colors"})]


def test_bad_mappings_are_named(tmp_path, write_jsonl):
    p = write_jsonl([{"text": "a cat"}])
    with pytest.raises(DatasetError, match=r"dataset.columns.promt: 'promt' is not a row field; fix: did you mean "
                                           r"'prompt'"):
        _load("jsonl", p, columns={"promt": "text"})
    with pytest.raises(DatasetError, match=r"dataset.columns.prompt='caption': no row .* has a column 'caption'; "
                                           r"columns: text"):
        _load("jsonl", p, columns={"prompt": "caption"})
    from runner.core.dataset import columns_option

    with pytest.raises(DatasetError, match="is not a mapping"):
        columns_option(["prompt"])
    assert columns_option({"prompt": "Prompt", "id": 3}) == {"prompt": "Prompt", "id": "3"} and columns_option(None) == {}
    q = write_jsonl([{"text": "a cat", "prompt": "a dog"}], "both.jsonl")
    with pytest.raises(DatasetError, match="both 'prompt' and 'text'"):
        _load("jsonl", q, columns={"prompt": "text"})


def test_parquet_rows(tmp_path):
    pa = import_extra("export", "pyarrow")
    pq = import_extra("export", "pyarrow.parquet")
    p = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "caption": ["a cat", "a dog"], "seed": [7, None],
                             "source": ["coco", "coco"]}), p)
    rows = _load("parquet", p, columns={"prompt": "caption"}, extra_fields="keep")
    assert [(r.id, r.prompt, r.seed, r.meta, r.line) for r in rows] == [
        ("a", "a cat", 7, {"source": "coco"}, 1), ("b", "a dog", None, {"source": "coco"}, 2)]
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable parquet file"):
        _load("parquet", bad)


def test_hf_save_to_disk_dir_split_and_data_file(tmp_path, write_jsonl):
    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    d = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"caption": "a cat", "tag": "animal"}]),
        "test": datasets.Dataset.from_list([{"caption": "a red car", "tag": "color"},
                                            {"caption": "a blue car", "tag": "color"}])})
    d.save_to_disk(str(tmp_path / "saved"))
    kw = dict(columns={"prompt": "caption"}, extra_fields="keep")
    assert [r.prompt for r in _load("hf", tmp_path / "saved", **kw)] == ["a cat"]  # train by default
    rows = _load("hf", tmp_path / "saved", split="test", **kw)
    assert [(r.prompt, r.meta) for r in rows] == [("a red car", {"tag": "color"}), ("a blue car", {"tag": "color"})]
    with pytest.raises(DatasetError, match=r"dataset.split='valid': .* holds the splits train, test; fix: "
                                           r"dataset.split=train"):
        _load("hf", tmp_path / "saved", split="valid", **kw)
    datasets.Dataset.from_list([{"prompt": "a fox", "seed": 3}]).save_to_disk(str(tmp_path / "one"))
    assert [(r.prompt, r.seed) for r in _load("hf", tmp_path / "one")] == [("a fox", 3)]
    f = write_jsonl([{"prompt": "a owl"}], "hf.jsonl")
    assert [r.prompt for r in _load("hf", f)] == ["a owl"]
    with pytest.raises(DatasetError, match="is not a file or dir"):
        _load("hf", tmp_path / "missing")


def test_geneval_run_records_meta_in_items_index_and_datasets(execute, write_jsonl, tmp_path):
    p = write_jsonl(GENEVAL, "geneval.jsonl")
    r = execute([*TOY, "dataset=jsonl", f"dataset.path={p}", "dataset.extra_fields=keep"], tmp_path / "run")
    assert r.code == 0
    assert [it["meta"] for it in r.items] == [{k: v for k, v in g.items() if k != "prompt"} for g in GENEVAL]
    index = [json.loads(x) for x in (r.run_dir / "images" / "metadata.jsonl").read_text().splitlines()]
    assert [m["meta"]["tag"] for m in index] == ["single_object", "two_object"]
    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("imagefolder", data_dir=str(r.run_dir / "images"), cache_dir=str(tmp_path / "hf"))
    assert sorted(row["meta"]["tag"] for row in ds["train"]) == ["single_object", "two_object"]
    # meta is recorded, not an input: a run without it writes the same bytes
    q = write_jsonl([{"prompt": g["prompt"]} for g in GENEVAL], "plain.jsonl")
    plain = execute([*TOY, "dataset=jsonl", f"dataset.path={q}"], tmp_path / "plain")
    assert plain.code == 0 and plain.pngs() == r.pngs()
    assert [it["inputs_sha256"] for it in plain.items] == [it["inputs_sha256"] for it in r.items]


def test_csv_and_hf_runs_from_the_command_line_mapping(execute, tmp_path):
    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    p = tmp_path / "parti.csv"
    p.write_text("Prompt,Category\na red circle,Shapes\n")
    r = execute([*TOY, "dataset=csv", f"dataset.path={p}", "dataset.columns={prompt: Prompt}",
                 "dataset.extra_fields=keep"], tmp_path / "csv")
    assert r.code == 0 and r.items[0]["meta"] == {"Category": "Shapes"} and r.items[0]["prompt"] == "a red circle"
    datasets.Dataset.from_list([{"id": "x", "text": "a blue square"}]).save_to_disk(str(tmp_path / "saved"))
    r = execute([*TOY, "dataset=hf", f"dataset.path={tmp_path / 'saved'}", "dataset.columns={prompt: text}"],
                tmp_path / "hf")
    assert r.code == 0 and [it["key"] for it in r.items] == ["x"]
    assert r.manifest["dataset"]["format"] == "hf" and len(r.manifest["dataset"]["sha256"]) == 64


def test_ar_rows_take_the_same_mapping_and_extra_fields(compose, write_jsonl):
    from models.vllm.rows import load_rows as ar_rows

    p = write_jsonl([{"id": "a", "question": "what is 2+2?", "tag": "math"}])
    cfg = compose(["model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={p}", "dataset.columns={prompt: question}",
                   "dataset.extra_fields=keep"])
    (row,), _ = ar_rows(cfg, {}, None, 256, cfg.model)
    assert (row.prompt, row.meta) == ("what is 2+2?", {"tag": "math"})
    q = write_jsonl([{"prompt": "hi", "max_token": 4}], "typo.jsonl")
    cfg = compose(["model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={q}", "dataset.extra_fields=keep"])
    with pytest.raises(DatasetError, match="unknown field 'max_token'; fix: did you mean 'max_tokens'"):
        ar_rows(cfg, {}, None, 256, cfg.model)


def test_keep_keeps_metadata_columns_near_a_row_field_and_refuses_typos(compose, write_jsonl):
    """New-user report: under dataset.extra_fields=keep a GenEval-style row's ``color``, ``text`` and ``image_id``
    were refused as 'did you mean lora / expect / image' with a mapping that would have fed the colour into the LoRA
    field. Under keep only a typo-near field (ratio >= 0.8) is refused; under error the near name stays a hint."""
    import runner.core.dataset as ds

    meta = {}
    for key in ("color", "colour", "text", "image_id"):
        assert ds.extra_field(key, "x", ds.IMAGE_ROW.by_name, "keep", "f:1", meta) is None, key
    assert meta == {"color": "x", "colour": "x", "text": "x", "image_id": "x"}
    for key, near in (("promt", "prompt"), ("Prompt", "prompt"), ("seeds", "seed"), ("widht", "width")):
        why = ds.extra_field(key, "x", ds.IMAGE_ROW.by_name, "keep", "f:1", {})
        assert why is not None and f"did you mean {near!r}" in why, (key, why)
    why = ds.extra_field("color", "x", ds.IMAGE_ROW.by_name, "error", "f:1", {})
    assert why is not None and "unknown field 'color'" in why


def test_a_value_shown_in_a_problem_is_abbreviated():
    """``runner.core.media.shown``, the one formatter of row values echoed in dataset problems: bytes by kind and
    size, long strings cut and counted, containers item by item, anything short as its repr."""
    from runner.core.media import SHOWN_CHARS, shown

    assert shown(b"\x89PNG\r\n\x1a\n" + bytes(5313)) == "<PNG bytes, 5,321 B>"
    assert shown(b"\xff\xd8\xff\xe0" + bytes(100)) == "<JPEG bytes, 104 B>"
    assert shown(bytearray(3)) == "<bytes, 3 B>"
    assert shown({"bytes": b"\x89PNG\r\n\x1a\n", "path": "a.png"}) == "{'bytes': <PNG bytes, 8 B>, 'path': 'a.png'}"
    assert shown(["a.png", None, 7]) == "['a.png', None, 7]" and shown("a cat") == "'a cat'" and shown(1.5) == "1.5"
    long = "x" * 10_000
    assert shown(long) == repr(long)[:SHOWN_CHARS] + "... (10,000 characters)"
    assert len(shown(list(range(1000)))) < SHOWN_CHARS


def test_image_cells_of_a_parquet_export_are_not_dumped_in_problems(tmp_path):
    """A Parquet file in the runner's export layout (an ``image`` struct of PNG bytes and a path, as
    ``runner.export --format parquet`` writes it): every problem naming a row value shows ``<PNG bytes, N B>``, not
    the escaped bytes (was ~5.5 KB per image problem)."""
    import numpy as np

    from runner.core.artifacts import encode_png
    from runner.core.dataset import DIFFUSION_ROW

    pa = import_extra("export", "pyarrow")
    pq = import_extra("export", "pyarrow.parquet")
    png = encode_png(np.random.default_rng(0).random((64, 64, 3)))
    p = tmp_path / "export.parquet"
    pq.write_table(pa.table({"prompt": ["a cat", "a dog"],
                             "image": [{"bytes": png, "path": "a.png"}, {"bytes": png, "path": None}],
                             "seed": [png, None]}), p)
    with pytest.raises(DatasetError) as e:
        _load("parquet", p, spec=DIFFUSION_ROW, context={"task": "text_to_image"})
    msg = str(e.value)
    size = f"<PNG bytes, {len(png):,} B>"
    assert f"field 'image' = {{'bytes': {size}, 'path': 'a.png'}} is not taken by model.task=text_to_image" in msg
    assert f"field 'seed' = {size} is not an integer" in msg
    assert "\\x" not in msg and len(msg) < 2000, msg[:3000]
