"""toy_shapes: the trained embedded default follows its captions, the oracle reads shapes right, and a broken
attention kernel makes accuracy collapse (the oracle catches what configuration checks cannot)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models.toy_shapes import oracle
from models.toy_shapes.data import COLORS, POSITIONS, SHAPES, caption, combos, draw, samples

REPO = Path(__file__).resolve().parent.parent


def test_generator_is_deterministic_and_covers_the_vocabulary():
    a = [(img.tobytes(), cap) for img, cap, _ in samples(20, seed=3)]
    b = [(img.tobytes(), cap) for img, cap, _ in samples(20, seed=3)]
    assert a == b
    assert a != [(img.tobytes(), cap) for img, cap, _ in samples(20, seed=4)]
    assert len(combos()) == len(COLORS) * len(SHAPES) * len(POSITIONS)
    assert caption("red", "circle", "top left") == "a red circle in the top left on a white background"


def test_oracle_reads_every_drawn_combination():
    pairs = [(oracle.read(draw(c, s, p)), {"color": c, "shape": s, "position": p}) for c, s, p in combos()]
    acc = oracle.accuracy(pairs)
    assert acc["all"] == 1.0, [(g, e) for g, e in pairs if g != e][:5]


def test_oracle_on_blank_and_noise():
    assert oracle.read(np.full((64, 64, 3), 255, np.uint8)) == {"color": None, "shape": None, "position": None}
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    got = oracle.read(noise)
    assert got["shape"] in SHAPES  # it always answers; the accuracy, not the reader, judges


def test_weights_ship_within_budget():
    w = REPO / "models/toy_shapes/weights"
    total = sum(f.stat().st_size for f in w.rglob("*") if f.is_file())
    assert (w / "model_index.json").is_file() and total <= 20 * 1024 * 1024
    assert not list(w.rglob("*.bin"))  # safetensors only


def _run(tmp_path, name, overrides, on_loaded=None):
    from _helpers import execute

    return execute(tmp_path / name, ["model=toy_shapes", "dataset.limit=12", "evidence.strict=false", *overrides],
                   on_loaded=on_loaded)


def test_default_run_follows_captions(tmp_path):
    r = _run(tmp_path, "sdpa", ["backend.attention=TORCH_SDPA"])
    acc = r.manifest["accuracy"]
    assert r.code == 0 and acc["n"] == 12
    assert acc["color"] >= 0.8 and acc["shape"] >= 0.6 and acc["position"] >= 0.8, acc


def _shuffle_keys(adapter):
    """Deliberately broken attention: the keys of every call site are permuted along the sequence."""
    import torch.nn.functional as F

    def broken(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        perm = torch.randperm(key.shape[1], generator=torch.Generator().manual_seed(0))
        q, k, v = (t.transpose(1, 2) for t in (query, key[:, perm], value))
        return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)

    for site in adapter.probes["attention"]:
        site.custom = broken


def test_broken_attention_collapses_accuracy(tmp_path, monkeypatch):
    good = _run(tmp_path, "good", ["backend.attention=TORCH_SDPA"])
    bad = _run(tmp_path, "bad", ["backend.attention=TORCH_SDPA"], on_loaded=_shuffle_keys)
    g, b = good.manifest["accuracy"], bad.manifest["accuracy"]
    assert g["all"] >= 0.8, g
    assert b["all"] <= 0.4 and b["all"] < g["all"] - 0.4, (g, b)
