"""``runner.core.dataset`` rule by rule (issue #42, mutation tests): the readers' refusals (a missing package, a file
that is not parquet, a dir ``datasets`` cannot read, a split to pick, a CSV header without the prompt column) word
file, value and fix; the prompt summary counts; a media field's identity; the strength and LoRA scale bounds.
Expectations are computed by hand, files are written with the packages the readers read them with.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from runner.core import dataset as ds
from runner.core.dataset import DatasetError
from runner.core.errors import EXTRAS
from runner.core.media import InputFile
from _helpers import import_extra  # noqa: E402

pytestmark = pytest.mark.cpu

DEFAULTS = {"width": 64, "height": 48, "num_inference_steps": 4, "guidance_scale": 3.5, "num_images_per_prompt": 1,
            "negative_prompt": None}


def load(path: Path, fmt: str, **kw: Any):
    return ds.load_rows(fmt, str(path), defaults=DEFAULTS, size_multiple=16, max_pixels=1 << 20, **kw)[0]


def problems(path: Path, fmt: str, **kw: Any) -> List[str]:
    with pytest.raises(DatasetError) as e:
        load(path, fmt, **kw)
    return e.value.problems


# ------------------------------------------------------------------------------------------------ missing packages


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(DatasetError) as e:
        ds.read_parquet(tmp_path / "rows.parquet")
    assert e.value.problems == [
        "dataset.format=parquet needs pyarrow, which is not installed; fix: "
        f'pip install -e ".[export]"  ({EXTRAS["export"]}; or pip install pyarrow)']


def test_hf_without_datasets_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DatasetError) as e:
        ds.read_hf(tmp_path / "saved")
    assert e.value.problems == [
        "dataset.format=hf needs the datasets package, which is not installed; fix: "
        f'pip install -e ".[export]"  ({EXTRAS["export"]}; or pip install datasets)']


# ------------------------------------------------------------------------------------------------ parquet


def test_a_file_that_is_not_parquet_is_named_with_pyarrows_error(tmp_path):
    pq = import_extra("export", "pyarrow.parquet")
    bad = tmp_path / "rows.parquet"
    bad.write_text("id,prompt\n")
    try:
        pq.read_table(bad)
    except Exception as e:  # noqa: BLE001 - what pyarrow says of this file, named in the refusal
        said = f"{type(e).__name__}: {e}"
    assert said.startswith("ArrowInvalid: ")
    assert problems(bad, "parquet") == [
        f"{bad}: not a readable parquet file ({said}); fix: pass a .parquet file (pyarrow.parquet.write_table, "
        "pandas.DataFrame.to_parquet, Dataset.to_parquet)"]


# ------------------------------------------------------------------------------------------------ hf


def test_hf_reads_the_only_split_of_a_dict_without_train(tmp_path):
    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"prompt": "a fox"}, {"prompt": "a owl"}])}
                         ).save_to_disk(str(tmp_path / "one"))
    assert [(r.prompt, r.line) for r in load(tmp_path / "one", "hf")] == [("a fox", 1), ("a owl", 2)]


def test_hf_dict_of_two_splits_without_train_needs_the_split(tmp_path):
    datasets = import_extra("export", "datasets")
    datasets.disable_progress_bars()
    d = tmp_path / "two"
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"prompt": "a fox"}]),
                          "valid": datasets.Dataset.from_list([{"prompt": "a owl"}])}).save_to_disk(str(d))
    assert problems(d, "hf") == [f"{d} holds the splits test, valid and none is 'train'; fix: dataset.split=test"]
    assert [r.prompt for r in load(d, "hf", split="valid")] == ["a owl"]


def test_hf_data_file_of_another_extension_is_refused_naming_the_extensions(tmp_path):
    import_extra("export", "datasets")
    xml = tmp_path / "rows.xml"
    xml.write_text("<rows/>")
    bare = tmp_path / "rows"
    bare.write_text("a fox\n")
    known = ".jsonl, .json, .csv, .parquet, .txt"
    assert problems(xml, "hf") == [f"dataset.path={str(xml)!r}: dataset=hf reads a dir written by save_to_disk or a "
                                   f"data file ({known}), not .xml; fix: pass such a dir or file"]
    assert problems(bare, "hf") == [f"dataset.path={str(bare)!r}: dataset=hf reads a dir written by save_to_disk or "
                                    f"a data file ({known}), not a file without extension; fix: pass such a dir or "
                                    "file"]


def test_hf_dir_that_datasets_cannot_read_is_named_with_its_error(tmp_path):
    import_extra("export", "datasets")
    d = tmp_path / "notsaved"
    d.mkdir()
    (d / "rows.jsonl").write_text('{"prompt": "a fox"}\n')
    (msg,) = problems(d, "hf")
    assert msg.startswith(f"dataset.path={str(d)!r}: datasets cannot read it (FileNotFoundError: ")
    assert msg.endswith("); fix: a dir written by Dataset.save_to_disk / DatasetDict.save_to_disk, or a data file "
                        "(.jsonl, .json, .csv, .parquet, .txt)")


def test_hf_data_file_writes_nothing_to_the_users_datasets_cache(tmp_path, monkeypatch):
    datasets = import_extra("export", "datasets")
    home_cache = tmp_path / "hf-home-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home_cache)
    f = tmp_path / "rows.jsonl"
    f.write_text('{"prompt": "a fox", "seed": 3}\n')
    assert [(r.prompt, r.seed) for r in load(f, "hf")] == [("a fox", 3)]
    assert not home_cache.exists() or not any(home_cache.iterdir())


# ------------------------------------------------------------------------------------------------ csv


@pytest.mark.parametrize("header,columns,fix", [
    ("id,prompts", None, "dataset.columns={prompt: prompts} to read the prompt from 'prompts'"),  # close
    ("id,PROMPT", None, "dataset.columns={prompt: PROMPT} to read the prompt from 'PROMPT'"),  # same but for case
    ("id,text", None, "name the prompt column (dataset.columns={prompt: <column>})"),  # nothing close
    ("id,caption", {"prompt": "Caption"},  # a mapped column: the close header is named too
     "dataset.columns={prompt: caption} to read the prompt from 'caption'"),
    ("id,text", {"prompt": "Caption"}, "name the prompt column (dataset.columns={prompt: <column>})"),
])
def test_csv_header_without_the_prompt_column_names_the_close_one(tmp_path, header, columns, fix):
    p = tmp_path / "rows.csv"
    p.write_text(f"{header}\na,a fox\n")
    names = header.split(",")
    source = (columns or {}).get("prompt", "prompt")
    assert problems(p, "csv", columns=columns) == [f"{p}:1: CSV header {names!r} has no {source!r} column; fix: {fix}"]


def test_csv_without_a_header_asks_for_one(tmp_path):
    p = tmp_path / "rows.csv"
    p.write_text("")
    assert problems(p, "csv") == [f"{p}:1: CSV header None has no 'prompt' column; fix: add a header line naming the "
                                  "columns, e.g. id,prompt"]


def test_csv_empty_prompt_cell_is_read_as_an_empty_prompt(tmp_path):
    p = tmp_path / "rows.csv"
    p.write_text("id,prompt,seed\na,,3\nb,a fox,\n")
    assert ds.read_csv(p) == [(2, {"id": "a", "seed": "3", "prompt": ""}), (3, {"id": "b", "prompt": "a fox"})]  # empty cells left out, but the prompt


def test_csv_rows_past_a_bad_line_are_checked_too(tmp_path):
    p = tmp_path / "rows.csv"
    p.write_text("prompt,seed\na fox,1,extra\na owl,x\n")
    got = problems(p, "csv")
    assert len(got) == 2, got
    assert got[0] == (f"{p}:2: row has more cells than the header has columns (3 cells, 2 columns); fix: quote prompts "
                      "that contain commas")
    assert got[1].startswith(f"{p}:3: ") and "'seed'" in got[1] and "'x'" in got[1]  # the bad seed of line 3


# ------------------------------------------------------------------------------------------------ prompt summary


RECORDS = [
    {"status": "ok", "tokens": {"clip": {"dropped": 3}, "t5": {"dropped": 0}}},
    {"status": "ok", "tokens": {"clip": {"dropped": 0}, "t5": {"dropped": 5}}, "ignored": {"lora": "x"}},
    {"status": "ok", "tokens": {"clip": {"dropped": 0}}},
    {"status": "ok"},
    {"status": "failed", "tokens": {"clip": {"dropped": 9}}, "ignored": {"a": 1}},
]


def test_prompts_summary_counts_ok_items_truncated_by_encoder_and_ignored():
    assert ds.prompts_summary(RECORDS) == {"items": 4, "truncated_items": 2,
                                          "truncated_by_encoder": {"clip": 1, "t5": 1},
                                          "items_with_ignored_fields": 1}
    assert ds.prompts_summary([]) == {"items": 0, "truncated_items": 0, "truncated_by_encoder": {},
                                      "items_with_ignored_fields": 0}


def test_prompts_add_then_take_away_gives_back_the_summary():
    s = ds.prompts_summary(RECORDS[:1])
    ds.prompts_add(s, RECORDS[1])  # sign 1 by default
    assert s == ds.prompts_summary(RECORDS[:2])
    ds.prompts_add(s, RECORDS[1], -1)
    assert s == ds.prompts_summary(RECORDS[:1]) == {"items": 1, "truncated_items": 1,
                                                    "truncated_by_encoder": {"clip": 1, "t5": 0},
                                                    "items_with_ignored_fields": 0}


# ------------------------------------------------------------------------------------------------ media identity


def _input(field: str, sha: str, mode: str = "RGB") -> InputFile:
    return InputFile(field=field, given=f"{sha}.png", path=f"/data/{sha}.png", sha256=sha * 64, width=8, height=8,
                     mode=mode, input_mode=mode)


def test_media_identity_of_checked_inputs_is_their_digest():
    a, b = _input("image[0]", "a"), _input("image[1]", "b", "L")
    assert ds.media_identity(a, "a.png") == {"sha256": "a" * 64, "input_mode": "RGB"}
    assert ds.media_identity([a, b], ["a.png", "b.png"]) == [{"sha256": "a" * 64, "input_mode": "RGB"},
                                                            {"sha256": "b" * 64, "input_mode": "L"}]


def test_media_identity_of_an_unchecked_value():
    cell = {"bytes": b"\x89PNG-bytes", "path": "x.png"}
    assert ds.media_identity(None, cell) == {"sha256": hashlib.sha256(b"\x89PNG-bytes").hexdigest(), "path": "x.png"}
    assert ds.media_identity(None, {"bytes": None}) == {"sha256": hashlib.sha256(b"").hexdigest(), "path": None}
    assert ds.media_identity(None, "a.png") == "a.png"


# ------------------------------------------------------------------------------------------------ bounds


STRENGTH_FIX = "must be in (0, 1]; fix: e.g. 0.6 (diffusers' default for FLUX img2img), 1.0 repaints fully"


@pytest.mark.parametrize("v,said", [(None, None), (0.5, None), (1.0, None), (1e-6, None), (0.0, STRENGTH_FIX),
                                    (1.0001, STRENGTH_FIX), (1.5, STRENGTH_FIX), (-0.5, STRENGTH_FIX),
                                    (float("nan"), STRENGTH_FIX), (float("inf"), STRENGTH_FIX)])
def test_strength_is_in_0_exclusive_1_inclusive(v, said):
    assert ds.check_strength(v, {}) == said


@pytest.mark.parametrize("v,said", [(None, None), (0.0, None), (-2.0, None), (1.5, None),
                                    (float("nan"), "must be a finite number; fix: e.g. 1.0"),
                                    (float("-inf"), "must be a finite number; fix: e.g. 1.0")])
def test_lora_scale_is_any_finite_number(v, said):
    assert ds.check_lora_scale(v, {}) == said


def test_mask_and_last_image_take_one_path_not_a_list():
    assert ds.parse_image("m.png", True) == "m.png"
    assert ds.parse_image("m.png", False) == "m.png"
    with pytest.raises(ValueError):
        ds.parse_image('["a.png", "b.png"]', True)  # a CSV cell's JSON list: a list, refused
    assert ds.parse_image('["a.png"]', False) == '["a.png"]'  # a JSON row's string is a path as given


# ------------------------------------------------------------------------------------------------ task inputs

IMAGE_USERS = "image_to_image, inpaint, edit, image_to_video"


def test_a_conditioning_field_the_default_task_does_not_take_is_refused_naming_the_tasks():
    assert ds.check_task_inputs("rows.jsonl:1", {"image": "a.png"}, {}, {}, False) == [
        "rows.jsonl:1: field 'image' = 'a.png' is not taken by model.task=text_to_image (the pipeline would never see "
        f"it); fix: remove it from the row, or model.task=image_to_image (tasks that take image: {IMAGE_USERS})"]
    assert ds.check_task_inputs("rows.jsonl:1", {"image": "a.png"}, {}, {"task": "edit"}, False) == []


def test_the_familys_own_tasks_are_named_first():
    got = ds.check_task_inputs("r:2", {"image": "a.png"}, {}, {"task": "text_to_image",
                                                                "tasks": ["edit", "image_to_video"]}, False)
    assert got == ["r:2: field 'image' = 'a.png' is not taken by model.task=text_to_image (the pipeline would never "
                   "see it); fix: remove it from the row, or model.task=edit (tasks that take image: edit, "
                   "image_to_video, image_to_image, inpaint)"]


def test_a_spec_without_conditioning_fields_checks_none():
    assert ds.check_task_inputs("r:1", {"image": "a.png"}, {}, {"spec": ds.VIDEO_ROW}, False) == []


def test_a_required_input_of_the_task_must_be_set_an_optional_one_need_not():
    assert ds.check_task_inputs("r:1", {"image": "a.png"}, {}, {"task": "inpaint"}, False) == [
        "r:1: field 'mask_image' is missing, and model.task=inpaint needs it; fix: give every row 'mask_image' (a "
        "path relative to the dataset file's folder or dataset.media_root)"]
    assert ds.check_task_inputs("r:1", {"image": "a.png"}, {}, {"task": "image_to_video"}, False) == []  # last_image
    assert ds.task_inputs(ds.DIFFUSION_ROW)["inpaint"] == {"image": True, "mask_image": True, "strength": False}


def test_a_list_of_references_needs_a_multi_reference_family():
    two = {"image": ["a.png", "b.png"]}
    assert ds.check_task_inputs("r:1", two, {}, {"task": "edit"}, False) == [
        "r:1: field 'image' is a list of 2 paths, and model.task=edit of this family takes one image; fix: one path "
        "per row (a family with multi-reference edit: model.engine=qwen_image)"]
    assert ds.check_task_inputs("r:1", two, {}, {"task": "edit", "multi_image": True}, False) == []
    assert ds.check_task_inputs("r:1", {"image": "a.png"}, {}, {"task": "edit"}, False) == []
    assert ds.check_task_inputs("r:1", {}, {}, {"task": "text_to_image"}, False) == []
    # a task that takes no image: only the field is refused, not the list
    (only,) = ds.check_task_inputs("r:1", two, {}, {"task": "text_to_image"}, False)
    assert "is not taken by model.task=text_to_image" in only


# ------------------------------------------------------------------------------------------------ builtin path


@pytest.mark.parametrize("given,guess", [("rows.csv", "csv"), ("rows.CSV", "csv"), ("rows.builtin", "jsonl"),
                                         ("rows.xml", "jsonl"), ("rows.XCSV", "jsonl")])
def test_a_path_beside_builtin_is_refused_guessing_the_format(given, guess):
    with pytest.raises(DatasetError) as e:
        ds.source_path("builtin", given, "prompts.jsonl")
    assert e.value.problems == [f"dataset.path={given!r} is not read by dataset=builtin (the model's builtin "
                                f"prompts); fix: dataset={guess} dataset.path={given}"]


# ------------------------------------------------------------------------------------------------ row identity and batching


def _row(**kw: Any) -> ds.Row:
    base = dict(id="a", prompt="p", negative_prompt=None, seed=None, width=64, height=48, num_inference_steps=4,
                guidance_scale=3.5, num_images_per_prompt=1, line=1, spec=ds.DIFFUSION_ROW)
    return ds.Row(**{**base, **kw})


def _sized(field: str, sha: str, w: int, h: int) -> InputFile:
    return InputFile(field=field, given=f"{sha}.png", path=None, sha256=sha * 64, width=w, height=h, mode="RGB",
                     input_mode="RGB")


def test_a_text_rows_identity_and_batch_key():
    r = _row()
    assert ds.DIFFUSION_ROW.identity(r) == {"prompt": "p", "negative_prompt": None, "seed": None, "width": 64,
                                            "height": 48, "num_inference_steps": 4, "guidance_scale": 3.5}
    # batch fields in spec order: negative_prompt (set or not), width, height, steps, guidance, num_frames, strength,
    # the lora set
    assert ds.DIFFUSION_ROW.shape_key(r) == (False, 64, 48, 4, 3.5, None, None, None)
    # two negative prompts batch together (one part: set), a width does not
    assert ds.DIFFUSION_ROW.shape_key(_row(negative_prompt="blurry")) == \
        ds.DIFFUSION_ROW.shape_key(_row(negative_prompt="dark")) == (True, 64, 48, 4, 3.5, None, None, None)


def test_a_conditioned_rows_identity_is_its_inputs_digests_not_their_paths():
    img, mask = _sized("image", "a", 8, 6), _sized("mask_image", "b", 8, 6)
    lora = [{"name": "style", "sha256": "c" * 64, "scale": 0.8}]
    r = _row(values={"image": "in/a.png", "mask_image": "in/m.png", "strength": 0.6, "lora": lora},
             inputs={"image": img, "mask_image": mask})
    assert ds.DIFFUSION_ROW.identity(r) == {
        "prompt": "p", "negative_prompt": None, "seed": None, "width": 64, "height": 48, "num_inference_steps": 4,
        "guidance_scale": 3.5, "image": {"sha256": "a" * 64, "input_mode": "RGB"},
        "mask_image": {"sha256": "b" * 64, "input_mode": "RGB"}, "strength": 0.6,
        "lora": [{"sha256": "c" * 64, "scale": 0.8}]}
    assert ds.DIFFUSION_ROW.shape_key(r) == (False, 64, 48, 4, 3.5, None, 0.6, (("style", 0.8),),
                                             (("image", ((8, 6),)), ("mask_image", ((8, 6),))))
    # unchecked (no inputs yet): the value as given
    r = _row(values={"image": "in/a.png"})
    assert ds.DIFFUSION_ROW.identity(r)["image"] == "in/a.png"
    assert ds.DIFFUSION_ROW.shape_key(r) == (False, 64, 48, 4, 3.5, None, None, None)


def test_a_row_with_a_list_of_references_is_a_batch_of_its_own():
    refs = [_sized("image[0]", "a", 8, 6), _sized("image[1]", "b", 4, 4)]
    r = _row(id="edit1", width=32, values={"image": ["a.png", "b.png"]}, inputs={"image": refs})
    assert ds.DIFFUSION_ROW.shape_key(r) == (False, 32, 48, 4, 3.5, None, None, None,
                                             (("image", ((8, 6), (4, 4))),), "edit1")
    assert ds.DIFFUSION_ROW.identity(r)["image"] == [{"sha256": "a" * 64, "input_mode": "RGB"},
                                                     {"sha256": "b" * 64, "input_mode": "RGB"}]


def test_a_spec_field_without_a_value_reads_none_another_name_raises():
    r = _row()
    assert (r.strength, r.lora, r.image) == (None, None, None)
    assert _row(values={"strength": 0.5}).strength == 0.5
    with pytest.raises(AttributeError, match=r"^'Row' object has no attribute 'strenght'$"):
        r.strenght  # noqa: B018


# ------------------------------------------------------------------------------------------------ text and jsonl


def test_read_text_names_a_missing_file_and_a_non_utf8_byte_by_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError) as e:
        ds.read_text(missing)
    assert e.value.problems == [f"dataset.path: file {str(missing)!r} does not exist; fix: pass an existing file"]
    p = tmp_path / "latin1.txt"
    p.write_bytes(b"a fox\na cat\ncaf\xe9\n")  # the third line, offset 15
    with pytest.raises(DatasetError) as e:
        ds.read_text(p)
    assert e.value.problems == [f"{p}:3: text is not UTF-8 (byte 0xe9 at offset 15); fix: re-encode the file as UTF-8"]


def test_read_text_drops_a_leading_bom_only(tmp_path):
    p = tmp_path / "bom.csv"
    p.write_bytes("\ufeffprompt\na fox\ufeff\n".encode("utf-8"))
    assert ds.read_text(p) == "prompt\na fox\ufeff\n"
    p.write_text("XL fox\n")  # only the BOM: a leading X is text
    assert ds.read_text(p) == "XL fox\n"


def test_read_jsonl_skips_blank_lines_and_names_every_bad_line(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('\n{"prompt": "a fox"}\n{"prompt": \n["a cat"]\n\n{"prompt": "a owl"}\n')
    with pytest.raises(DatasetError) as e:
        ds.read_jsonl(p)
    assert e.value.problems == [
        f"{p}:3: malformed JSON (Expecting value at column 12); fix: one JSON object per line",
        f"{p}:4: expected a JSON object with a 'prompt' field, got list"]
    assert e.value.rows == [(2, {"prompt": "a fox"}), (6, {"prompt": "a owl"})]


def test_jsonl_rows_past_a_bad_line_are_checked_too(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "a fox", "seed": "x"}\nnot json\n')
    got = problems(p, "jsonl")
    assert len(got) == 2 and got[0].startswith(f"{p}:2: malformed JSON") and got[1].startswith(f"{p}:1: ")
    assert "'seed'" in got[1] and "'x'" in got[1]


# ------------------------------------------------------------------------------------------------ dataset hash


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_dataset_sha256_of_a_file_is_its_bytes_and_of_a_dir_its_listed_files(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'{"prompt": "a fox"}\n')
    assert ds.dataset_sha256(f) == ds.file_sha256(f) == _sha(b'{"prompt": "a fox"}\n')
    d = tmp_path / "saved"
    (d / "train" / ".cache").mkdir(parents=True)
    (d / ".hidden").write_bytes(b"h")  # sorts first: left out, the files after it still hashed
    (d / "a.arrow").write_bytes(b"A")
    (d / "train" / "b.json").write_bytes(b"B")
    (d / "train" / ".cache" / "c").write_bytes(b"C")
    (d / "train" / "x.lock").write_bytes(b"L")
    listing = f"a.arrow\0{_sha(b'A')}\ntrain/b.json\0{_sha(b'B')}\n".encode()
    assert ds.dataset_sha256(d) == _sha(listing)
    assert ds.dataset_sha256(str(d)) == _sha(listing)


# ------------------------------------------------------------------------------------------------ lora rows


def test_lora_names_a_name_a_list_or_a_csv_cells_json_list():
    assert ds.parse_lora_names("style", False) == ["style"]
    assert ds.parse_lora_names(' ["a", "b"]', True) == ["a", "b"]
    assert ds.parse_lora_names('["a"]', False) == ['["a"]']  # a JSON row's string is a name as given
    assert ds.parse_lora_names(["a", "b"], False) == ["a", "b"]
    assert ds.parse_lora_names(["a"], True) == ["a"]
    for bad in (5, ["a", 3], [None]):
        with pytest.raises(ValueError):
            ds.parse_lora_names(bad, False)


def test_lora_set_key_and_identity():
    resolved = [{"name": "style", "sha256": "s" * 64, "scale": 0.5}, "raw"]
    assert ds.lora_set_key(None) is None
    assert ds.lora_set_key(resolved) == (("style", 0.5), ("raw", None))
    assert ds.lora_identity(resolved) == [{"sha256": "s" * 64, "scale": 0.5}, "raw"]


# ------------------------------------------------------------------------------------------------ ignored fields


def _set_row(line: int, **kw: Any) -> ds.Row:
    set_fields = tuple(k for k in kw if k != "values") + tuple((kw.get("values") or {}))
    return _row(id=f"r{line}", line=line, set_fields=set_fields, **kw)


def test_an_ignored_field_a_row_sets_is_refused_naming_row_field_value_why_and_fix():
    rows = [_set_row(1, negative_prompt="blurry"), _set_row(2), _set_row(3, values={"num_frames": 9})]
    ignored = {"negative_prompt": ("it has no negative prompt", "model.x=y"),
               "num_frames": ("it makes images", "drop it")}
    with pytest.raises(DatasetError) as e:
        ds.apply_ignored(rows, "rows.jsonl", ignored, "error", "flux")
    assert e.value.problems == [
        "rows.jsonl:1: field 'negative_prompt' = 'blurry' is ignored by model=flux: it has no negative prompt; fix: "
        "remove 'negative_prompt' from the row, model.x=y, or dataset.on_ignored=record to run it and record the "
        "value as ignored",
        "rows.jsonl:3: field 'num_frames' = 9 is ignored by model=flux: it makes images; fix: remove 'num_frames' "
        "from the row, drop it, or dataset.on_ignored=record to run it and record the value as ignored"]
    assert ds.apply_ignored(rows[1:2], "rows.jsonl", ignored, "error", "flux") == rows[1:2]  # sets none: kept


def test_record_mode_takes_the_value_off_the_row_and_records_why_and_where():
    rows = [_set_row(1, negative_prompt="blurry", values={"num_frames": 9, "fps": 8}), _set_row(2)]
    ignored = {"negative_prompt": (lambda r: f"row {r.id} runs without guidance", "fix",
                                   lambda r: r.line == 1),  # applies to row 1 only
               "num_frames": ("images only", "fix")}
    got = ds.apply_ignored(rows, "rows.jsonl", ignored, "record", "flux")
    assert got[0].negative_prompt is None and got[0].values == {"fps": 8} and got[0].num_frames is None
    assert got[0].ignored == {"negative_prompt": {"value": "blurry", "why": "row r1 runs without guidance",
                                                  "from": "rows.jsonl:1"},
                              "num_frames": {"value": 9, "why": "images only", "from": "rows.jsonl:1"}}
    assert got[1] == rows[1] and got[1].ignored is None
    assert rows[0].negative_prompt == "blurry"  # the input rows are not changed


def test_a_config_default_the_model_ignores_is_recorded_on_the_rows_that_take_it():
    rows = [_set_row(1, negative_prompt="own"), _set_row(2)]
    ignored = {"negative_prompt": ("no guidance", "fix", lambda r: True), "num_frames": ("images", "fix")}
    got = ds.apply_ignored(rows, "rows.jsonl", ignored, "record", "flux",
                           config_values={"negative_prompt": ("model.generation.negative_prompt", "ugly")})
    assert got[0].ignored == {"negative_prompt": {"value": "own", "why": "no guidance", "from": "rows.jsonl:1"}}
    assert got[1].ignored == {"negative_prompt": {"value": "ugly", "why": "no guidance",
                                                  "from": "model.generation.negative_prompt"}}
    assert got[1].negative_prompt is None
    # error mode: a config default is not the row's doing, so it is recorded, not refused
    got = ds.apply_ignored(rows[1:], "rows.jsonl", ignored, "error", "flux",
                           config_values={"negative_prompt": ("model.generation.negative_prompt", "ugly")})
    assert got[0].ignored == {"negative_prompt": {"value": "ugly", "why": "no guidance",
                                                  "from": "model.generation.negative_prompt"}}


# ------------------------------------------------------------------------------------------------ specs, mappings, extra fields


def _rule_a(where, vals, merged, context, bad):  # cross rules of the test specs
    return []


def _rule_b(where, vals, merged, context, bad):
    return []


def _rule_c(where, vals, merged, context, bad):
    return []


def test_a_row_spec_refuses_a_field_twice_and_an_unknown_identity_or_type():
    F = ds.Field
    with pytest.raises(ValueError, match=r"^row spec 't' declares a field twice: \['a', 'b', 'a'\]$"):
        ds.RowSpec("t", (F("a", str), F("b", str), F("a", int)), (), ds.build_diffusion_row)
    with pytest.raises(ValueError, match=r"^row spec 't': fields \['b'\] have an identity outside"):
        ds.RowSpec("t", (F("a", str), F("b", str, identity="sometimes")), (), ds.build_diffusion_row)
    with pytest.raises(ValueError, match=r"^row spec 't': fields \['c'\] have an identity outside .* or a type"):
        ds.RowSpec("t", (F("a", str), F("c", complex)), (), ds.build_diffusion_row)
    assert [f.name for f in ds.RowSpec("t", (F("a", str), F("b", int)), (), ds.build_diffusion_row).fields] == ["a", "b"]


def test_extend_keeps_the_spec_and_adds_fields_and_rules_after_its_own():
    F = ds.Field
    base = ds.RowSpec("base", (F("a", str),), (_rule_a,), ds.build_diffusion_row, quote_hint=False, order=("a",))
    ext = base.extend("ext", F("b", int), F("c", str), cross=(_rule_b,))
    assert (ext.name, [f.name for f in ext.fields], ext.cross) == ("ext", ["a", "b", "c"], (_rule_a, _rule_b))
    assert (ext.build, ext.quote_hint, ext.order) == (ds.build_diffusion_row, False, ("a",))
    assert base.extend("x", build=ds.expand_items).build is ds.expand_items


def test_steps_follow_order_then_the_rest_in_declaration_order():
    F = ds.Field
    a, b = F("a", str), F("b", str)
    spec = ds.RowSpec("t", (a, b), (_rule_a, _rule_b), ds.build_diffusion_row,
                      order=("b", "no_such_field", _rule_b, _rule_c, ds.UNIQUE_ID))
    assert spec.steps() == [b, _rule_b, ds.UNIQUE_ID, a, _rule_a]  # unknown names and foreign rules dropped


def test_a_check_without_a_fix_gets_its_rule_as_the_fix():
    even = ds.Field("n", int, check=lambda v, c: None if v % 2 == 0 else "must be even")
    odd = ds.Field("n", int, check=lambda v, c: None if v % 2 else "is even")
    assert ds.field_problem(even, "r:1", {"n": 3}, {}, {}) == ["r:1: field 'n' = 3 must be even; fix: set n to a "
                                                             "value even"]
    assert ds.field_problem(odd, "r:1", {"n": 2}, {}, {}) == ["r:1: field 'n' = 2 is even; fix: set n to a value "
                                                            "that is valid"]
    assert ds.field_problem(even, "r:1", {"n": 2}, {}, {}) == []


def test_check_size_without_a_multiple_takes_any_positive_size():
    assert ds.check_size(33, {}) is None
    assert ds.check_size(33, {"size_multiple": 16}) == "is not a positive multiple of 16; fix: use e.g. 32"


def test_columns_option_resolves_interpolations_and_refuses_non_names():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"name": "caption", "cols": {"prompt": "${name}", "seed": 3}})
    assert ds.columns_option(cfg.cols) == {"prompt": "caption", "seed": "3"}
    assert ds.columns_option(None) == {}
    with pytest.raises(DatasetError) as e:
        ds.columns_option("Prompt")
    assert e.value.problems == ["dataset.columns='Prompt' is not a mapping; fix: dataset.columns={prompt: Prompt} "
                                "(row field: source column)"]
    with pytest.raises(DatasetError) as e:
        ds.columns_option({"prompt": None, "seed": ["a"], "id": "ok", "width": True})
    assert e.value.problems == [
        "dataset.columns.prompt=None is not a column name; fix: dataset.columns.prompt=<column>",
        "dataset.columns.seed=['a'] is not a column name; fix: dataset.columns.seed=<column>",
        "dataset.columns.width=True is not a column name; fix: dataset.columns.width=<column>"]


def test_apply_columns_names_unknown_fields_missing_columns_and_renames_only_rows_that_have_them():
    fields = ["id", "prompt", "seed"]
    src = Path("/data/rows.jsonl")
    with pytest.raises(DatasetError) as e:
        ds.apply_columns([(1, {"text": "a", "tag": "x"})], {"promt": "text", "xyz": "q", "seed": "s"}, src, fields)
    assert e.value.problems == [
        "dataset.columns.promt: 'promt' is not a row field; fix: did you mean 'prompt'? (dataset.columns maps a row "
        "field to the column that holds it)",
        "dataset.columns.xyz: 'xyz' is not a row field; fix: one of id, prompt, seed (dataset.columns maps a row "
        "field to the column that holds it)",
        "dataset.columns.seed='s': no row of /data/rows.jsonl has a column 's'; columns: tag, text; fix: name one of them"]
    raw = [(1, {"text": "a fox"}), (2, {"prompt": "a owl"}), (3, {"prompt": "x", "text": "y"})]
    with pytest.raises(DatasetError) as e:
        ds.apply_columns(raw, {"prompt": "text"}, src, fields)
    assert e.value.problems == ["/data/rows.jsonl:3: both 'prompt' and 'text' (mapped to 'prompt' by dataset.columns) "
                                "are set; fix: drop one of them, or the mapping"]
    assert ds.apply_columns(raw[:2], {"prompt": "text"}, src, fields) == [(1, {"prompt": "a fox"}),
                                                                          (2, {"prompt": "a owl"})]


def test_a_mapped_column_missing_from_every_row_names_the_file(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"text": "a fox"}\n')
    assert problems(p, "jsonl", columns={"prompt": "caption"}) == [
        f"dataset.columns.prompt='caption': no row of {p} has a column 'caption'; columns: text; fix: name one of them"]


def test_mapping_and_bad_lines_together_keep_the_readable_rows_mapped(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"text": "a fox", "seed": "x"}\nnot json\n{"text": "a owl"}\n')
    got = problems(p, "jsonl", columns={"prompt": "text"})
    assert len(got) == 2 and got[0].startswith(f"{p}:2: malformed JSON")
    assert got[1].startswith(f"{p}:1: field 'seed' = 'x'")  # the mapped row 1 was validated (its prompt found)


def test_a_field_of_the_engines_spec_can_be_mapped_and_rows_keep_their_spec(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "a fox", "img": "in/a.png", "strength": 0.5}\n')
    rows = load(p, "jsonl", columns={"image": "img"}, spec=ds.DIFFUSION_ROW, context={"task": "image_to_image"})
    assert (rows[0].image, rows[0].strength, rows[0].spec) == ("in/a.png", 0.5, ds.DIFFUSION_ROW)
    assert sorted(rows[0].set_fields) == ["image", "strength"]  # prompt is no generation field


def test_a_csv_cells_json_list_of_images_is_a_list():
    assert ds.DIFFUSION_ROW.by_name["image"].value('["a.png", "b.png"]', True) == ["a.png", "b.png"]
    assert ds.parse_images('["a.png", "b.png"]', True) == ["a.png", "b.png"]
    assert ds.parse_images('["a.png"]', False) == '["a.png"]'


@pytest.mark.parametrize("mode,key,value,said", [
    ("error", "negative", "x", "r:1: unknown field 'negative'; fix: did you mean 'negative_prompt'? (a column of "
                               "that name under another spelling: dataset.columns={negative_prompt: negative})"),
    ("keep", "negative", "x", None),  # ratio 0.7: metadata under keep
    ("keep", "SEED", 1, "r:1: unknown field 'SEED'; fix: did you mean 'seed'? (a column of that name under another "
                        "spelling: dataset.columns={seed: SEED})"),  # case ignored
    ("keep", "blob", b"\x00", "r:1: extra field 'blob' holds bytes, which cannot be recorded as JSON; fix: drop that "
                              "column from the dataset"),
])
def test_extra_field_typos_are_refused_in_either_mode_metadata_kept_under_keep(mode, key, value, said):
    meta: Dict[str, Any] = {}
    assert ds.extra_field(key, value, ["prompt", "negative_prompt", "seed"], mode, "r:1", meta) == said
    assert meta == ({key: value} if said is None else {})


def test_a_mapping_conflict_past_a_bad_line_is_named_beside_it(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "x", "text": "y"}\nnot json\n')
    assert problems(p, "jsonl", columns={"prompt": "text"}) == [
        f"{p}:2: malformed JSON (Expecting value at column 1); fix: one JSON object per line",
        f"{p}:1: both 'prompt' and 'text' (mapped to 'prompt' by dataset.columns) are set; fix: drop one of them, or "
        "the mapping"]


def test_a_rule_that_does_not_apply_to_a_row_leaves_the_next_rules_to_run():
    rows = [_set_row(2, values={"num_frames": 9})]
    ignored = {"negative_prompt": ("no guidance", "fix", lambda r: False), "num_frames": ("images only", "fix")}
    got = ds.apply_ignored(rows, "rows.jsonl", ignored, "record", "flux")
    assert got[0].ignored == {"num_frames": {"value": 9, "why": "images only", "from": "rows.jsonl:2"}}
