"""The rules of ``runner.core.metrics`` one by one (issue #42: tests that catch a wrong run), each written to fail
under a mutant the mutation run (``benchmarks/mutation.py``) found surviving the other tests:

* the summary: every metric named gets its entry (a metric with no score does not end the loop), every statistic
  rounded to :data:`DECIMALS` (not to an integer), quantiles equal to numpy's on asymmetric non-integer scores;
* which records are scored (:func:`needs_scoring`'s truth table) and which artifacts are checked before scoring
  (only those to score: a kept item's missing file is no problem);
* :func:`score_records` with a registered metric whose score is a known function of (image, prompt): each
  artifact paired with its own prompt, chunks of exactly ``batch_size`` (each artifact decoded once per metric),
  the scorer loaded with the run's batch size, a record without a prompt scored with the empty prompt, the model
  digest recorded, a second metric scored after a first with nothing to do;
* CLIPScore's model batch (at most ``batch_size`` images per model call, 32 by default), with the tiny CLIP;
* VBench's temporal consistency on hand-made unit vectors (2 frames are scored, 1 frame is 1.0);
* the startup checks: gate floors (> 0, finite, a registered name; every entry judged), ``check`` (no metrics
  config, duplicates, the batch size >= 1, several workers), their exact messages.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import pytest
from PIL import Image

from runner.core import metrics as M


def _png(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


# ------------------------------------------------------------------------------------------------ summary


def test_summary_rounds_to_five_decimals_and_matches_numpy_on_asymmetric_scores():
    """Kills: a statistic rounded to an integer (``round(x)``), a loop that stops at the first metric without
    scores, another quantile rule. Scores with decimals and one far outlier; a metric with none listed first."""
    vals = [0.123456789, 7.654321987, 2.5, 100.123456789, 3.333333333, 2.75]
    recs = [{"status": "ok", "metrics": {"m": v}} for v in vals]
    recs.append({"status": "failed", "metrics": {"m": -50.0}})  # not ok: left out
    s = M.summary(recs, ["none", "m"])
    assert s["none"] == {"n": 0}
    v = np.array(vals)
    want = {"n": 6, "mean": round(float(v.mean()), 5), "std": round(float(v.std()), 5),
            "min": 0.12346, "max": 100.12346, **{f"p{round(q * 100)}": round(float(np.quantile(v, q)), 5)
                                               for q in (0.1, 0.25, 0.5, 0.75, 0.9)}}
    assert s["m"] == want
    # by hand: sorted 0.123456789, 2.5, 2.75, 3.333333333, 7.654321987, 100.000004321; p50 at position 2.5:
    # (2.75 + 3.333333333) / 2; p90 at 4.5: (7.654321987 + 100.123456789) / 2; mean 116.484568... / 6
    assert s["m"]["p50"] == 3.04167 and s["m"]["p90"] == 53.88889 and s["m"]["mean"] == 19.41409
    assert list(s["m"]) == ["n", "mean", "std", "min", "p10", "p25", "p50", "p75", "p90", "max"]


# ------------------------------------------------------------------------------------------------ which records


def test_needs_scoring_truth_table():
    """Kills: an or/and swap in either condition, a skipped record counted as to score."""
    d = "digest-a"
    assert M.needs_scoring({"status": "ok", "file": "a.png"}, "m", d)
    assert not M.needs_scoring({"status": "failed", "file": "a.png"}, "m", d)  # failed, with a file
    assert not M.needs_scoring({"status": "ok"}, "m", d)  # ok, no file
    assert not M.needs_scoring({"status": "ok", "file": ""}, "m", d)
    kept = {"status": "ok", "file": "a.png", "metrics": {"m": 1.5}, "metrics_models": {"m": d}}
    assert not M.needs_scoring(kept, "m", d)
    assert M.needs_scoring(kept, "m", "digest-b")  # a score of another model: scored again
    assert M.needs_scoring({**kept, "metrics": {"m": None}}, "m", d)  # no score, this model's digest
    assert M.needs_scoring(kept, "other", d)


def test_check_artifacts_names_each_missing_or_changed_file_and_takes_an_unrecorded_sha_as_it_is(tmp_path):
    from runner.core.dataset import file_sha256

    a = _png(tmp_path / "images" / "a.png", np.zeros((4, 4, 3), np.uint8))
    b = _png(tmp_path / "images" / "b.png", np.ones((4, 4, 3), np.uint8))
    _png(tmp_path / "images" / "c.png", np.full((4, 4, 3), 9, np.uint8))
    recs = [{"file": "images/a.png", "file_sha256": file_sha256(a)},
            {"file": "images/b.png", "file_sha256": file_sha256(b)},
            {"file": "images/c.png"},  # no recorded sha: taken as it is
            {"file": "images/gone.png", "file_sha256": "0" * 64}]
    M.check_artifacts(tmp_path, recs[:3])  # all fine: no error
    _png(b, np.full((4, 4, 3), 2, np.uint8))  # b changed after the run
    with pytest.raises(M.MetricError) as e:
        M.check_artifacts(tmp_path, recs)
    assert str(e.value) == (f"{tmp_path}: artifacts to score do not match items.jsonl:\n"
                            "  images/b.png: sha256 differs from its record's file_sha256 (changed after the run)\n"
                            "  images/gone.png: missing\n"
                            "fix: restore them, or re-run (python -m runner.repro) before scoring")
    assert e.value.exit_code == 2


# ------------------------------------------------------------------------------------------------ score_records


class _Toy:
    """A registered metric whose score is a known function of (image, prompt): the mean pixel value plus 1000 times
    the prompt's length; it records the batch size it was loaded with and each call's number of artifacts."""

    def __init__(self) -> None:
        self.loads: List[Any] = []
        self.calls: List[int] = []

    def load(self, path: Path, device: Any, batch_size: int = 32) -> Any:
        self.loads.append((Path(path), device, batch_size))

        def score(arrays: List[np.ndarray], prompts: List[str]) -> List[float]:
            self.calls.append(len(arrays))
            return [float(a.mean()) + 1000.0 * len(p) for a, p in zip(arrays, prompts)]

        return score


@pytest.fixture
def toys(monkeypatch, tmp_path) -> Dict[str, Any]:
    out = {}
    for name in ("toy_a", "toy_b"):
        t = _Toy()
        monkeypatch.setitem(M.REGISTRY, name, M.Metric(name, ("image",), (), "", "file", t.load, "test"))
        (tmp_path / f"{name}.bin").write_bytes(name.encode())
        out[name] = t
    return out


def _records(tmp_path: Path, prompts: List[Any]) -> List[Dict[str, Any]]:
    from runner.core.dataset import file_sha256

    recs = []
    for i, p in enumerate(prompts):
        f = _png(tmp_path / "images" / f"{i}.png", np.full((4, 4, 3), 10 * i + 3, np.uint8))
        recs.append({"key": str(i), "status": "ok", "file": f"images/{i}.png", "prompt": p,
                     "file_sha256": file_sha256(f)})
    return recs


def test_score_records_pairs_chunks_of_batch_size_and_records_the_digest(tmp_path, toys):
    """Seven records, batch size 2: a failed one, one kept (its file since deleted: not checked, not read), one
    scored by another model (scored again), one without a prompt (the empty prompt); five to score in chunks of
    2, 2, 1, each score its own image's and prompt's."""
    prompts = ["a", "bb", "ccc", None, "eeeee", "ffffff", "g"]
    recs = _records(tmp_path, prompts)
    ms = M.MetricSet(names=["toy_a"], paths={"toy_a": tmp_path / "toy_a.bin"}, sources={"toy_a": {}}, batch_size=2)
    digest = M.model_digests(ms)["toy_a"]["sha256"]
    recs[1]["status"] = "failed"
    recs[2].update(metrics={"toy_a": -7.0}, metrics_models={"toy_a": digest})
    (tmp_path / recs[2]["file"]).unlink()  # kept: its artifact is not needed
    recs[5].update(metrics={"toy_a": -8.0}, metrics_models={"toy_a": "another model"})
    assert M.score_records(tmp_path, recs, ms, "cpu") == {"toy_a": 5}
    t = toys["toy_a"]
    assert t.loads == [(tmp_path / "toy_a.bin", "cpu", 2)]
    assert t.calls == [2, 2, 1]  # each artifact once
    want = {0: 3.0 + 1000, 3: 33.0, 4: 43.0 + 5000, 5: 53.0 + 6000, 6: 63.0 + 1000}
    assert {i: recs[i]["metrics"]["toy_a"] for i in want} == want
    assert all(recs[i]["metrics_models"] == {"toy_a": digest} for i in want)
    assert recs[2]["metrics"] == {"toy_a": -7.0} and "metrics" not in recs[1]


def test_score_records_scores_a_metric_after_one_with_nothing_to_do(tmp_path, toys):
    recs = _records(tmp_path, ["a", "bb", "ccc"])
    ms = M.MetricSet(names=["toy_a", "toy_b"], paths={n: tmp_path / f"{n}.bin" for n in ("toy_a", "toy_b")},
                     sources={"toy_a": {}, "toy_b": {}}, batch_size=3)
    dig = M.model_digests(ms)
    assert dig["toy_a"]["sha256"] != dig["toy_b"]["sha256"]
    for r in recs:
        r.update(metrics={"toy_a": 1.0}, metrics_models={"toy_a": dig["toy_a"]["sha256"]})
    assert M.score_records(tmp_path, recs, ms, "cpu") == {"toy_a": 0, "toy_b": 3}
    assert toys["toy_a"].loads == []  # nothing to score: not loaded
    assert [r["metrics"] for r in recs] == [{"toy_a": 1.0, "toy_b": 3.0 + 1000}, {"toy_a": 1.0, "toy_b": 13.0 + 2000},
                                            {"toy_a": 1.0, "toy_b": 23.0 + 3000}]
    assert recs[0]["metrics_models"] == {"toy_a": dig["toy_a"]["sha256"], "toy_b": dig["toy_b"]["sha256"]}


def test_score_records_rounds_to_decimals(tmp_path, monkeypatch):
    monkeypatch.setitem(M.REGISTRY, "toy_r", M.Metric("toy_r", ("image",), (), "", "file",
                                                      lambda p, d, b=32: (lambda a, pr: [1 / 3] * len(a)), "test"))
    (tmp_path / "m.bin").write_bytes(b"m")
    recs = _records(tmp_path, ["a"])
    ms = M.MetricSet(names=["toy_r"], paths={"toy_r": tmp_path / "m.bin"}, sources={"toy_r": {}}, batch_size=4)
    M.model_digests(ms)
    M.score_records(tmp_path, recs, ms, "cpu")
    assert recs[0]["metrics"]["toy_r"] == 0.33333


# ------------------------------------------------------------------------------------------------ CLIP batches


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    from _helpers import tiny_clip

    return tiny_clip(tmp_path_factory.mktemp("clip_rules") / "clip")


def test_clip_score_calls_the_model_with_at_most_batch_size_images(clip, monkeypatch):
    """Kills: the scorer built without the batch size it was given, or with another default than 32."""
    sizes: List[int] = []
    orig = M.ClipScorer._tensors

    def spy(self, arrays):
        sizes.append(len(arrays))
        return orig(self, arrays)

    monkeypatch.setattr(M.ClipScorer, "_tensors", spy)
    rng = np.random.default_rng(1)
    images = list(rng.integers(0, 256, (33, 32, 32, 3), dtype=np.uint8))
    prompts = ["a red circle"] * 33
    by2 = M.REGISTRY["clip_score"].load(clip, "cpu", 2)(images[:5], prompts[:5])
    assert sizes == [2, 2, 1]
    sizes.clear()
    default = M.REGISTRY["clip_score"].load(clip, "cpu")(images, prompts)
    assert sizes == [32, 1]
    assert default[:5] == pytest.approx(by2, abs=1e-9)


# ------------------------------------------------------------------------------------------------ temporal


def test_temporal_consistency_of_two_and_one_frames():
    """Kills: two frames taken as a still video (``len < 3``), another value than 1.0 for one frame."""
    e = np.eye(4)
    assert M.temporal_consistency(e[[0, 1]]) == 0.0  # orthogonal: (0 + 0) / 2
    c = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])  # cos(1,0) = .6, cos(2,0) = 0, cos(2,1) = .8
    assert M.temporal_consistency(c) == pytest.approx(((0.6 + 0.6) / 2 + (0.0 + 0.8) / 2) / 2)
    assert M.temporal_consistency(e[[2]]) == 1.0


# ------------------------------------------------------------------------------------------------ startup checks


def _floor_msg(k: str, v: Any, key: str = "report.min_metric_ratio") -> str:
    return (f"{key}: {k}={v!r} must name a metric ({', '.join(M.REGISTRY)}) with a ratio > 0; fix: "
            f"{key}.clip_score=0.99")


def test_floor_problems_judge_every_entry():
    """Kills: a loop ending at an ungated entry, ``>= 0`` / ``> 1`` for ``> 0``, infinity accepted, an unknown name
    accepted with a good ratio, a ratio that is no number accepted."""
    assert M.floor_problems({"clip_score": None, "pick_score": 0.5, "aesthetic": 1.5, "hpsv2": "0.9"}) == []
    bad = {"clip_score": None, "pick_score": 0, "aesthetic": math.inf, "hpsv2": "abc", "nope": 0.5,
           "image_reward": -0.1, "temporal_consistency": [1]}
    assert M.floor_problems(bad) == [_floor_msg(k, v) for k, v in bad.items() if k != "clip_score"]
    assert M.floor_problems({"x": 1}, "gate.floors") == [_floor_msg("x", 1, "gate.floors")]


def _clip_dir(path: Path) -> Path:
    """A dir with the files a CLIP metric model must hold (checked by name at startup, not loaded)."""
    path.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        (path / f).write_text("{}")
    return path


def _cfg(names: List[str], models: Dict[str, Any], batch_size: Any = 32) -> Any:
    return SimpleNamespace(names=names, models=models, batch_size=batch_size)


def test_check_returns_the_checked_set_and_refuses_each_problem_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: object())  # packages: as installed
    d = _clip_dir(tmp_path / "clip")
    assert M.check(None, "image") is None
    assert M.check(_cfg([], {"clip_score": None}), "image") is None
    ms = M.check(_cfg(["clip_score", "pick_score"], {"clip_score": str(d), "pick_score": str(d)}, "1"), "image")
    assert (ms.names, ms.paths, ms.batch_size) == (["clip_score", "pick_score"], {"clip_score": d, "pick_score": d}, 1)
    assert ms.sources == {n: {"kind": "path", "path": str(d.resolve()), "revision": None}
                          for n in ("clip_score", "pick_score")}
    with pytest.raises(M.MetricError) as e:
        M.check(None, "image", floors={"clip_score": 0})
    assert str(e.value) == "metrics cannot run:\n  " + _floor_msg("clip_score", 0)
    with pytest.raises(M.MetricError) as e:  # a name set, no model: refused, not "no metrics"
        M.check(_cfg(["clip_score"], {}), "image")
    assert "metrics.models.clip_score is not set" in str(e.value)
    with pytest.raises(M.MetricError) as e:
        M.check(_cfg(["clip_score", "clip_score"], {"clip_score": str(d)}, 0), "image", data_parallel=True)
    assert str(e.value) == (
        "metrics cannot run:\n"
        "  metrics.names lists a metric twice (['clip_score', 'clip_score']); fix: each once\n"
        "  metrics.batch_size=0 must be >= 1; fix: metrics.batch_size=32\n"
        "  metrics with several workers are not scored during the run; fix: drop metrics.names and score the "
        "merged run dir afterwards: python -m runner.score <run dir> --metrics ...")


_WANT_CLIP = ("a dir holding a transformers CLIPModel (config.json, *.safetensors) saved with its CLIPProcessor "
              "(preprocessor_config.json or processor_config.json, tokenizer files), or a Hub id in the local cache")


def test_model_problems_name_the_key_the_value_and_the_fix(tmp_path, monkeypatch):
    """Kills: the ``want`` text of the other model kind, a file taken as a CLIP dir (and the reverse), a processor /
    tokenizer file accepted by a set union, a file name misspelt, a Hub id read as a missing path."""
    clip, reward, aes = M.REGISTRY["clip_score"], M.REGISTRY["image_reward"], M.REGISTRY["aesthetic"]
    assert M._model_problems(clip, None)[0] == [f"metrics.models.clip_score is not set; metric clip_score needs "
                                                f"{_WANT_CLIP}; fix: metrics.models.clip_score=<path>"]
    assert M._model_problems(reward, "")[0] == ["metrics.models.image_reward is not set; metric image_reward needs "
                                                "the metric's checkpoint file; fix: metrics.models.image_reward=<path>"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    lacks = ("lacks config.json, *.safetensors, preprocessor_config.json or processor_config.json, tokenizer.json or "
             f"vocab.json; fix: {_WANT_CLIP} (e.g. CLIPModel.save_pretrained and CLIPProcessor.save_pretrained into "
             "one dir)")
    assert M._model_problems(clip, str(empty)) == ([f"metrics.models.clip_score={str(empty)!r} {lacks}"], None, {})
    ckpt = tmp_path / "reward.pt"
    ckpt.write_bytes(b"x")
    assert M._model_problems(clip, str(ckpt))[0] == [f"metrics.models.clip_score={str(ckpt)!r} {lacks}"]
    assert M._model_problems(reward, str(empty))[0] == [
        f"metrics.models.image_reward={str(empty)!r} is not a file; fix: the metric's checkpoint file"]
    path, source = M._model_problems(reward, str(ckpt))[1:]
    assert M._model_problems(reward, str(ckpt))[0] == [] and path == ckpt and source["kind"] == "path"
    for files in (("config.json", "a.safetensors", "preprocessor_config.json", "tokenizer.json"),
                  ("config.json", "b.safetensors", "processor_config.json", "vocab.json")):
        d = tmp_path / files[-1]
        d.mkdir()
        for f in files:
            (d / f).write_text("{}")
        assert M._model_problems(clip, str(d)) == ([], d, {"kind": "path", "path": str(d.resolve()), "revision": None})
        assert M._model_problems(aes, str(d))[0] == [
            f"metrics.models.aesthetic={str(d)!r} lacks aesthetic_head.safetensors (the predictor's MLP: "
            "layers.{0,2,4,6,7}.weight/bias); fix: save the head's state dict there with safetensors (a .pth is "
            "pickle, never loaded) beside the CLIP ViT-L/14 it was trained on"]
        for f in files[1:]:  # each file is needed
            d2 = tmp_path / f"without_{f}_{files[-1]}"
            d2.mkdir()
            for g in files:
                if g != f:
                    (d2 / g).write_text("{}")
            assert M._model_problems(clip, str(d2))[0], (f, files)
    missing = tmp_path / "nowhere"
    assert M._model_problems(clip, str(missing))[0] == [f"metrics.models.clip_score={str(missing)!r} does not exist; "
                                                        f"fix: {_WANT_CLIP}"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache: a Hub id is looked up, not found
    (tmp_path / "hub").mkdir()
    got = M._model_problems(clip, "nobody-x/no-such-model")[0]
    assert len(got) == 1 and got[0].startswith("metrics.models.clip_score='nobody-x/no-such-model': ") and \
        "does not exist; fix" not in got[0] and str(tmp_path / "hub") in got[0], got


def test_problems_lists_every_name_with_its_fix(tmp_path, monkeypatch):
    """Kills: a loop ending at a refused name, the closest-name hint given where none is close, the wrong kinds
    listed as the alternatives, an unset ``metrics.models`` key reported as set."""
    real = M.importlib.util.find_spec
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None if name == "hpsv2" else real(name))
    d = _clip_dir(tmp_path / "clip")
    reg = ", ".join(M.REGISTRY)
    got = M.problems(["pick_score", "zzzz", "clip_scor", "hpsv2", "clip_score", "temporal_consistency"],
                     {"clip_score": str(d), "temporal_consistency": str(d), "aesthetic": str(d), "pick_score": None,
                      "hpsv2": None}, "video")
    assert got == [
        "metrics.names: pick_score scores image artifacts, this run writes video; fix: drop pick_score or use one of "
        "clip_score, temporal_consistency",
        f"metrics.names: unknown metric 'zzzz'; fix: one of {reg}",
        f"metrics.names: unknown metric 'clip_scor'; fix: did you mean clip_score? one of {reg}",
        "metrics.names: hpsv2 scores image artifacts, this run writes video; fix: drop hpsv2 or use one of "
        "clip_score, temporal_consistency",
        "metrics.models.aesthetic is set but aesthetic is not in metrics.names; fix: metrics.names=[...,aesthetic] "
        "or drop it"]
    assert M.problems(["hpsv2", "clip_score"], {"clip_score": str(d)}, "image") == [
        "metrics.names: hpsv2 needs the package(s) hpsv2, not installed; fix: pip install hpsv2"]
    assert M.problems(["clip_score"], {"clip_score": str(d)}, "image") == []


def test_score_journal_rewrites_the_journal_in_order_and_reports_scored_and_kept(tmp_path, toys):
    """Kills: a journal not rewritten (or reordered), ``scored`` / ``kept`` / ``summary`` of other records, a
    ``rescore`` that keeps old scores, a journal rewritten although an artifact to score is missing."""
    import json

    recs = _records(tmp_path, ["a", "bb", "ccc", "dddd"])
    ms = M.MetricSet(names=["toy_a"], paths={"toy_a": tmp_path / "toy_a.bin"}, sources={"toy_a": {"kind": "x"}},
                     batch_size=2)
    digest = M.model_digests(ms)["toy_a"]["sha256"]
    recs[1].update(metrics={"toy_a": -7.0}, metrics_models={"toy_a": digest})
    recs[3]["status"] = "failed"
    journal = tmp_path / "items.jsonl"
    journal.write_text("".join(json.dumps(r) + "\n" for r in recs))
    sec = M.score_journal(tmp_path, "items.jsonl", ms, "cpu", cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache" / "weight_digests.json").is_file()  # the digest cache where the run keeps it
    assert [ld[1:] for ld in toys["toy_a"].loads] == [("cpu", 2)]  # the run's device and batch size
    got = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [r["key"] for r in got] == ["0", "1", "2", "3"]
    assert [(r.get("metrics") or {}).get("toy_a") for r in got] == [1003.0, -7.0, 3023.0, None]
    assert got[0]["metrics_models"] == {"toy_a": digest}
    assert {k: sec[k] for k in ("names", "device", "batch_size", "scored", "kept")} == {
        "names": ["toy_a"], "device": "cpu", "batch_size": 2, "scored": {"toy_a": 2}, "kept": {"toy_a": 1}}
    assert sec["models"]["toy_a"]["sha256"] == digest and sec["models"]["toy_a"]["source"] == {"kind": "x"}
    assert sec["summary"] == M.summary(got, ["toy_a"]) and sec["summary"]["toy_a"]["n"] == 3
    assert isinstance(sec["score_s"], float) and 0 <= sec["score_s"] < 60
    assert sec["score_s"] == round(sec["score_s"], 3)  # milliseconds
    again = M.score_journal(tmp_path, "items.jsonl", ms, "cpu", rescore=True)
    assert (again["scored"], again["kept"]) == ({"toy_a": 3}, {"toy_a": 0})
    got = [json.loads(x) for x in journal.read_text().splitlines()]
    assert [(r.get("metrics") or {}).get("toy_a") for r in got] == [1003.0, 2013.0, 3023.0, None]
    (tmp_path / recs[0]["file"]).unlink()
    before = journal.read_bytes()
    with pytest.raises(M.MetricError, match="images/0.png: missing"):
        M.score_journal(tmp_path, "items.jsonl", ms, "cpu", rescore=True)
    assert journal.read_bytes() == before


def test_pick_score_is_the_logit_scale_times_the_cosine(clip):
    """PickScore's README formula ``logit_scale.exp() * cos(E_I, E_C)``, recomputed with transformers (float64)."""
    import torch
    from transformers import CLIPModel, CLIPProcessor

    from _helpers import clip_cosines

    rng = np.random.default_rng(4)
    images = list(rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8))
    prompts = ["a red circle", "a blue square", "x"]
    model, proc = CLIPModel.from_pretrained(clip).double().eval(), CLIPProcessor.from_pretrained(clip)
    with torch.no_grad():
        model.logit_scale.fill_(1.5)  # another scale than the init's log(1 / 0.07): the scale is read, not assumed
    model.save_pretrained(clip.parent / "pick", safe_serialization=True)
    proc.save_pretrained(clip.parent / "pick")
    want = [math.exp(1.5) * c for c in clip_cosines(model, proc, images, prompts)]
    got = M.REGISTRY["pick_score"].load(clip.parent / "pick", "cpu", 2)(images, prompts)
    assert got == pytest.approx(want, abs=1e-9) and len(set(got)) == 3


def test_register_refuses_a_name_twice(monkeypatch):
    monkeypatch.setattr(M, "REGISTRY", dict(M.REGISTRY))
    m = M.Metric("toy_new", ("image",), (), "", "file", lambda *a: None, "test")
    assert M.register(m) is m and M.REGISTRY["toy_new"] is m
    with pytest.raises(ValueError, match="^metric 'toy_new' is registered already$"):
        M.register(M.Metric("toy_new", ("video",), (), "", "file", lambda *a: None, "test"))
    assert M.REGISTRY["toy_new"] is m


def test_model_digests_cover_the_files_by_relative_path_and_the_metric_name(tmp_path):
    """Kills: a file model hashed as an (empty) dir, paths relative to another root, another file pattern, a digest
    over unsorted keys or without the metric's name, the digest cache written elsewhere."""
    import hashlib
    import json

    d = tmp_path / "clip"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_bytes(b"{}")
    (d / "sub" / "w.bin").write_bytes(b"weights")
    ck = tmp_path / "reward.pt"
    ck.write_bytes(b"ckpt")
    ms = M.MetricSet(names=["clip_score", "image_reward"], paths={"clip_score": d, "image_reward": ck},
                     sources={"clip_score": {"kind": "path"}, "image_reward": {"kind": "file"}}, batch_size=1)
    got = M.model_digests(ms, tmp_path / "cache")
    h = {b: hashlib.sha256(b).hexdigest() for b in (b"{}", b"weights", b"ckpt")}
    files = {"clip_score": {"config.json": h[b"{}"], "sub/w.bin": h[b"weights"]},
             "image_reward": {"reward.pt": h[b"ckpt"]}}
    for n in ms.names:
        whole = hashlib.sha256(json.dumps({"files": files[n], "metric": n}).encode()).hexdigest()
        assert got[n] == {"source": ms.sources[n], "files": files[n], "sha256": whole}
    assert ms.digests is got and (tmp_path / "cache" / "weight_digests.json").is_file()


def test_load_artifact_decodes_a_grey_png_as_rgb_and_an_mp4_as_its_frames(tmp_path):
    from runner.core import video

    grey = np.arange(48, dtype=np.uint8).reshape(6, 8)
    _png(tmp_path / "g.png", grey)
    a = M.load_artifact(tmp_path / "g.png")
    assert a.dtype == np.uint8 and a.shape == (6, 8, 3) and np.array_equal(a, np.dstack([grey] * 3))
    frames = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    video.write_video(tmp_path / "v.mp4", frames, 8, "h264_lossless")
    assert np.array_equal(M.load_artifact(tmp_path / "v.mp4"), video.decode_mp4(tmp_path / "v.mp4"))
    assert M.load_artifact(tmp_path / "v.mp4").shape == (3, 16, 16, 3)


def test_aesthetic_head_refuses_a_state_dict_with_an_extra_or_a_missing_layer():
    import torch

    dims = [16, *M.AESTHETIC_WIDTHS]
    state = {}
    for i, (a, b) in zip(M.AESTHETIC_LINEARS, zip(dims[:-1], dims[1:])):
        state[f"layers.{i}.weight"], state[f"layers.{i}.bias"] = torch.ones(b, a), torch.zeros(b)
    head = M.aesthetic_head(state)
    assert not head.training and head(torch.ones(2, 16)).shape == (2, 1)
    with pytest.raises(RuntimeError, match="layers.9.weight|9.weight"):
        M.aesthetic_head({**state, "layers.9.weight": torch.ones(1, 1)})
    with pytest.raises(RuntimeError, match="7.bias"):
        M.aesthetic_head({k: v for k, v in state.items() if k != "layers.7.bias"})


def test_every_clip_metric_is_built_with_the_batch_size_it_is_given(clip, tmp_path, monkeypatch):
    """Kills: a loader that drops the run's batch size (or changes the default 32) for its CLIP model."""
    import shutil

    import torch
    from safetensors.torch import save_file

    model_dir = tmp_path / "aes"
    shutil.copytree(clip, model_dir)
    dims = [16, *M.AESTHETIC_WIDTHS]
    save_file({f"layers.{i}.{k}": (torch.zeros(b, a) if k == "weight" else torch.zeros(b))
               for i, (a, b) in zip(M.AESTHETIC_LINEARS, zip(dims[:-1], dims[1:])) for k in ("weight", "bias")},
              str(model_dir / M.AESTHETIC_HEAD))
    sizes: List[int] = []
    orig = M.ClipScorer.__init__

    def spy(self, path, device, batch_size=32):
        sizes.append(batch_size)
        orig(self, path, device, batch_size)

    monkeypatch.setattr(M.ClipScorer, "__init__", spy)
    for name in ("clip_score", "pick_score", "temporal_consistency", "aesthetic"):
        sizes.clear()
        M.REGISTRY[name].load(model_dir, "cpu", 3)
        M.REGISTRY[name].load(model_dir, "cpu")
        assert sizes == [3, 32], name


def test_clip_scorer_defaults_empty_input_long_prompts_and_safetensors_only(clip, tmp_path):
    """Kills: another default batch size, an empty input that fails (or scores one item), the model's config hidden
    from torchmetrics (a prompt longer than the text tower's 77 positions is then not truncated: an index error), a
    pickled ``pytorch_model.bin`` loaded where only safetensors may be."""
    import shutil

    import torch
    from transformers import CLIPModel

    sc = M.ClipScorer(clip, "cpu")
    assert sc.batch_size == 32
    assert sc.clip_scores([], []).shape == (0,)
    img = np.random.default_rng(6).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    long = " ".join(["a red circle in the top left"] * 30)  # > 77 tokens
    s = sc.clip_scores([img, img], [long, "a red circle"])
    assert s.shape == (2,) and np.isfinite(s).all()
    pickled = tmp_path / "pickled"
    shutil.copytree(clip, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(CLIPModel.from_pretrained(clip).state_dict(), pickled / "pytorch_model.bin")
    assert (pickled / "pytorch_model.bin").is_file() and not list(pickled.glob("*.safetensors"))
    with pytest.raises(OSError):
        M.ClipScorer(pickled, "cpu")


def test_problems_join_kinds_and_packages(monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    assert M.problems(["clip_score"], {}, "text") == [
        "metrics.names: clip_score scores image/video artifacts, this run writes text; fix: drop clip_score or use "
        "one of "]
    assert M.problems(["clip_score"], {}, "image") == [
        "metrics.names: clip_score needs the package(s) torchmetrics, transformers, not installed; fix: pip install "
        "torchmetrics transformers"]
    with pytest.raises(M.MetricError) as e:
        M.check(None, "image", floors={"clip_score": 0, "pick_score": -1})
    assert str(e.value) == ("metrics cannot run:\n  " + _floor_msg("clip_score", 0) + "\n  "
                            + _floor_msg("pick_score", -1))
