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
        res = run_job(["model.adapter=flux_short_t5_test", "model.name=tiny_flux_short_t5", "dataset.limit=2",
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
