"""Dataset validation (``runner.core.dataset``) check by check, at each check's boundary, with the message a user reads:
every bad field of every row is named (file:line, field, value, fix) in one error before any model loads; good
rows get every generation parameter filled in; seeds, item keys, file names and batches follow their rules.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from runner.core import dataset as ds
from runner.core.dataset import DatasetError, Item, Row
from _helpers import import_extra  # noqa: E402

pytestmark = pytest.mark.cpu

DEFAULTS = {"width": 64, "height": 48, "num_inference_steps": 4, "guidance_scale": 3.5, "num_images_per_prompt": 1,
            "negative_prompt": None}


def jsonl(tmp_path: Path, rows: List[Dict[str, Any]], name: str = "rows.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return p


def load(path: Path, fmt: str = "jsonl", defaults: Dict[str, Any] = DEFAULTS, size_multiple: int = 16,
         max_pixels: int = 1 << 20, **kw: Any):
    return ds.load_rows(fmt, str(path), defaults=defaults, size_multiple=size_multiple, max_pixels=max_pixels, **kw)


def problems(path: Path, **kw: Any) -> List[str]:
    with pytest.raises(DatasetError) as e:
        load(path, **kw)
    return e.value.problems


# ------------------------------------------------------------------------------------------------- rows


def test_a_good_row_gets_every_parameter(tmp_path):
    p = jsonl(tmp_path, [{"id": "fox", "prompt": "a fox", "seed": 5, "width": 32, "guidance_scale": 2,
                          "expect": {"color": "red"}},
                         {"prompt": "a cat", "negative_prompt": "blurry"}])
    rows, src = load(p)
    assert src == p
    assert rows == [
        Row(id="fox", prompt="a fox", negative_prompt=None, seed=5, width=32, height=48, num_inference_steps=4,
            guidance_scale=2.0, num_images_per_prompt=1, line=1, expect={"color": "red"},
            set_fields=("seed", "width", "guidance_scale")),
        Row(id="row000002", prompt="a cat", negative_prompt="blurry", seed=None, width=64, height=48,
            num_inference_steps=4, guidance_scale=3.5, num_images_per_prompt=1, line=2,
            set_fields=("negative_prompt",))]
    assert isinstance(rows[0].guidance_scale, float)


def test_null_fields_take_the_defaults(tmp_path):
    rows, _ = load(jsonl(tmp_path, [{"prompt": "p", "width": None, "seed": None}]))
    assert rows[0].width == 64 and rows[0].seed is None and rows[0].set_fields == ()


def test_default_negative_prompt_and_video_fields(tmp_path):
    rows, _ = load(jsonl(tmp_path, [{"prompt": "p"}, {"prompt": "q", "num_frames": 5, "fps": 12}]),
                   defaults=dict(DEFAULTS, negative_prompt="ugly", num_frames=9, fps=8))
    assert (rows[0].negative_prompt, rows[0].num_frames, rows[0].fps) == ("ugly", 9, 8)
    assert (rows[1].num_frames, rows[1].fps) == (5, 12)


def test_limit_keeps_the_first_rows(tmp_path):
    p = jsonl(tmp_path, [{"prompt": f"p{i}"} for i in range(5)])
    assert [r.prompt for r in load(p, limit=2)[0]] == ["p0", "p1"]
    assert len(load(p, limit=None)[0]) == 5


def test_every_problem_of_every_row_in_one_error(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "ok"}, {"id": "a", "prompt": "", "width": 30}, {"id": "a", "seed": -1}])
    got = problems(p)
    assert got == [f"{p}:2: field 'prompt' is empty; fix: give every row a non-empty prompt",
                   f"{p}:2: field 'width' = 30 is not a positive multiple of 16; fix: use e.g. 32",
                   f"{p}:3: field 'prompt' is missing; fix: give every row a non-empty prompt",
                   f"{p}:3: duplicate id 'a' (first on line 2); fix: ids must be unique",
                   f"{p}:3: field 'seed' = -1 must be in [0, 2**63 - 64); fix: use e.g. 0"]


def test_a_single_problem_message_head(tmp_path):
    with pytest.raises(DatasetError) as e:
        load(jsonl(tmp_path, [{"prompt": " "}]))
    assert str(e.value).startswith("dataset problem:\n  ") and "field 'prompt' is empty" in str(e.value)


@pytest.mark.parametrize("field,value,kind,quotes", [
    ("width", "64", "an integer", True), ("width", 64.5, "an integer", False), ("width", True, "an integer", False),
    ("seed", [1], "an integer", False), ("guidance_scale", "high", "a number", True),
    ("guidance_scale", False, "a number", False), ("prompt", 5.5, "a string", False),
    ("expect", "red", "an object", True), ("negative_prompt", {"a": 1}, "a string", False),
])
def test_wrong_types_are_named_with_the_fix(tmp_path, field, value, kind, quotes):
    p = jsonl(tmp_path, [dict({"prompt": "p"}, **{field: value})])
    msg = f"{p}:1: field {field!r} = {value!r} is not {kind}; fix: write it as {kind}" + (" (no quotes)" if quotes else "")
    assert msg in problems(p)


def test_integral_floats_and_int_ids_are_accepted(tmp_path):
    rows, _ = load(jsonl(tmp_path, [{"id": 7, "prompt": "p", "width": 32.0, "guidance_scale": 4}]))
    assert (rows[0].id, rows[0].width, rows[0].guidance_scale) == ("7", 32, 4.0)
    assert type(rows[0].width) is int


@pytest.mark.parametrize("key,value,ok", [("width", 16, True), ("width", 0, False), ("width", -16, False),
                                          ("height", 8, False), ("height", 48, True), ("width", 24, False)])
def test_sizes_positive_multiples(tmp_path, key, value, ok):
    p = jsonl(tmp_path, [{"prompt": "p", key: value}])
    if ok:
        assert getattr(load(p)[0][0], key) == value
    else:
        fix = max(16, round(value / 16) * 16)
        assert problems(p) == [f"{p}:1: field {key!r} = {value} is not a positive multiple of 16; fix: use e.g. {fix}"]


def test_size_without_a_default(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "p"}])
    assert problems(p, defaults=dict(DEFAULTS, width=None)) == [
        f"{p}:1: field 'width' = None is not a positive multiple of 16; fix: use e.g. 16"]


def test_max_pixels_boundary(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "p", "width": 64, "height": 64}])
    assert load(p, max_pixels=64 * 64)[0][0].width == 64
    assert problems(p, max_pixels=64 * 64 - 1) == [
        f"{p}:1: 64x64 exceeds max_pixels=4095; fix: smaller sizes, or raise max_pixels"]


@pytest.mark.parametrize("steps,ok", [(1, True), (0, False), (-2, False)])
def test_steps_at_least_one(tmp_path, steps, ok):
    p = jsonl(tmp_path, [{"prompt": "p", "num_inference_steps": steps}])
    if ok:
        assert load(p)[0][0].num_inference_steps == steps
    else:
        assert problems(p) == [f"{p}:1: field 'num_inference_steps' = {steps} must be >= 1; fix: use e.g. 1"]


def test_steps_without_a_default(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "p"}])
    assert problems(p, defaults=dict(DEFAULTS, num_inference_steps=None)) == [
        f"{p}:1: field 'num_inference_steps' = None must be >= 1; fix: use e.g. 1"]


@pytest.mark.parametrize("seed,ok", [(0, True), (2 ** 63 - 65, True), (2 ** 63 - 64, False), (2 ** 63, False),
                                     (-1, False)])
def test_seed_range(tmp_path, seed, ok):
    p = jsonl(tmp_path, [{"prompt": "p", "seed": seed}])
    if ok:
        assert load(p)[0][0].seed == seed
    else:
        assert problems(p) == [f"{p}:1: field 'seed' = {seed} must be in [0, 2**63 - 64); fix: use e.g. 0"]


@pytest.mark.parametrize("g,ok", [(0, True), (0.0, True), (-0.5, False), (float("inf"), False), (float("nan"), False),
                                  (30, True)])
def test_guidance_finite_and_not_negative(tmp_path, g, ok):
    p = tmp_path / "g.jsonl"
    p.write_text(json.dumps({"prompt": "p", "guidance_scale": g}) + "\n")  # json writes Infinity/NaN, Python reads them
    if ok:
        assert load(p)[0][0].guidance_scale == g
    else:
        assert problems(p) == [f"{p}:1: field 'guidance_scale' = {float(g)!r} must be a finite number >= 0; fix: use e.g. 3.5"]


def test_no_guidance_model(tmp_path):
    rows, _ = load(jsonl(tmp_path, [{"prompt": "p"}]), defaults=dict(DEFAULTS, guidance_scale=None))
    assert rows[0].guidance_scale is None


@pytest.mark.parametrize("key", ["num_frames", "fps"])
@pytest.mark.parametrize("value,ok", [(1, True), (100_000, True), (0, False), (100_001, False)])
def test_video_fields_range(tmp_path, key, value, ok):
    p = jsonl(tmp_path, [{"prompt": "p", key: value}])
    if ok:
        assert getattr(load(p)[0][0], key) == value
    else:
        assert problems(p) == [f"{p}:1: field {key!r} = {value} must be an integer from 1 to 100000; fix: use e.g. "
                               f"{1 if value < 1 else 100_000}"]


@pytest.mark.parametrize("n,ok", [(1, True), (3, True), (0, False), (-1, False)])
def test_images_per_prompt_at_least_one(tmp_path, n, ok):
    p = jsonl(tmp_path, [{"prompt": "p", "num_images_per_prompt": n}])
    if ok:
        assert load(p)[0][0].num_images_per_prompt == n
    else:
        assert problems(p) == [f"{p}:1: field 'num_images_per_prompt' = {n} must be >= 1; fix: use e.g. 1"]


def test_images_per_prompt_without_a_default(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "p"}])
    assert problems(p, defaults=dict(DEFAULTS, num_images_per_prompt=None)) == [
        f"{p}:1: field 'num_images_per_prompt' = None must be >= 1; fix: use e.g. 1"]


def test_a_bad_row_is_not_kept_but_later_rows_are_still_checked(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "p", "width": 8}, {"prompt": "q", "height": 8}])
    assert [m.split(": ", 1)[0] for m in problems(p)] == [f"{p}:1", f"{p}:2"]


def test_size_multiple_of_one(tmp_path):
    rows, _ = load(jsonl(tmp_path, [{"prompt": "p", "width": 1, "height": 3}]), size_multiple=1)
    assert (rows[0].width, rows[0].height) == (1, 3)


def test_a_missing_size_is_not_also_reported_as_too_many_pixels(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "p", "height": 64}, {"prompt": "q", "width": 64, "height": None}])
    assert problems(p, defaults=dict(DEFAULTS, width=None, height=None), max_pixels=32) == [
        f"{p}:1: field 'width' = None is not a positive multiple of 16; fix: use e.g. 16",
        f"{p}:2: field 'height' = None is not a positive multiple of 16; fix: use e.g. 16"]


def test_every_field_of_a_row_is_read_after_an_extra_or_null_one(tmp_path):
    p = jsonl(tmp_path, [{"category": "x", "prompt": "p", "seed": 3}, {"seed": None, "prompt": "q", "width": 32}])
    rows, _ = load(p, extra_fields="keep")
    assert (rows[0].prompt, rows[0].seed, rows[0].meta) == ("p", 3, {"category": "x"})
    assert (rows[1].prompt, rows[1].width) == ("q", 32)


def test_builtin_prompts_by_default(tmp_path):
    rows, src = ds.load_rows("builtin", None, defaults=DEFAULTS, size_multiple=16, max_pixels=1 << 20)
    assert src == ds.BUILTIN_PROMPTS and len(rows) >= 1 and all(r.prompt for r in rows)


def test_columns_rename_a_source_column(tmp_path):
    p = tmp_path / "rows.csv"
    p.write_text("Prompt,Seed\na fox,4\n")
    rows, _ = load(p, fmt="csv", columns={"prompt": "Prompt", "seed": "Seed"})
    assert (rows[0].prompt, rows[0].seed) == ("a fox", 4)


def test_hf_split(tmp_path):
    datasets = import_extra("export", "datasets")
    d = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "train row"}]),
                              "test": datasets.Dataset.from_list([{"prompt": "test row"}, {"prompt": "two"}])})
    d.save_to_disk(str(tmp_path / "ds"))
    rows, _ = load(tmp_path / "ds", fmt="hf", split="test")
    assert [r.prompt for r in rows] == ["test row", "two"]


def test_no_rows(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    assert problems(p) == [f"{p}: no rows; fix: add at least one prompt"]


def test_unknown_field_refused_or_kept(tmp_path):
    p = jsonl(tmp_path, [{"prompt": "p", "category": "animals"}])
    assert problems(p) == [f"{p}:1: unknown field 'category'; fix: remove it, or dataset.extra_fields=keep to record "
                           f"it under the item's meta (row fields: {', '.join(ds.ROW_FIELDS)})"]
    rows, _ = load(p, extra_fields="keep")
    assert rows[0].meta == {"category": "animals"} and rows[0].set_fields == ()


def test_csv_cells_are_parsed_as_text(tmp_path):
    p = tmp_path / "rows.csv"
    p.write_text("id,prompt,seed,width,guidance_scale\na,a fox,12,32,2.5\nb,a cat,,,\n")
    rows, _ = load(p, fmt="csv")
    assert [(r.id, r.seed, r.width, r.guidance_scale) for r in rows] == [("a", 12, 32, 2.5), ("b", None, 64, 3.5)]
    p.write_text("id,prompt,seed\na,a fox,twelve\n")
    assert problems(p, fmt="csv") == [f"{p}:2: field 'seed' = 'twelve' is not an integer; fix: write it as an "
                                      "integer (no quotes)"]


# ------------------------------------------------------------------------------------------------- coerce


def test_coerce_rules():
    assert ds.coerce("x", str, False) == "x" and ds.coerce(5, str, True) == "5" and ds.coerce(5, str, False) == "5"
    for bad in (True, 1.5, None):
        with pytest.raises(ValueError):
            ds.coerce(bad, str, False)
    assert ds.coerce(3, int, False) == 3 and ds.coerce("3", int, True) == 3 and ds.coerce(3.0, int, False) == 3
    for bad, text in ((True, False), ("3", False), (3.5, False), ("x", True), (None, False)):
        with pytest.raises(ValueError):
            ds.coerce(bad, int, text)
    assert ds.coerce({"a": 1}, dict, False) == {"a": 1} and ds.coerce('{"a": 1}', dict, True) == {"a": 1}
    for bad, text in (("[1]", True), ('{"a": 1}', False), ([1], False)):
        with pytest.raises(ValueError):
            ds.coerce(bad, dict, text)
    assert ds.coerce(2, float, False) == 2.0 and ds.coerce("2.5", float, True) == 2.5
    assert type(ds.coerce(2, float, False)) is float
    for bad, text in ((False, False), ("2.5", False), (None, True)):
        with pytest.raises(ValueError):
            ds.coerce(bad, float, text)
    with pytest.raises(TypeError, match="list"):
        ds.coerce(1, list, False)


# ------------------------------------------------------------------------------------------------- source


def test_source_path_rules(tmp_path):
    assert ds.source_path("builtin", None, "prompts.jsonl") == ds.BUILTIN_PROMPTS
    assert ds.source_path("builtin", None, "other.jsonl") == ds.BUILTIN_PROMPTS.parent / "other.jsonl"
    # a path beside builtin (the default dataset) was silently not read: 24 builtin prompts ran instead of the file
    for path, fmt in (("/data/rows.csv", "csv"), ("/data/rows.parquet", "parquet"), ("/data/rows", "jsonl")):
        with pytest.raises(DatasetError) as e:
            ds.source_path("builtin", path, "prompts.jsonl")
        assert e.value.problems == [f"dataset.path={path!r} is not read by dataset=builtin (the model's builtin "
                                    f"prompts); fix: dataset={fmt} dataset.path={path}"]
    f = tmp_path / "rows.csv"
    f.write_text("prompt\nx\n")
    assert ds.source_path("csv", str(f), "x") == f
    assert ds.source_path("hf", str(tmp_path), "x") == tmp_path  # a save_to_disk dir
    with pytest.raises(DatasetError) as e:
        ds.source_path("yaml", str(f), "x")
    assert e.value.problems == [f"dataset.format='yaml' is not known; fix: one of {', '.join(ds.FORMATS)}"]
    with pytest.raises(DatasetError) as e:
        ds.source_path("jsonl", None, "x")
    assert e.value.problems == ["dataset.path: required for dataset=jsonl; fix: dataset.path=/path/to/prompts.jsonl"]
    with pytest.raises(DatasetError) as e:
        ds.source_path("hf", "", "x")
    assert e.value.problems == ["dataset.path: required for dataset=hf; fix: dataset.path=/path/to/saved_dataset"]
    with pytest.raises(DatasetError) as e:
        ds.source_path("csv", str(tmp_path), "x")
    assert e.value.problems == [f"dataset.path: {str(tmp_path)!r} is not a file; fix: pass the path of an existing "
                                ".csv file"]
    with pytest.raises(DatasetError) as e:
        ds.source_path("hf", str(tmp_path / "nope"), "x")
    assert e.value.problems == [f"dataset.path: {str(tmp_path / 'nope')!r} is not a file or dir; fix: pass the path of "
                                "a dir written by save_to_disk or a data file"]


def test_source_path_expands_the_home_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "p.txt").write_text("a\n")
    assert ds.source_path("txt", "~/p.txt", "x") == tmp_path / "p.txt"


# ---------------------------------------------------------------------------------------- seeds, items, batches


def _row(id: str, seed=None, n: int = 1, line: int = 1, **kw: Any) -> Row:
    base = dict(negative_prompt=None, width=64, height=64, num_inference_steps=4, guidance_scale=3.5)
    values = {k: kw.pop(k) for k in ("num_frames", "fps") if k in kw}  # the video fields: Row.values
    base.update(kw)
    return Row(id=id, prompt="p", seed=seed, num_images_per_prompt=n, line=line, values=values, **base)


def test_derive_seed_is_fixed_per_run_seed_and_id():
    assert ds.derive_seed(0, "fox") == 7501539662765339771
    assert ds.derive_seed(0, "fox") != ds.derive_seed(1, "fox") != ds.derive_seed(0, "cat")
    assert all(0 <= ds.derive_seed(s, "x") < 2 ** 63 for s in range(50))


def test_expand_items_seeds_and_keys():
    items = ds.expand_items([_row("a", seed=10, n=2), _row("b"), _row("c", n=3)], run_seed=0)
    assert [it.key for it in items] == ["a-0", "a-1", "b", "c-0", "c-1", "c-2"]
    assert [it.index for it in items] == [0, 1, 0, 0, 1, 2]
    assert [it.seed for it in items[:2]] == [10, 11]
    assert items[2].seed == ds.derive_seed(0, "b")
    base = ds.derive_seed(0, "c")
    assert [it.seed for it in items[3:]] == [(base + k) % (1 << 63) for k in range(3)]


def test_expand_items_wraps_derived_seeds_only():
    rows = [_row(f"r{i}", n=40) for i in range(20)]  # some derived seed + k may pass 2**63
    for it in ds.expand_items(rows, run_seed=3):
        assert 0 <= it.seed < 2 ** 63
    top = ds.expand_items([_row("t", seed=2 ** 63 - 65, n=2)], 0)
    assert [it.seed for it in top] == [2 ** 63 - 65, 2 ** 63 - 64]  # a row's own seed: + k, as written


def test_a_rows_own_seed_counts_up_as_written():
    items = ds.expand_items([_row("t", seed=2 ** 63 - 65, n=70)], 0)
    assert items[-1].seed == 2 ** 63 - 65 + 69  # never wrapped: the row's seed + k, as documented


def test_expand_items_refuses_colliding_keys():
    with pytest.raises(DatasetError) as e:
        ds.expand_items([_row("a", n=2, line=1), _row("a-1", line=2)], 0)
    assert e.value.problems == ["line 2: item key 'a-1' of row 'a-1' collides with row 'a' (line 1); fix: rename one "
                                "of the ids"]


def test_batches_group_equal_shapes_in_dataset_order():
    rows = [_row("a"), _row("b", width=32), _row("c"), _row("d"), _row("e", width=32), _row("f")]
    items = ds.expand_items(rows, 0)
    assert [[it.key for it in b] for b in ds.batches(items, 2)] == [["a", "c"], ["d", "f"], ["b", "e"]]
    assert [[it.key for it in b] for b in ds.batches(items, 3)] == [["a", "c", "d"], ["f"], ["b", "e"]]
    assert [[it.key for it in b] for b in ds.batches(items, 1)] == [[k] for k in "acdfbe"]


def test_batches_split_on_every_shape_field():
    rows = [_row("a"), _row("b", num_inference_steps=8), _row("c", guidance_scale=1.0), _row("d", negative_prompt="x"),
            _row("e", height=32), _row("f", num_frames=5)]
    assert len(ds.batches(ds.expand_items(rows, 0), 8)) == 6


@pytest.mark.parametrize("key,stem", [
    ("fox", "fox"), ("a.b-c_d", "a.b-c_d"), ("a/b", "a_b-c14cddc0"), ("../x", "_x-d6b96a97"), ("", "id-e3b0c442"),
    ("CON", "_CON-a3dbc4b6"), ("con.txt", "_con.txt-d3bde286"), ("COM1", "_COM1-6eac394b"), ("Xfox", "Xfox"),
    (".hidden", "hidden-16924190"), ("lpt9.log", "_lpt9.log-83b3402a"),
])
def test_safe_stem(key, stem):
    """File names stay inside their folder on every OS; a changed name carries 8 hex of the key's sha256."""
    assert ds.safe_stem(key) == stem


def test_safe_stem_length():
    key = "x" * 200
    got = ds.safe_stem(key)
    assert got.startswith("x" * 96 + "-") and len(got) == 96 + 9
    assert ds.safe_stem("y" * 96) == "y" * 96
    assert ds.safe_stem("ab", max_len=1).startswith("a-")


def test_item_key_and_file_stem():
    assert Item(row=_row("a/b"), index=0, seed=1).filename_stem == ds.safe_stem("a/b")
    assert Item(row=_row("a", n=2), index=1, seed=1).key == "a-1"


def test_csv_trailing_commas_are_told_apart_from_an_unquoted_comma(tmp_path):
    """Issue 29: ``a,a red circle,,`` under ``id,prompt`` has 4 cells for 2 columns, its extra cells empty: trailing
    commas, not a prompt to quote; an unquoted comma in a value keeps the quoting hint. Every such row is named."""
    p = tmp_path / "rows.csv"
    p.write_text("id,prompt\na,a red circle,,\nb,a blue, square\nc,fine\n", encoding="utf-8")
    assert problems(p, fmt="csv") == [
        f"{p}:2: row has more cells than the header has columns (4 cells, 2 columns; the 2 extra cell(s) are empty: "
        "trailing commas); fix: remove the trailing commas",
        f"{p}:3: row has more cells than the header has columns (3 cells, 2 columns); fix: quote prompts that "
        "contain commas"]
