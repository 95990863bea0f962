"""Per-item quality metrics (issue #33 A, ``runner.core.metrics``), scored with tiny random CLIP models built and
saved here (``tests/_helpers.tiny_clip``): the plumbing, the determinism and the gate's arithmetic, not meaning.

One real CPU sweep through ``python -m runner -m`` on the trained toy_shapes (4 rows, ``cache={none},{taylorseer}``)
scored during the run with ``clip_score``:

* every ok record carries its score and the metric model's digest; ``metadata.jsonl`` the same scores; the manifest
  the model's file sha256 (recomputed here with hashlib) and the summary of exactly these scores;
* each score is CLIPScore recomputed here from the PNG on disk with transformers' CLIPModel (100 * cos of the
  projected embeddings), so a wrong image, prompt or formula fails;
* ``python -m runner.score`` on the run dir with the scores removed (an old run dir) gives the same scores, at
  another batch size;
* the sweep's own gate applies ``report.min_metric_ratio``; ``runner.gate --min-metric-ratio`` passes at the
  measured ratio and fails just above it (exit 1, the reason names the metric); a metric not scored fails naming
  ``runner.score``;
* ``report.html`` shows the metric column, the histograms and the speed/quality plot.

Beside it: refusals at startup, a resumed run (scores kept, new items scored), the GenEval-style recipe file, a
toy_motion run (MP4 frames scored), the gate's ratio arithmetic on synthetic records.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

from _helpers import execute, requires_extra, run_module, skip_without_extra, tiny_clip

SWEEP = ["model=toy_shapes", "platform=cpu", "dataset.limit=4",
         "cache={method:none},{method:taylorseer,compute_every:2,warmup_steps:3}"]




def _lines(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    return tiny_clip(tmp_path_factory.mktemp("metric_models") / "clip")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, clip) -> Path:
    root = tmp_path_factory.mktemp("metrics_sweep")
    p = run_module("runner", ["-m", *SWEEP, "metrics.names=[clip_score]", f"metrics.models.clip_score={clip}",
                           "report.min_metric_ratio.clip_score=0.5", f"hydra.sweep.dir={root / 'sweep'}"], cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return root / "sweep"


def _job(sweep: Path, lossy: bool) -> Path:
    for d in sorted(p for p in sweep.iterdir() if (p / "manifest.json").is_file()):
        if json.loads((d / "manifest.json").read_text())["lossy"]["lossy"] == lossy:
            return d
    raise AssertionError(f"no {'lossy' if lossy else 'lossless'} job in {sweep}")


def _reference_clip_scores(clip: Path, run_dir: Path, records: List[Dict[str, Any]]) -> List[float]:
    """CLIPScore of each record's PNG and prompt, computed here with transformers alone."""
    import torch
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(clip).eval(), CLIPProcessor.from_pretrained(clip)
    images = [Image.open(run_dir / r["file"]).convert("RGB") for r in records]
    with torch.no_grad():
        px = proc(images=images, return_tensors="pt")["pixel_values"]
        tx = proc(text=[r["prompt"] for r in records], return_tensors="pt", padding=True)
        ei = model.vision_model(pixel_values=px).pooler_output
        ei = model.visual_projection(ei)
        et = model.text_projection(model.text_model(**tx).pooler_output)
    cos = torch.nn.functional.cosine_similarity(ei.double(), et.double(), dim=-1)
    return [max(100.0 * float(c), 0.0) for c in cos]


def test_scores_are_written_per_item_and_summarised(sweep, clip):
    run = _job(sweep, lossy=False)
    recs = [r for r in _lines(run / "items.jsonl") if r["status"] == "ok"]
    man = json.loads((run / "manifest.json").read_text())
    sec = man["metrics"]
    assert len(recs) == 4 and sec["names"] == ["clip_score"] and sec["scored"] == {"clip_score": 4}
    files = {p.relative_to(clip).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(clip.rglob("*")) if p.is_file()}
    assert sec["models"]["clip_score"]["files"] == files
    digest = sec["models"]["clip_score"]["sha256"]
    assert all(r["metrics_models"] == {"clip_score": digest} for r in recs)
    scores = [r["metrics"]["clip_score"] for r in recs]
    assert len(set(scores)) == 4 and all(s > 0 for s in scores)  # the tiny CLIP tells the items apart
    ref = _reference_clip_scores(clip, run, recs)
    assert scores == pytest.approx(ref, abs=1e-3)
    summ = sec["summary"]["clip_score"]
    assert summ["n"] == 4 and summ["mean"] == pytest.approx(np.mean(scores), abs=1e-5)
    assert summ["p50"] == pytest.approx(np.median(scores), abs=1e-5) and summ["min"] == min(scores)
    meta = {m["key"]: m["metrics"] for m in _lines(run / "images" / "metadata.jsonl")}
    assert meta == {r["key"]: r["metrics"] for r in recs}
    from runner.app.tracking import metrics_of

    assert metrics_of(man)["metrics.clip_score.mean"] == summ["mean"]
    from runner.tools.validate import main as validate

    skip_without_extra("validate")  # the checks above ran; the schema validation needs jsonschema
    assert validate([str(run)]) == 0


def test_runner_score_on_an_old_run_dir_gives_the_run_time_scores(sweep, clip, tmp_path):
    run = _job(sweep, lossy=True)
    old = tmp_path / "old"
    shutil.copytree(run, old)
    recs = _lines(old / "items.jsonl")
    during = {r["key"]: r["metrics"]["clip_score"] for r in recs if r["status"] == "ok"}
    for r in recs:  # a run dir written without metrics
        r.pop("metrics", None), r.pop("metrics_models", None)
    (old / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    man = json.loads((old / "manifest.json").read_text())
    man.pop("metrics")
    (old / "manifest.json").write_text(json.dumps(man))
    p = run_module("runner.score", [old, "--metrics", "clip_score", "--model", f"clip_score={clip}", "--batch-size", "3",
                                 "--device", "cpu"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    after = {r["key"]: r["metrics"]["clip_score"] for r in _lines(old / "items.jsonl") if r["status"] == "ok"}
    assert after == during
    sec = json.loads((old / "manifest.json").read_text())["metrics"]
    assert sec["scored_by"]["tool"] == "runner.score" and sec["scored"] == {"clip_score": 4}
    assert sec["models"] == json.loads((run / "manifest.json").read_text())["metrics"]["models"]
    assert {m["key"]: m["metrics"]["clip_score"] for m in _lines(old / "images" / "metadata.jsonl")} == during
    # scored again: nothing to do, every item keeps its score (same model digest)
    p = run_module("runner.score", [old, "--metrics", "clip_score", "--model", f"clip_score={clip}"], cwd=tmp_path)
    assert p.returncode == 0 and json.loads(p.stdout)["kept"] == {"clip_score": 4}


def test_another_metric_model_rescores(sweep, tmp_path):
    from runner.tools.score import score_dir

    run = tmp_path / "run"
    shutil.copytree(_job(sweep, lossy=False), run)
    before = {r["key"]: r["metrics"]["clip_score"] for r in _lines(run / "items.jsonl") if r["status"] == "ok"}
    other = tiny_clip(tmp_path / "clip_seed1", seed=1)
    sec = score_dir(run, ["clip_score"], {"clip_score": str(other)}, device="cpu")
    after = {r["key"]: r["metrics"]["clip_score"] for r in _lines(run / "items.jsonl") if r["status"] == "ok"}
    assert sec["scored"] == {"clip_score": 4} and set(after) == set(before) and after != before
    assert {r["metrics_models"]["clip_score"] for r in _lines(run / "items.jsonl")} == {
        sec["models"]["clip_score"]["sha256"]}


def test_gate_passes_and_fails_on_the_metric_ratio(sweep, tmp_path):
    from runner.tools import gate

    own = json.loads((sweep / "gate.json").read_text())  # the sweep's gate, with report.min_metric_ratio
    assert own["min_metric_ratio"] == {"clip_score": 0.5} and own["jobs"][0]["metrics"]["clip_score"]["pass"]
    assert gate.main([str(sweep), "--min-metric-ratio", "clip_score=0.5", "--out", str(tmp_path / "a.json")]) == 0
    e = json.loads((tmp_path / "a.json").read_text())["jobs"][0]
    m = e["metrics"]["clip_score"]
    lossy = {r["key"]: r["metrics"]["clip_score"] for r in _lines(Path(e["lossy_path"]) / "items.jsonl")}
    ref = {r["key"]: r["metrics"]["clip_score"] for r in _lines(Path(e["lossless_path"]) / "items.jsonl")}
    ratio = np.mean(list(lossy.values())) / np.mean([ref[k] for k in lossy])
    assert m["ratio"] == pytest.approx(ratio, abs=1e-5) and m["items"] == 4
    assert m["min_item_ratio"] == pytest.approx(min(lossy[k] / ref[k] for k in lossy), abs=1e-5)
    assert ratio != 1.0  # the cache moved the pixels, so the scores
    at = f"clip_score={m['ratio'] - 1e-5:.6f}"
    assert gate.main([str(sweep), "--min-metric-ratio", at, "--out", str(tmp_path / "b.json")]) == 0
    above = f"clip_score={m['ratio'] + 1e-3:.6f}"
    p = run_module("runner.gate", [sweep, "--min-metric-ratio", above, "--out", tmp_path / "c.json"], cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["verdict"] == "fail" and doc["min_metric_ratio"] == {"clip_score": pytest.approx(m["ratio"] + 1e-3)}
    assert any(r.startswith("clip_score: mean") for r in doc["jobs"][0]["reasons"])
    # a metric neither job scored fails, naming the fix
    assert gate.main([str(sweep), "--min-metric-ratio", "pick_score=0.9", "--out", str(tmp_path / "d.json")]) == 1
    reasons = json.loads((tmp_path / "d.json").read_text())["jobs"][0]["reasons"]
    assert any("python -m runner.score" in r and "pick_score" in r for r in reasons)
    assert gate.main([str(sweep), "--min-metric-ratio", "clip_scor=0.9"]) == 2


def test_report_shows_the_metrics(sweep, tmp_path):
    from runner.tools.report import write_report

    html = write_report([sweep], tmp_path / "r.html").read_text()
    assert "metrics (mean)" in html and "clip_score" in html
    assert 'aria-label="histogram of clip_score"' in html and 'aria-label="speed against clip_score"' in html
    assert html.count('aria-label="histogram of clip_score"') == 2  # one per job


# ------------------------------------------------------------------------------------------------ refusals


def _refused(tmp_path: Path, overrides: List[str]) -> str:
    from runner.core.errors import UserInputError
    from runner.core.metrics import MetricError

    r = execute(tmp_path / "run", ["model=toy_shapes", "dataset.limit=1", *overrides], catch=(UserInputError,))
    assert isinstance(r.error, MetricError) and r.error.exit_code == 2, r.error
    assert not (tmp_path / "run" / "manifest.json").exists()  # refused before the run started
    return str(r.error)


def test_a_metric_that_cannot_run_is_refused_at_startup(tmp_path, clip):
    err = _refused(tmp_path, ["metrics.names=[clip_scor,image_reward,pick_score,temporal_consistency]",
                              "metrics.models.pick_score=/nonexistent/pick"])
    assert "did you mean clip_score" in err
    assert "pip install image-reward" in err
    assert "metrics.models.pick_score='/nonexistent/pick' does not exist" in err
    assert "temporal_consistency scores video artifacts, this run writes image" in err


def test_a_model_dir_without_the_processor_is_refused(tmp_path, clip):
    bad = tmp_path / "noproc"
    bad.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(clip / f, bad / f)
    err = _refused(tmp_path, ["metrics.names=[clip_score]", f"metrics.models.clip_score={bad}"])
    assert "preprocessor_config.json or processor_config.json" in err and "tokenizer.json" in err
    err = _refused(tmp_path, ["metrics.names=[clip_score]"])
    assert "metrics.models.clip_score is not set" in err


def test_bad_gate_floors_are_refused_at_startup(tmp_path):
    err = _refused(tmp_path, ["report.min_metric_ratio.clip_score=-1"])
    assert "report.min_metric_ratio: clip_score=-1" in err


# ------------------------------------------------------------------------------------------------ video metrics


def test_video_clip_score_is_the_mean_over_frames_and_a_still_video_is_consistent(clip):
    from runner.core.metrics import REGISTRY, temporal_consistency

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    clip_score = REGISTRY["clip_score"].load(clip, "cpu")
    per_frame = clip_score(list(frames), ["a red circle"] * 3)
    assert clip_score([frames], ["a red circle"]) == pytest.approx([np.mean(per_frame)], abs=1e-9)
    tc = REGISTRY["temporal_consistency"].load(clip, "cpu")
    still = np.repeat(frames[:1], 4, axis=0)
    assert tc([still], [""]) == pytest.approx([1.0], abs=1e-9)
    assert tc([frames], [""])[0] < 1.0
    e = np.eye(3)  # VBench's rule on unit vectors: frame 1 is orthogonal to frame 0, frame 2 equals frame 1
    assert temporal_consistency(e[[0, 1, 1]]) == pytest.approx(((0 + 0) / 2 + (0 + 1) / 2) / 2)


# ------------------------------------------------------------------------------------------------ the recipe


def test_the_geneval_style_recipe_keeps_tags_beside_the_scores(tmp_path, clip):
    """docs/metrics.md's recipe: the project's GenEval-style prompt file (``tag``, ``include`` kept as ``meta``), scored."""
    from runner.core.paths import PROJECT_ROOT

    rows = PROJECT_ROOT / "runner" / "data" / "geneval_shapes.jsonl"
    r = execute(tmp_path / "run", ["model=toy_shapes", "dataset=jsonl", f"dataset.path={rows}",
                                   "dataset.extra_fields=keep", "metrics.names=[clip_score]",
                                   f"metrics.models.clip_score={clip}"])
    assert r.code == 0
    meta = _lines(tmp_path / "run" / "images" / "metadata.jsonl")
    src = {x["id"]: x for x in _lines(rows)}
    assert [m["id"] for m in meta] == list(src)
    for m in meta:
        assert m["meta"] == {"tag": src[m["id"]]["tag"], "include": src[m["id"]]["include"]}
        assert m["metrics"]["clip_score"] > 0
    man = r.manifest
    assert man["metrics"]["summary"]["clip_score"]["n"] == len(src) and man["accuracy"]["n"] == len(src)


def test_a_resumed_run_keeps_the_scores_and_scores_only_new_items(tmp_path, clip):
    run = tmp_path / "run"
    common = ["model=toy_shapes", "metrics.names=[clip_score]", f"metrics.models.clip_score={clip}"]
    first = execute(run, [*common, "dataset.limit=2"])
    assert first.code == 0 and first.manifest["metrics"]["scored"] == {"clip_score": 2}
    scores = {r["key"]: r["metrics"] for r in first.items}
    again = execute(run, [*common, "dataset.limit=3", f"run.resume={run}"])
    assert again.code == 0
    sec = again.manifest["metrics"]
    assert sec["scored"] == {"clip_score": 1} and sec["kept"] == {"clip_score": 2}
    recs = {r["key"]: r["metrics"] for r in again.items}
    assert len(recs) == 3 and all(recs[k] == v for k, v in scores.items())
    assert sec["summary"]["clip_score"]["n"] == 3


# ------------------------------------------------------------------------------------------------ gate arithmetic


def _scored_job(tmp_path: Path, name: str, scores: Dict[str, float]) -> Any:
    from runner.tools.report import Job

    items = [{"key": k, "status": "ok", "file": f"images/{k}.png", "metrics": {"clip_score": v}}
             for k, v in scores.items()]
    return Job(name=name, label=name, path=tmp_path / name, group=tmp_path, items=items)


def test_metric_ratio_is_the_ratio_of_the_means_over_shared_items(tmp_path):
    from runner.tools.gate import metric_ratios

    ref = _scored_job(tmp_path, "ref", {"a": 30.0, "b": 10.0, "c": 50.0})
    lossy = _scored_job(tmp_path, "lossy", {"a": 27.0, "b": 11.0})  # c missing: not in the means
    m = metric_ratios(lossy, ref, {"clip_score": 0.95})["clip_score"]
    assert m["lossy"] == 19.0 and m["lossless"] == 20.0 and m["ratio"] == 0.95 and m["items"] == 2
    assert m["pass"] and m["min_item_ratio"] == 0.9 and m["items_below"] == ["a"]
    assert not metric_ratios(lossy, ref, {"clip_score": 0.951})["clip_score"]["pass"]
    zero = _scored_job(tmp_path, "zero", {"a": 0.0, "b": 0.0})  # a lossless mean of 0: lossy must not be lower
    assert metric_ratios(lossy, zero, {"clip_score": 2.0})["clip_score"]["pass"]
    assert not metric_ratios(_scored_job(tmp_path, "neg", {"a": -1.0, "b": 0.0}), zero,
                             {"clip_score": 0.5})["clip_score"]["pass"]
    assert metric_ratios(lossy, ref, {}) is None


def test_a_video_run_scores_its_mp4s(tmp_path, clip):
    """toy_motion end to end: the decoded MP4 frames scored with clip_score (mean over frames) and
    temporal_consistency, equal to the scorers applied here to the decoded frames."""
    from runner.core.metrics import REGISTRY
    from runner.core.video import decode_mp4

    r = execute(tmp_path / "run", ["model=toy_motion", "dataset.limit=2", "model.generation.num_inference_steps=4",
                                   "metrics.names=[clip_score,temporal_consistency]",
                                   f"metrics.models.clip_score={clip}", f"metrics.models.temporal_consistency={clip}"])
    assert r.code == 0
    recs = [x for x in r.items if x["status"] == "ok"]
    frames = [decode_mp4(tmp_path / "run" / x["file"]) for x in recs]
    assert all(f.shape[0] > 1 for f in frames)
    for name in ("clip_score", "temporal_consistency"):
        want = REGISTRY[name].load(clip, "cpu")(frames, [x["prompt"] for x in recs])
        assert [x["metrics"][name] for x in recs] == pytest.approx(want, abs=1e-5)
    assert all(0 < x["metrics"]["temporal_consistency"] <= 1 for x in recs)
    meta = _lines(tmp_path / "run" / "videos" / "metadata.jsonl")
    assert [m["metrics"] for m in meta] == [x["metrics"] for x in recs]


def test_several_workers_are_refused_and_point_at_runner_score():
    from types import SimpleNamespace

    from runner.core.metrics import MetricError, check

    with pytest.raises(MetricError, match="python -m runner.score"):
        check(SimpleNamespace(names=["clip_score"], models={"clip_score": "/x"}, batch_size=0), "image",
              data_parallel=True)
    assert check(SimpleNamespace(names=[], models={"clip_score": None}, batch_size=32), "image") is None


@requires_extra("validate")
def test_validate_refuses_a_score_that_is_no_number(sweep, tmp_path):
    from runner.tools.validate import main as validate

    run = tmp_path / "run"
    shutil.copytree(_job(sweep, lossy=False), run)
    recs = _lines(run / "items.jsonl")
    recs[0]["metrics"]["clip_score"] = "high"
    (run / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert validate([str(run)]) == 1


@pytest.mark.cuda
def test_scores_on_cuda_match_the_cpu_scores(clip):
    from runner.core.metrics import REGISTRY

    rng = np.random.default_rng(1)
    images = list(rng.integers(0, 256, size=(6, 64, 64, 3), dtype=np.uint8))
    prompts = ["a red circle", "a blue square", "a green triangle"] * 2
    cpu = REGISTRY["clip_score"].load(clip, "cpu")(images, prompts)
    cuda = REGISTRY["clip_score"].load(clip, "cuda")(images, prompts)
    assert cuda == pytest.approx(cpu, abs=1e-3)


def test_aesthetic_is_the_laion_head_on_the_normalised_image_embedding(tmp_path, clip):
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPModel, CLIPProcessor

    from runner.core.metrics import AESTHETIC_HEAD, REGISTRY, problems

    model_dir = tmp_path / "aesthetic"
    shutil.copytree(clip, model_dir)
    assert any(AESTHETIC_HEAD in p for p in problems(["aesthetic"], {"aesthetic": str(model_dir)}, "image"))
    torch.manual_seed(0)
    dims = [16, 1024, 128, 64, 16, 1]
    state = {}
    for i, (a, b) in zip((0, 2, 4, 6, 7), zip(dims[:-1], dims[1:])):
        state[f"layers.{i}.weight"], state[f"layers.{i}.bias"] = torch.randn(b, a) / a ** 0.5, torch.randn(b)
    save_file(state, str(model_dir / AESTHETIC_HEAD))
    assert problems(["aesthetic"], {"aesthetic": str(model_dir)}, "image") == []
    rng = np.random.default_rng(2)
    images = list(rng.integers(0, 256, size=(3, 48, 48, 3), dtype=np.uint8))
    got = REGISTRY["aesthetic"].load(model_dir, "cpu")(images, [""] * 3)
    m, proc = CLIPModel.from_pretrained(model_dir).double().eval(), CLIPProcessor.from_pretrained(model_dir)
    with torch.no_grad():
        px = proc(images=[torch.from_numpy(a).permute(2, 0, 1) for a in images], return_tensors="pt")["pixel_values"]
        x = m.visual_projection(m.vision_model(pixel_values=px.double()).pooler_output)
        x = x / x.norm(dim=-1, keepdim=True)
        for i in (0, 2, 4, 6, 7):
            x = x @ state[f"layers.{i}.weight"].double().T + state[f"layers.{i}.bias"].double()
    assert got == pytest.approx(x.squeeze(-1).tolist(), abs=1e-9) and len(set(got)) == 3


def test_runner_score_refuses_a_changed_or_missing_artifact(sweep, clip, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(_job(sweep, lossy=False), run)
    recs = _lines(run / "items.jsonl")
    (run / recs[0]["file"]).write_bytes((run / recs[1]["file"]).read_bytes())
    (run / recs[2]["file"]).unlink()
    before = (run / "items.jsonl").read_bytes()
    p = run_module("runner.score", [run, "--metrics", "clip_score", "--model", f"clip_score={clip}", "--rescore"],
                cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert f"{recs[0]['file']}: sha256 differs" in p.stderr and f"{recs[2]['file']}: missing" in p.stderr
    assert (run / "items.jsonl").read_bytes() == before  # nothing rewritten


def test_scores_do_not_depend_on_the_model_batch(clip):
    from runner.core.metrics import REGISTRY

    rng = np.random.default_rng(3)
    images = list(rng.integers(0, 256, size=(5, 40, 40, 3), dtype=np.uint8))
    prompts = ["a red circle", "a blue square", "a green triangle", "x", "y"]
    whole = REGISTRY["clip_score"].load(clip, "cpu", 8)(images, prompts)
    assert REGISTRY["clip_score"].load(clip, "cpu", 2)(images, prompts) == pytest.approx(whole, abs=1e-9)
    video = np.stack(images)
    tc = [REGISTRY["temporal_consistency"].load(clip, "cpu", b)([video], [""])[0] for b in (2, 8)]
    assert tc[0] == pytest.approx(tc[1], abs=1e-9)
