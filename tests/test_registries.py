"""The growth points of issue #39 are registries, each extended by one record and no edit elsewhere: a tokenizer kind
(``models.tokenizer_kinds``), an image output format (``runner.core.sinks.IMAGE_FORMATS``) and a dataset source
(``runner.core.dataset.READERS``). Each test adds its record for its own duration and runs the real code path."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytestmark = pytest.mark.cpu


# ------------------------------------------------------------------------------------------ tokenizer kinds
def _short_t5(corpus, vocab, tcfg):
    """A T5-style stand-in whose encoder sees at most ``tcfg['short_length']`` tokens (default 12)."""
    from models.tokenizers import build_t5_tokenizer

    return build_t5_tokenizer(corpus, vocab, max_length=int(tcfg.get("short_length", 12)))


def test_a_family_with_a_new_tokenizer_kind_is_one_record(run_job):
    """A FLUX-architecture family whose second encoder takes a kind the project does not ship: one
    ``TokenizerKind`` record (builder, encoder ids, fixed length) and the spec naming it; the run builds that
    tokenizer, sizes the encoder by the record's rule, and records its tokens against the record's fixed limit."""
    from models import tokenizer_kinds as tk
    from models.flux import FLUX
    from models.registry import register_family, unregister_family

    seen = []

    def encoder(tok, kw):
        seen.append(len(tok))
        return tk.t5_ids(tok, kw)

    tk.register(tk.TokenizerKind("short_t5_test", _short_t5, encoder, fixed_length=True))
    spec = dataclasses.replace(FLUX, name="flux_short_t5_test",
                               tokenizers={**FLUX.tokenizers, "tokenizer_2": ("short_t5_test", "t5", "text_encoder_2")})
    register_family(spec)
    try:
        res = run_job(["model.engine=flux_short_t5_test", "model.name=tiny_flux_short_t5", "dataset.limit=2",
                       "model.generation.num_inference_steps=2", "evidence.profile=false"])
        assert res.code == 0, res.manifest.get("error")
        assert seen, "the record's encoder rule was not used to size text_encoder_2"
        for it in res.items:
            t5 = it["tokens"]["t5"]
            assert t5["limit"] == 12  # the record's fixed length, not model.generation.max_sequence_length
            assert t5["dropped"] == max(0, t5["count"] - 12)
        assert any(it["tokens"]["t5"]["dropped"] > 0 for it in res.items)
    finally:
        unregister_family("flux_short_t5_test")
        tk.KINDS.pop("short_t5_test", None)


def test_an_unregistered_tokenizer_kind_is_refused_at_declaration():
    from models import family as fam

    with pytest.raises(ValueError, match=r"tokenizer kinds \['sentencepiece_x'\] are not registered.*fix: register"):
        fam.FamilySpec(name="x", tasks={"text_to_image": "FluxPipeline"}, components={},
                       tokenizers={"tokenizer": ("sentencepiece_x", "sp", "text_encoder")}, cfg="none")


# ------------------------------------------------------------------------------------------ image formats
def _bmp(image, text):
    """BMP bytes of an HWC float image (PIL; lossless, no text fields)."""
    import io

    from PIL import Image

    from runner.core.artifacts import to_uint8

    buf = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(buf, format="BMP")
    return buf.getvalue()


def test_a_new_image_format_is_one_record(run_job):
    """One ``ImageFormat`` record (suffix, encoder) and ``output.image_format`` naming it: the run writes
    ``images/<id>.bmp`` with the same pixels as the PNG run, records its sha256, and the format enters the identity."""
    import hashlib

    import numpy as np
    from PIL import Image

    from runner.core import sinks

    sinks.IMAGE_FORMATS["bmp_test"] = sinks.ImageFormat("bmp_test", ".bmp", _bmp)
    try:
        args = ["dataset.limit=2", "model.generation.num_inference_steps=2", "evidence.profile=false"]
        png = run_job(args, name="png")
        bmp = run_job([*args, "output.image_format=bmp_test"], name="bmp")
    finally:
        sinks.IMAGE_FORMATS.pop("bmp_test", None)
    assert png.code == 0 and bmp.code == 0, bmp.manifest.get("error")
    by_key = {it["key"]: it for it in png.items}
    assert len(bmp.items) == len(by_key) == 2
    for it in bmp.items:
        f = bmp.run_dir / it["file"]
        assert it["file"] == f"images/{it['key']}.bmp" and f.read_bytes()[:2] == b"BM"
        assert it["file_sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
        want = np.asarray(Image.open(png.run_dir / by_key[it["key"]]["file"]).convert("RGB"))
        assert np.array_equal(np.asarray(Image.open(f).convert("RGB")), want)
        assert it["inputs_sha256"] != by_key[it["key"]]["inputs_sha256"]  # the format is part of the identity
    assert not list((bmp.run_dir / "images").glob("*.png"))


def test_an_unknown_image_format_is_refused_at_startup(run_job, tmp_path):
    from runner.core.errors import ConfigValueError

    with pytest.raises(ConfigValueError, match=r"output.image_format='jpeg2000' is not a registered image format; "
                                               r"fix: one of png"):
        run_job(["dataset.limit=1", "output.image_format=jpeg2000"], name="bad")
    assert not list(tmp_path.glob("bad/images/*"))  # refused before anything was generated


# ------------------------------------------------------------------------------------------ dataset sources
def _read_tsv(path, split=None, columns=None):
    """Tab-separated rows under a header line (a source the project does not ship)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    head = lines[0].split("\t")
    return [(n, {k: v for k, v in zip(head, line.split("\t")) if v}) for n, line in enumerate(lines[1:], 2)]


def test_a_new_dataset_source_is_one_record(tmp_path):
    """One ``Reader`` record (its function, text cells, a file path): ``load_rows`` reads through it, its text cells
    are typed by the row spec, ``dataset.columns`` maps its columns, and a bad cell is named with file:line."""
    from runner.core import dataset as ds
    from runner.core import readers
    from runner.core.errors import DatasetError

    defaults = dict(width=64, height=64, num_inference_steps=4, guidance_scale=3.5, num_images_per_prompt=1,
                    negative_prompt=None)
    path = tmp_path / "rows.tsv"
    path.write_text("id\tcaption\tseed\twidth\na\ta red fox, asleep\t7\t32\nb\ta lighthouse\t\t\n", encoding="utf-8")
    readers.READERS["tsv_test"] = readers.Reader("tsv_test", _read_tsv, from_text=True)
    try:
        rows, src = ds.load_rows("tsv_test", str(path), defaults=defaults, size_multiple=16, max_pixels=1 << 20,
                                 columns={"prompt": "caption"})
        assert src == path
        assert [(r.id, r.prompt, r.seed, r.width, r.line) for r in rows] == [
            ("a", "a red fox, asleep", 7, 32, 2), ("b", "a lighthouse", None, 64, 3)]
        path.write_text("id\tcaption\tseed\na\ta cat\tseven\n", encoding="utf-8")
        with pytest.raises(DatasetError, match=r"rows.tsv:2: field 'seed' = 'seven' is not an integer"):
            ds.load_rows("tsv_test", str(path), defaults=defaults, size_multiple=16, max_pixels=1 << 20,
                         columns={"prompt": "caption"})
        with pytest.raises(DatasetError, match=r"dataset.path: required for dataset=tsv_test; fix: "
                                               r"dataset.path=/path/to/prompts.tsv_test"):
            ds.source_path("tsv_test", None, "prompts.jsonl")
    finally:
        readers.READERS.pop("tsv_test", None)
    with pytest.raises(DatasetError, match=r"dataset.format='tsv_test' is not known; fix: one of builtin, jsonl"):
        ds.read_raw("tsv_test", path)


def test_the_schema_choices_are_the_registered_sources():
    """``dataset.format``'s compose-time choices are the registry's names (a shipped source is one record)."""
    from runner.core import readers, schema

    assert [f.value for f in schema.DatasetFormat] == list(readers.READERS)
