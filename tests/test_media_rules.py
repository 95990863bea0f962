"""The rules of ``runner.core.media`` one by one (issue #42: tests that catch a wrong run), on real files written
with PIL / numpy, each written to fail under a mutant the mutation run (``benchmarks/mutation.py``) found surviving
the conditioning tests:

* how a value is shown in a problem (image bytes by their format, long values cut and counted, lists after 10);
* parsing of a media cell (a path, a JSON list from text, an image cell), URLs, where a relative path points;
* the lossless mode rules (transparent pixels counted, a colour mask refused, a palette with a transparency key);
* decoding: not an image, the pixel bound (at and above it, and PIL's own bomb bound), a corrupt file;
* the exact problem message of each kind (field, value, why, fix), a mask's repaint pixels, sizes: an input of the
  row's area but another shape, a mask of its image's area but transposed, a list input judged item by item;
* an input changed, removed or undecodable between the startup check and its generation (``load_input``);
* the records and digests of inputs.
"""

from __future__ import annotations

import hashlib
import io
import logging
import struct
import zlib
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
from PIL import Image

from runner.core import dataset as ds
from runner.core import media


def _png(path: Path, array: np.ndarray, mode: str = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (Image.fromarray(array, mode) if mode else Image.fromarray(array)).save(path)
    return path


def _row(values: Dict[str, Any], w: int = 8, h: int = 8, rid: str = "x", line: int = 1) -> Any:
    return ds.Row(id=rid, prompt="p", negative_prompt=None, seed=1, width=w, height=h, num_inference_steps=4,
                  guidance_scale=None, num_images_per_prompt=1, line=line, values=values, spec=ds.DIFFUSION_ROW)


# ------------------------------------------------------------------------------------------------ shown


def test_shown_names_image_bytes_and_cuts_long_values():
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 5000
    assert media.shown(png) == "<PNG bytes, 5,008 B>"
    assert media.shown(bytearray(b"\xff\xd8\xff\x00")) == "<JPEG bytes, 4 B>"
    assert media.shown(memoryview(b"GIF89a")) == "<GIF bytes, 6 B>"
    assert media.shown(b"BMxx") == "<BMP bytes, 4 B>"
    assert media.shown(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "<WebP bytes, 16 B>"
    assert media.shown(b"RIFF\x00\x00\x00\x00WAVEfmt ") == "<bytes, 16 B>"
    assert media.shown(b"abc") == "<bytes, 3 B>"
    assert media.shown({"bytes": png, "path": "a.png"}) == "{'bytes': <PNG bytes, 5,008 B>, 'path': 'a.png'}"
    assert media.shown(list(range(10))) == "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"
    assert media.shown(list(range(11))) == "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (11 items)]"
    assert media.shown(tuple(range(1234))) == "(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, ... (1,234 items))"
    assert media.shown(("a",)) == "('a')"
    s = "x" * 198  # repr: 200 characters, shown whole
    assert media.shown(s) == repr(s)
    long = "y" * 1500
    assert media.shown(long) == repr(long)[:200] + "... (1,500 characters)"
    big = 10 ** 249  # no str: the repr's length is counted
    assert media.shown(big) == repr(big)[:200] + "... (250 characters)"


# ------------------------------------------------------------------------------------------------ parsing


def test_media_mode_and_fields():
    with pytest.raises(ValueError, match=r"Media mode 'CMYK' is not one of \['L', 'RGB'\]"):
        media.Media("CMYK")
    assert media.Media() == media.Media("RGB", False)
    assert media.media_fields(None) == {}
    assert media.media_fields(ds.DIFFUSION_ROW) == {"image": media.Media(), "mask_image": media.Media("L", True),
                                                    "last_image": media.Media()}


def test_parse_media_cells():
    assert media.parse_media("a.png", False) == "a.png"
    assert media.parse_media(' ["a.png", "b.png"]', True) == ["a.png", "b.png"]
    assert media.parse_media("[a.png", False) == "[a.png"  # not from text: a path
    assert media.parse_media(["a.png", "b.png"], False) == ["a.png", "b.png"]
    assert media.parse_media({"bytes": b"x"}, False) == {"bytes": b"x", "path": None}
    assert media.parse_media({"path": "p.png", "other": 1}, False) == {"bytes": None, "path": "p.png"}
    for bad in ("", "  ", [], ["a.png", " "], ["a.png", 3], {}, {"bytes": b"", "path": ""}, 3, None):
        with pytest.raises(ValueError):
            media.parse_media(bad, False)
    assert media.parse_one_media({"path": "p.png"}, False) == {"bytes": None, "path": "p.png"}
    with pytest.raises(ValueError):
        media.parse_one_media('["a.png"]', True)


def test_urls_and_where_a_path_points(tmp_path, monkeypatch):
    for u in (" HTTPS://x/a.png", "http://x", "s3://b/k", "gs://b/k", "ftp://h/f", "hf://d/f", "file:///a.png",
              "data:image/png;base64,AA"):
        assert media.is_url(u), u
    assert not media.is_url("https.png") and not media.is_url("data/a.png")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    src = tmp_path / "sets" / "rows.jsonl"
    assert media.resolve_path("/abs/a.png", src, str(tmp_path / "root")) == Path("/abs/a.png")
    assert media.resolve_path("~/a.png", src, None) == tmp_path / "home" / "a.png"
    assert media.resolve_path("sub/../a.png", src, None) == (tmp_path / "sets" / "a.png").resolve()
    assert media.resolve_path("a.png", src, str(tmp_path / "root")) == (tmp_path / "root" / "a.png").resolve()
    assert media.resolve_path("a.png", src, "~/m") == (tmp_path / "home" / "m" / "a.png").resolve()
    assert media.resolve_path("a.png", src, "") == (tmp_path / "sets" / "a.png").resolve()


# ------------------------------------------------------------------------------------------------ modes


def test_mode_rules():
    rgb = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    im = Image.fromarray(rgb)
    assert media.convert_mode(im, "RGB") == (im, None, None)
    rgba = np.dstack([rgb, np.full((4, 4), 255, np.uint8)])
    out, rule, why = media.convert_mode(Image.fromarray(rgba), "RGB")
    assert (out.mode, rule, why) == ("RGB", "RGBA->RGB (alpha all 255, dropped)", None)
    assert np.array_equal(np.asarray(out), rgb)
    rgba[1, 2, 3], rgba[3, 0, 3], rgba[0, 0, 3] = 254, 0, 17
    assert media.convert_mode(Image.fromarray(rgba), "RGB") == (None, None, (
        "has mode RGBA with 3 transparent pixel(s) (alpha < 255); what lies behind them is not defined, so it is "
        "not converted"))
    grey = np.full((4, 4), 7, np.uint8)
    la = Image.fromarray(np.dstack([grey, np.full((4, 4), 255, np.uint8)]), "LA")
    out, rule, _ = media.convert_mode(la, "L")
    assert (out.mode, rule) == ("L", "LA->L (alpha all 255, dropped)") and np.array_equal(np.asarray(out), grey)
    la_t = np.dstack([grey, np.full((4, 4), 255, np.uint8)])
    la_t[2, 2, 1] = 0
    assert media.convert_mode(Image.fromarray(la_t, "LA"), "L") == (None, None, (
        "has mode LA with 1 transparent pixel(s) (alpha < 255); what lies behind them is not defined, so it is not "
        "converted"))
    out, rule, _ = media.convert_mode(la, "RGB")
    assert (out.mode, rule) == ("RGB", "LA->RGB (alpha all 255, dropped)") and (np.asarray(out) == 7).all()
    equal = Image.fromarray(np.dstack([grey] * 3))
    out, rule, _ = media.convert_mode(equal, "L")
    assert (out.mode, rule) == ("L", "RGB->L (channels equal)") and np.array_equal(np.asarray(out), grey)
    for colour in (np.dstack([grey, grey, grey + 1]), np.dstack([grey + 1, grey, grey])):
        assert media.convert_mode(Image.fromarray(colour), "L") == (
            None, None, "is a colour image; a mask must be grey (white = repaint, black = keep)")
    colour_rgba = Image.fromarray(np.dstack([grey, grey, grey + 1, np.full((4, 4), 255, np.uint8)]))
    assert media.convert_mode(colour_rgba, "L")[2].startswith("is a colour image")
    out, rule, _ = media.convert_mode(Image.fromarray(np.dstack([grey, grey, grey, np.full((4, 4), 255, np.uint8)])),
                                      "L")
    assert (out.mode, rule) == ("L", "RGBA->L (alpha all 255, channels equal)")
    cmyk = Image.new("CMYK", (4, 4))
    rules = ", ".join(sorted({f"{a}->{b}" for a, b in media.MODE_RULES}))
    assert media.convert_mode(cmyk, "RGB") == (None, None, (
        f"has mode CMYK, which the pipeline cannot take as RGB and no lossless rule converts (rules: {rules})"))


def test_a_palette_with_a_transparency_key_converts_only_when_no_pixel_uses_it():
    """Regression: a refusal named the mode of the RGBA copy a keyed palette is converted to ("has mode RGBA"),
    not the file's mode P."""
    pal = Image.fromarray(np.array([[0, 1], [1, 2]], np.uint8), "P")
    pal.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    unused = pal.copy()
    unused.info["transparency"] = 3  # a key no pixel has
    out, rule, why = media.convert_mode(unused, "RGB")
    assert (out.mode, rule, why) == ("RGB", "PA->RGB (alpha all 255, dropped)", None)
    assert np.array_equal(np.asarray(out), [[[255, 0, 0], [0, 255, 0]], [[0, 255, 0], [0, 0, 255]]])
    used = pal.copy()
    used.info["transparency"] = 1
    assert media.convert_mode(used, "RGB") == (None, None, (
        "has mode P with 2 transparent pixel(s) (alpha < 255); what lies behind them is not defined, so it is not "
        "converted"))
    rules = ", ".join(sorted({f"{a}->{b}" for a, b in media.MODE_RULES}))
    assert media.convert_mode(unused, "L") == (None, None, (  # the file's mode named, not the RGBA it became
        f"has mode P, which the pipeline cannot take as L and no lossless rule converts (rules: {rules})"))
    out, rule, _ = media.convert_mode(pal, "RGB")  # no key: the palette expanded
    assert (out.mode, rule) == ("RGB", "P->RGB (palette expanded)")


# ------------------------------------------------------------------------------------------------ decoding


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header declares ``w`` x ``h`` (no pixel data): PIL reads its size without decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def test_decode_bound_bomb_and_corruption():
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 9, np.uint8)).save(buf, format="PNG")
    data = buf.getvalue()
    img, why = media.decode(data, 64)  # exactly the bound: taken
    assert why is None and img.size == (8, 8) and np.asarray(img).sum() == 9 * 8 * 8 * 3
    assert media.decode(data, 63) == (None, "declares 8x8 = 64 pixels, above the input bound of 63 (PIL's "
                                            "decompression-bomb bound Image.MAX_IMAGE_PIXELS); it is not decoded")
    assert media.decode(b"not an image", 64) == (None, "is not an image PIL can read")
    img, why = media.decode(_png_header_only(100000, 100000), media.MAX_INPUT_PIXELS)
    assert img is None and why.startswith("declares more pixels than PIL's decompression-bomb bound (")
    assert media.decode(data[:-30], 64) == (None, "is corrupt (OSError: Truncated File Read)")  # truncated
    # above PIL's MAX_IMAGE_PIXELS but below twice it: PIL only warns (silenced), the runner's own bound refuses it
    assert media.decode(_png_header_only(10000, 9000), 89_000_000) == (None, (
        "declares 10000x9000 = 90000000 pixels, above the input bound of 89000000 (PIL's decompression-bomb bound "
        "Image.MAX_IMAGE_PIXELS); it is not decoded"))
    assert media.MAX_INPUT_PIXELS == Image.MAX_IMAGE_PIXELS == 89478485


# ------------------------------------------------------------------------------------------------ one input


def test_read_input_and_the_fix_of_each_problem(tmp_path):
    src = tmp_path / "rows.jsonl"
    p = _png(tmp_path / "a.png", np.zeros((8, 8, 3), np.uint8))
    assert media.read_input("image", {"bytes": b"xy", "path": "cell.png"}, src, None) == (
        b"xy", "<bytes of cell.png>", None, None)
    assert media.read_input("image", {"bytes": b"xy"}, src, None)[1] == "<bytes of an image cell>"
    assert media.read_input("image", {"bytes": b"", "path": "a.png"}, src, None) == (
        p.read_bytes(), "a.png", str(p), None)
    assert media.read_input("image", "https://h/a.png", src, None) == (
        None, "https://h/a.png", None, "is a URL; the runner reads no network at run time")
    assert media.read_input("image", "b.png", src, None) == (
        None, "b.png", str(tmp_path / "b.png"), f"does not exist (resolved to {tmp_path / 'b.png'})")
    (tmp_path / "d.png").mkdir()
    data, given, path, why = media.read_input("image", "d.png", src, None)
    assert (data, given, path) == (None, "d.png", str(tmp_path / "d.png"))
    assert why == "cannot be read (IsADirectoryError: Is a directory)"
    for why, fix in media.FIXES.items():
        assert media.fix_of(why + " and more") == fix
    assert media.fix_of("something else") == "give a valid image file"


def test_check_input_messages_and_a_masks_repaint_pixels(tmp_path):
    src = tmp_path / "rows.jsonl"
    mask = np.zeros((4, 6), np.uint8)
    mask[0, :3] = 128  # the binarisation's threshold: repainted
    mask[1, :2] = 127  # below it: kept
    mask[3, 5] = 255
    mp = _png(tmp_path / "m.png", mask)
    inp, why = media.check_input("mask_image", "m.png", src, None, 24, media.Media("L", True))
    assert why is None
    assert inp == media.InputFile(field="mask_image", given="m.png", path=str(mp),
                                  sha256=hashlib.sha256(mp.read_bytes()).hexdigest(), width=6, height=4, mode="L",
                                  input_mode="L", conversion=None, repaint_pixels=4)
    inp, why = media.check_input("image", "m.png", src, None, 24)
    assert why is None and (inp.mode, inp.input_mode, inp.conversion, inp.repaint_pixels) == (
        "L", "RGB", "L->RGB (grey replicated)", None)
    assert media.check_input("image", "gone.png", src, None, 24) == (None, (
        f"field 'image' = 'gone.png' does not exist (resolved to {tmp_path / 'gone.png'}); fix: "
        + media.FIXES["does not exist"]))
    assert media.check_input("image", "m.png", src, None, 23) == (None, (
        "field 'image' = 'm.png' declares 6x4 = 24 pixels, above the input bound of 23 (PIL's decompression-bomb "
        "bound Image.MAX_IMAGE_PIXELS); it is not decoded; fix: downscale the image (or split it) below the bound"))
    colour = _png(tmp_path / "c.png", np.dstack([mask, mask, mask // 2]))
    assert media.check_input("mask_image", colour.name, src, None, 24, media.Media("L", True))[1] == (
        "field 'mask_image' = 'c.png' is a colour image; a mask must be grey (white = repaint, black = keep); fix: "
        "save the mask as a grey image (mode L)")


# ------------------------------------------------------------------------------------------------ sizes


def test_sizes_compare_width_and_height_not_the_area(tmp_path):
    """The row is 8x8 (64 pixels): a 4x16 and a 16x4 input hold 64 pixels too and are refused naming both sizes;
    a mask of its image's area but transposed is named once, as a mask; with ``any_size`` only the mask rule."""
    src = tmp_path / "rows.jsonl"
    _png(tmp_path / "tall.png", np.full((16, 4, 3), 200, np.uint8))  # 4 wide, 16 high
    _png(tmp_path / "wide.png", np.full((4, 16), 255, np.uint8))
    _png(tmp_path / "good.png", np.full((8, 8, 3), 50, np.uint8))
    _png(tmp_path / "tall_mask.png", np.full((16, 4), 255, np.uint8))

    def refused(values, w=8, h=8, any_size=False):
        with pytest.raises(ds.DatasetError) as e:
            media.attach_inputs([_row(values, w, h)], src, any_size=any_size)
        return e.value.problems

    assert refused({"image": "tall.png"}) == [
        f"{src}:1: field 'image' = 'tall.png' is 4x16, and the row generates 8x8; the runner never resizes an input "
        "(the pipeline would resize it and the output would not show the input as given); fix: resize the file to "
        "8x8, or set width=4 and height=16 in the row"]
    assert refused({"image": "good.png", "last_image": "wide.png"}) == [
        f"{src}:1: field 'last_image' = 'wide.png' is 16x4, and the row generates 8x8; the runner never resizes an "
        "input (the pipeline would resize it and the output would not show the input as given); fix: resize the "
        "file to 8x8, or set width=16 and height=4 in the row"]
    mask_msg = (f"{src}:1: field 'mask_image' = 'wide.png' is 16x4, its image 'tall.png' is 4x16; fix: a mask of "
                "the image's size")
    assert refused({"image": "tall.png", "mask_image": "wide.png"}, w=4, h=16) == [mask_msg]
    assert refused({"image": "tall.png", "mask_image": "wide.png"}, any_size=True) == [mask_msg]
    got = media.attach_inputs([_row({"image": "tall.png", "mask_image": "tall_mask.png"})], src, any_size=True)
    assert got[0].inputs["image"].width == 4 and got[0].inputs["mask_image"].repaint_pixels == 64
    both = refused({"image": "good.png", "mask_image": "wide.png"})  # the mask: named once, as a mask
    assert len(both) == 1 and "its image 'good.png' is 8x8" in both[0]
    ok = media.attach_inputs([_row({"image": "tall.png"}, w=4, h=16)], src)
    assert ok[0].inputs["image"].height == 16


def test_a_list_input_is_checked_item_by_item(tmp_path):
    src = tmp_path / "rows.jsonl"
    a = _png(tmp_path / "a.png", np.full((8, 8, 3), 1, np.uint8))
    b = _png(tmp_path / "b.png", np.full((8, 8, 3), 2, np.uint8))
    _png(tmp_path / "c.png", np.full((4, 16, 3), 3, np.uint8))
    row = media.attach_inputs([_row({"image": ["a.png", "b.png"]})], src)[0]
    assert [(i.field, i.path) for i in row.inputs["image"]] == [("image[0]", str(a)), ("image[1]", str(b))]
    with pytest.raises(ds.DatasetError) as e:
        media.attach_inputs([_row({"image": ["a.png", "gone.png", "c.png"]}, line=7)], src)
    assert e.value.problems == [f"{src}:7: field 'image[1]' = 'gone.png' does not exist (resolved to "
                                f"{tmp_path / 'gone.png'}); fix: " + media.FIXES["does not exist"]]
    inputs, problems = media.row_inputs(_row({"image": ["a.png", "gone.png"], "last_image": "b.png"}), "w", src,
                                        None, media.MAX_INPUT_PIXELS)
    assert list(inputs) == ["last_image"] and len(problems) == 1 and problems[0].startswith("w: field 'image[1]'")
    with pytest.raises(ds.DatasetError) as e:
        media.attach_inputs([_row({"image": ["a.png", "c.png"]})], src)
    assert len(e.value.problems) == 1 and "field 'image[1]' = 'c.png' is 16x4" in e.value.problems[0]


def test_attach_inputs_lists_every_row_and_leaves_rows_without_inputs_as_they_are(tmp_path, caplog):
    src = tmp_path / "rows.jsonl"
    _png(tmp_path / "a.png", np.full((8, 8, 3), 1, np.uint8))
    _png(tmp_path / "black.png", np.zeros((8, 8), np.uint8))
    plain = _row({}, rid="plain")
    rows = [plain, *(_row({"image": "a.png", "mask_image": "black.png"}, rid=f"m{i}", line=i + 2) for i in range(6))]
    with caplog.at_level(logging.WARNING, logger="runner"):
        got = media.attach_inputs(rows, src)
    assert got[0] is plain and got[1].inputs["mask_image"].repaint_pixels == 0
    msg = [r.getMessage() for r in caplog.records if r.name == "runner"]
    assert len(msg) == 1 and msg[0].startswith("6 row(s) have a mask_image that selects no pixel")
    assert f"{src}:2 (m0), {src}:3 (m1), {src}:4 (m2), {src}:5 (m3), {src}:6 (m4) ...;" in msg[0]
    assert media.warn_empty_masks(got[:3], src) == [f"{src}:2 (m0)", f"{src}:3 (m1)"]
    with pytest.raises(ds.DatasetError) as e:
        media.attach_inputs([_row({"image": "x.png"}, line=3), plain, _row({"image": "y.png"}, line=5)], src)
    assert [p.split(":")[1] for p in e.value.problems] == ["3", "5"]


# ------------------------------------------------------------------------------------------------ at generation


def test_load_input_refuses_an_input_changed_removed_or_undecodable_since_the_check(tmp_path):
    src = tmp_path / "rows.jsonl"
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8)
    p = _png(tmp_path / "g.png", grey)
    inp = media.attach_inputs([_row({"image": "g.png"})], src)[0].inputs["image"]
    img = media.load_input(inp)
    assert img.mode == "RGB" and np.array_equal(np.asarray(img), np.dstack([grey] * 3))
    before = p.read_bytes()
    _png(p, grey[::-1])  # same size and mode, other bytes
    with pytest.raises(media.InputChangedError) as e:
        media.load_input(inp)
    assert str(e.value) == (f"input {p} (image) changed since the startup check (sha256 {inp.sha256[:12]}...); fix: "
                            "keep the inputs unchanged while the run runs")
    p.unlink()
    with pytest.raises(media.InputChangedError) as e:
        media.load_input(inp)
    assert str(e.value).startswith(f"input {p} (image) cannot be read any more (") and str(e.value).endswith(
        "); fix: keep the inputs in place while the run runs")
    assert isinstance(e.value, OSError)
    cell = media.InputFile(field="image", given="<bytes of an image cell>", path=None,
                           sha256=hashlib.sha256(before).hexdigest(), width=8, height=8, mode="L", input_mode="L")
    assert np.array_equal(np.asarray(media.load_input(cell, {"bytes": before})), grey)
    with pytest.raises(media.InputChangedError, match=r"input <bytes of an image cell> \(image\) changed since"):
        media.load_input(cell, {"bytes": before + b"x"})
    junk = b"no image"
    bad = media.InputFile(field="image", given="j", path=None, sha256=hashlib.sha256(junk).hexdigest(), width=1,
                          height=1, mode="L", input_mode="RGB")
    with pytest.raises(media.InputChangedError) as e:
        media.load_input(bad, {"bytes": junk})
    assert str(e.value) == "input j (image) is not an image PIL can read"


# ------------------------------------------------------------------------------------------------ records


def test_mask_inside_overlay_records_and_digests():
    m = Image.fromarray(np.array([[127, 128], [0, 255]], np.uint8))
    assert media.mask_inside(m).tolist() == [[False, True], [False, True]]
    image = Image.fromarray(np.array([[[10, 20, 30], [40, 50, 60]], [[70, 80, 90], [100, 110, 120]]], np.uint8))
    gen = np.full((2, 2, 3), 0.5, np.float32)
    out = media.overlay(gen, image, m)
    assert out.dtype == np.float32
    assert np.array_equal(out, np.array([[[10, 20, 30], [0, 0, 0]], [[70, 80, 90], [0, 0, 0]]], np.float32) / 255
                          + np.array([[0, 1], [0, 1]], np.float32)[..., None] * 0.5)
    f = media.InputFile(field="image", given="a.png", path=None, sha256="s1", width=2, height=3, mode="L",
                        input_mode="RGB", conversion="L->RGB (grey replicated)")
    k = media.InputFile(field="mask_image", given="m.png", path="/d/m.png", sha256="s2", width=2, height=3,
                        mode="L", input_mode="L", repaint_pixels=0)
    assert f.record() == {"path": "a.png", "sha256": "s1", "width": 2, "height": 3, "mode": "L", "input_mode": "RGB",
                          "conversion": "L->RGB (grey replicated)"}
    assert k.record()["path"] == "/d/m.png" and k.record()["repaint_pixels"] == 0
    assert f.digest() == {"sha256": "s1", "input_mode": "RGB"}
    assert media.records(None) is None and media.records({}) is None
    assert media.records({"image": [f, f], "mask_image": k}) == {"image": [f.record(), f.record()],
                                                                 "mask_image": k.record()}
    assert media.digests({"image": [f, f], "mask_image": k}) == {"image": ["s1", "s1"], "mask_image": "s2"}
    assert media.digests({"image": f.record(), "mask_image": None, "x": [{}, {"sha256": "s3"}]}) == {
        "image": "s1", "mask_image": None, "x": [None, "s3"]}
    assert media.digests(None) == {}


def test_size_rules_by_default_and_an_image_and_its_mask_both_wrong(tmp_path):
    """Kills: ``any_size`` on by default (``size_problems``, ``row_inputs``), and a wrongly sized image left unnamed
    because its mask is named (the mask alone is named once)."""
    src = tmp_path / "rows.jsonl"
    _png(tmp_path / "tall.png", np.full((16, 4, 3), 200, np.uint8))
    _png(tmp_path / "wide.png", np.full((4, 16), 255, np.uint8))
    row = _row({"image": "tall.png", "mask_image": "wide.png"})  # 8x8 row
    inputs, _ = media.row_inputs(row, "w", src, None, media.MAX_INPUT_PIXELS, any_size=True)
    probs = media.size_problems(row, inputs)
    assert probs == [
        "field 'mask_image' = 'wide.png' is 16x4, its image 'tall.png' is 4x16; fix: a mask of the image's size",
        "field 'image' = 'tall.png' is 4x16, and the row generates 8x8; the runner never resizes an input (the "
        "pipeline would resize it and the output would not show the input as given); fix: resize the file to 8x8, "
        "or set width=4 and height=16 in the row"]
    assert media.size_problems(row, inputs, any_size=True) == probs[:1]
    assert media.row_inputs(row, "w", src, None, media.MAX_INPUT_PIXELS)[1] == [f"w: {p}" for p in probs]


def test_mask_inside_and_overlay_take_rgb_masks_and_grey_images():
    rgb_mask = Image.fromarray(np.dstack([np.array([[127, 128]], np.uint8)] * 3))
    assert media.mask_inside(rgb_mask).tolist() == [[False, True]]
    grey = Image.fromarray(np.array([[51, 102]], np.uint8))
    out = media.overlay(np.ones((1, 2, 3), np.float32), grey, rgb_mask)
    assert out.shape == (1, 2, 3) and np.array_equal(out[0, 0], np.full(3, np.float32(51) / np.float32(255)))
    assert (out[0, 1] == 1).all()


def test_the_empty_mask_warning_names_only_rows_whose_mask_selects_nothing(tmp_path, caplog):
    """Kills: a warning that lists every row with an input (a non-empty mask's row included), its text changed,
    the ``...`` after exactly five rows."""
    src = tmp_path / "rows.jsonl"
    _png(tmp_path / "a.png", np.full((8, 8, 3), 1, np.uint8))
    _png(tmp_path / "black.png", np.zeros((8, 8), np.uint8))
    _png(tmp_path / "white.png", np.full((8, 8), 255, np.uint8))
    rows = [_row({"image": "a.png", "mask_image": "white.png"}, rid="full", line=1),
            *(_row({"image": "a.png", "mask_image": "black.png"}, rid=f"m{i}", line=i + 2) for i in range(5))]
    with caplog.at_level(logging.WARNING, logger="runner"):
        got = media.attach_inputs(rows, src)
    assert got[0].inputs["mask_image"].repaint_pixels == 64
    listed = ", ".join(f"{src}:{i + 2} (m{i})" for i in range(5))
    assert [r.getMessage() for r in caplog.records if r.name == "runner"] == [
        f"5 row(s) have a mask_image that selects no pixel to repaint (no grey value >= 128): {listed}; their items "
        "repaint nothing (the output is the input, or its VAE reconstruction with output.inpaint_overlay=false) "
        "and record inputs.mask_image.repaint_pixels: 0; fix: white (>= 128) where the image should change, or "
        "drop the row"]
    assert media.warn_empty_masks(got[:1], src) == []
