"""Per-item quality metrics of written artifacts (issue #33): a registry of :class:`Metric` records, their
requirements checked before anything loads, and the scoring of a run dir's ``items.jsonl`` from the decoded
artifacts (PNG / MP4), so a run's own scoring and ``python -m runner.score`` give the same numbers.

Metrics (``metrics.names``; each higher is better):

* ``clip_score`` (image, video): torchmetrics' CLIPScore, ``max(100 * cos(E_I, E_C), 0)`` of the image and
  prompt embeddings of a CLIP model (Hessel et al. 2021, "CLIPScore", EMNLP; torchmetrics
  ``functional.multimodal.clip_score``), per item (torchmetrics clamps the batch mean; here each item, as in the
  paper). A video scores the mean over its frames.
* ``pick_score`` (image): PickScore (Kirstain et al. 2023, "Pick-a-Pic"): ``logit_scale.exp() * cos(E_I, E_C)`` of
  a CLIP model fine-tuned on human preferences (yuvalkirstain/PickScore_v1's README formula).
* ``temporal_consistency`` (video): VBench's background consistency (Huang et al. 2024, "VBench", CVPR;
  ``vbench/background_consistency.py``): for each frame ``i >= 1``, ``(cos(E_i, E_0) + cos(E_i, E_{i-1})) / 2`` of
  CLIP image embeddings, averaged over the frames; 1.0 for a still video.
* ``aesthetic`` (image): the LAION improved aesthetic predictor, an MLP (:data:`AESTHETIC_WIDTHS`) on the
  L2-normalised CLIP ViT-L/14 image embedding; its head as ``aesthetic_head.safetensors`` beside the CLIP files.
* ``image_reward`` (image; the ``image-reward`` package), ``hpsv2`` (image; the ``hpsv2`` package): their own
  scoring APIs with local checkpoints; refused at startup where the package is not installed.

Each metric reads a model from ``metrics.models.<name>`` (a local dir of a transformers ``CLIPModel`` saved with its
``CLIPProcessor``, or a Hub id held in the local cache; ``image_reward`` / ``hpsv2``: a checkpoint file). Its files'
sha256 enter the manifest (``metrics.models``) and every scored record (``metrics_models``: name -> digest), so a
resumed item keeps its score only when the metric model is the same.

transformers 5 returns a ``BaseModelOutputWithPooling`` from ``CLIPModel.get_image_features`` /
``get_text_features`` where torchmetrics 1.9 expects the projected embeddings: :class:`ClipFeatures` hands
torchmetrics the projected ``pooler_output``. Per-item scores come from torchmetrics' ``_clip_score_update`` (its
public ``CLIPScore``/``clip_score`` return only the batch mean); ``tests/test_metrics.py`` recomputes them with
transformers alone, so a change of that private function shows.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from runner.core.errors import UserInputError

#: Quantiles of the manifest's summary (``p10`` ... ``p90``).
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
#: Decimals a per-item score is stored with (keeps run-time and ``runner.score`` values equal across batchings).
DECIMALS = 5


class MetricError(UserInputError):
    """A metric cannot run as configured (unknown name, wrong output kind, package or model missing): exit 2 at
    startup, before any weight loads."""


@dataclass(frozen=True)
class Metric:
    """One registry record.

    Attributes:
        name: ``metrics.names`` entry.
        kinds: artifact kinds it scores (``image``, ``video``).
        packages: import names it needs, with the ``pip install`` fix in ``install``.
        model: what ``metrics.models.<name>`` must hold (``clip_dir`` or ``file``).
        load: ``load(model path, torch device, batch_size) -> scorer``; ``scorer(arrays, prompts) -> list of
            floats``, arrays ``uint8`` (H, W, 3) per image or (F, H, W, 3) per video; at most ``batch_size``
            images (or frames) per model call.
        source: where the formula comes from.
    """

    name: str
    kinds: Tuple[str, ...]
    packages: Tuple[str, ...]
    install: str
    model: str
    load: Callable[..., Any]
    source: str


REGISTRY: Dict[str, Metric] = {}

#: ``scorer(arrays, prompts) -> per-item scores`` (see :attr:`Metric.load`).
Scorer = Callable[[List[np.ndarray], List[str]], List[float]]


def register(metric: Metric) -> Metric:
    """Add ``metric`` to :data:`REGISTRY` (a name registered twice is a programming error: ValueError)."""
    if metric.name in REGISTRY:
        raise ValueError(f"metric {metric.name!r} is registered already")
    REGISTRY[metric.name] = metric
    return metric


# ---------------------------------------------------------------------------------------------- CLIP models


def _clip_module() -> Any:
    import torch

    class ClipFeatures(torch.nn.Module):
        """A transformers ``CLIPModel`` as torchmetrics' CLIPScore calls it: ``get_image_features(pixel_values)``
        -> (N, D) and ``get_text_features(input_ids, attention_mask)`` -> (N, D), the projected embeddings."""

        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model
            self.config = model.config

        def get_image_features(self, pixel_values: Any) -> Any:
            out = self.model.get_image_features(pixel_values=pixel_values.to(self.model.dtype))
            return out if isinstance(out, torch.Tensor) else out.pooler_output

        def get_text_features(self, input_ids: Any, attention_mask: Any = None) -> Any:
            out = self.model.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
            return out if isinstance(out, torch.Tensor) else out.pooler_output

    return ClipFeatures


class ClipScorer:
    """A CLIP model and processor loaded once from a local dir (``from_pretrained``, safetensors only), in eval
    mode on ``device``: float64 on CPU (a score then does not depend on the batch it was computed in, nor on the
    thread count, to far below :data:`DECIMALS`), float32 on accelerators (the batch composition may move the last
    float32 digits)."""

    def __init__(self, path: Path, device: Any, batch_size: int = 32) -> None:
        import torch
        from transformers import CLIPModel, CLIPProcessor

        self.device, self.batch_size = torch.device(device), int(batch_size)
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        model = CLIPModel.from_pretrained(str(path), use_safetensors=True, dtype=dtype).eval().to(self.device)
        self.model = _clip_module()(model).eval()
        self.processor = CLIPProcessor.from_pretrained(str(path))

    def _tensors(self, arrays: Sequence[np.ndarray]) -> List[Any]:
        import torch

        return [torch.from_numpy(np.array(a, dtype=np.uint8)).permute(2, 0, 1).to(self.device) for a in arrays]

    def clip_scores(self, images: Sequence[np.ndarray], prompts: Sequence[str]) -> np.ndarray:
        """``100 * cos`` per (image, prompt) pair via torchmetrics' ``_clip_score_update``, ``batch_size`` images
        per call (a video's frames count one each); (N,) float64."""
        import torch
        from torchmetrics.functional.multimodal.clip_score import _clip_score_update

        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                s, _ = _clip_score_update(self._tensors(images[i:i + self.batch_size]),
                                          list(prompts[i:i + self.batch_size]), self.model, self.processor)
                out.append(s.double().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0)

    def image_embeddings(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """L2-normalised projected image embeddings, ``batch_size`` images per call; (N, D) float64."""
        import torch

        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                chunk = [torch.from_numpy(np.array(a, dtype=np.uint8)).permute(2, 0, 1)
                         for a in images[i:i + self.batch_size]]
                px = self.processor(images=chunk, return_tensors="pt")
                e = self.model.get_image_features(px["pixel_values"].to(self.device)).double()
                out.append((e / e.norm(dim=-1, keepdim=True)).cpu().numpy())
        return np.concatenate(out)

    def logit_scale(self) -> float:
        """The model's learned temperature ``exp(logit_scale)`` (CLIP's, PickScore's score scale)."""
        return float(self.model.model.logit_scale.exp())


def _frames_of(arrays: Sequence[np.ndarray]) -> Tuple[List[np.ndarray], List[int]]:
    """Every frame of every artifact (an image is one frame), and each artifact's frame count."""
    frames: List[np.ndarray] = []
    counts: List[int] = []
    for a in arrays:
        fs = [a] if a.ndim == 3 else list(a)
        frames.extend(fs)
        counts.append(len(fs))
    return frames, counts


def _load_clip_score(path: Path, device: Any, batch_size: int = 32) -> Scorer:
    clip = ClipScorer(path, device, batch_size)

    def score(arrays: List[np.ndarray], prompts: List[str]) -> List[float]:
        frames, counts = _frames_of(arrays)
        texts = [p for p, n in zip(prompts, counts) for _ in range(n)]
        per = np.maximum(clip.clip_scores(frames, texts), 0.0)
        bounds = np.cumsum([0, *counts])
        return [float(per[a:b].mean()) for a, b in zip(bounds[:-1], bounds[1:])]

    return score


def _load_pick_score(path: Path, device: Any, batch_size: int = 32) -> Scorer:
    clip = ClipScorer(path, device, batch_size)

    def score(arrays: List[np.ndarray], prompts: List[str]) -> List[float]:
        cos = clip.clip_scores(arrays, prompts) / 100.0
        return [float(x) for x in clip.logit_scale() * cos]

    return score


def temporal_consistency(emb: np.ndarray) -> float:
    """VBench's background consistency of one video's L2-normalised frame embeddings ``emb`` (F, D): the mean
    over frames ``i >= 1`` of ``(cos(e_i, e_0) + cos(e_i, e_{i-1})) / 2``; 1.0 for a single frame."""
    if len(emb) < 2:
        return 1.0
    first = emb[1:] @ emb[0]
    prev = np.sum(emb[1:] * emb[:-1], axis=-1)
    return float(np.mean((first + prev) / 2.0))


def _load_temporal(path: Path, device: Any, batch_size: int = 32) -> Scorer:
    clip = ClipScorer(path, device, batch_size)

    def score(arrays: List[np.ndarray], prompts: List[str]) -> List[float]:
        return [temporal_consistency(clip.image_embeddings(list(a))) for a in arrays]

    return score


#: The LAION improved aesthetic predictor's head (christophschuhmann/improved-aesthetic-predictor, ``MLP``): layer
#: widths after the CLIP image embedding; its ``nn.Sequential`` indices of the Linear layers (dropout between).
AESTHETIC_WIDTHS = (1024, 128, 64, 16, 1)
AESTHETIC_LINEARS = (0, 2, 4, 6, 7)
AESTHETIC_HEAD = "aesthetic_head.safetensors"


def aesthetic_head(state: Mapping[str, Any]) -> Any:
    """The predictor's MLP from its state dict (``layers.<i>.weight`` / ``.bias`` for i in
    :data:`AESTHETIC_LINEARS`; the input width is the CLIP projection's), in eval mode (dropout off).

    Raises:
        KeyError: a layer's weights are missing.
    """
    import torch

    dims = [int(state["layers.0.weight"].shape[1]), *AESTHETIC_WIDTHS]
    mods: List[Any] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        mods.append(torch.nn.Linear(a, b))
        if i < 3:
            mods.append(torch.nn.Dropout(0.0))
    layers = torch.nn.Sequential(*mods)
    layers.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()}, strict=True)
    return layers.eval()


def _load_aesthetic(path: Path, device: Any, batch_size: int = 32) -> Scorer:
    import torch
    from safetensors.torch import load_file

    clip = ClipScorer(path, device, batch_size)
    head = aesthetic_head(load_file(str(Path(path) / AESTHETIC_HEAD))).to(clip.device, clip.model.model.dtype)

    def score(arrays: List[np.ndarray], prompts: List[str]) -> List[float]:
        emb = torch.from_numpy(clip.image_embeddings(arrays)).to(clip.device, clip.model.model.dtype)
        with torch.inference_mode():
            return [float(x) for x in head(emb).squeeze(-1).double().cpu()]

    return score


def _load_image_reward(path: Path, device: Any, batch_size: int = 32) -> Scorer:
    import ImageReward  # noqa: N813 - the package's name
    from PIL import Image

    model = ImageReward.load(str(path), device=str(device))

    def score(arrays: List[np.ndarray], prompts: List[str]) -> List[float]:
        out = [model.score(p, [Image.fromarray(a)]) for a, p in zip(arrays, prompts)]
        return [float(x[0] if isinstance(x, list) else x) for x in out]

    return score


def _load_hpsv2(path: Path, device: Any, batch_size: int = 32) -> Scorer:
    import hpsv2
    from PIL import Image

    def score(arrays: List[np.ndarray], prompts: List[str]) -> List[float]:
        return [float(hpsv2.score([Image.fromarray(a)], p, cp=str(path), hps_version="v2.1")[0])
                for a, p in zip(arrays, prompts)]

    return score


register(Metric("clip_score", ("image", "video"), ("torchmetrics", "transformers"), "pip install torchmetrics "
                "transformers", "clip_dir", _load_clip_score, "Hessel et al. 2021; torchmetrics CLIPScore"))
register(Metric("pick_score", ("image",), ("torchmetrics", "transformers"), "pip install torchmetrics transformers",
                "clip_dir", _load_pick_score, "Kirstain et al. 2023 (PickScore_v1 README)"))
register(Metric("temporal_consistency", ("video",), ("torchmetrics", "transformers"),
                "pip install torchmetrics transformers", "clip_dir", _load_temporal,
                "VBench background_consistency (Huang et al. 2024)"))
register(Metric("aesthetic", ("image",), ("transformers", "safetensors"), "pip install transformers safetensors",
                "clip_dir+head", _load_aesthetic, "LAION improved aesthetic predictor (MLP on L2-normalised CLIP "
                "ViT-L/14 image embeddings)"))
register(Metric("image_reward", ("image",), ("ImageReward",), "pip install image-reward", "file",
                _load_image_reward, "Xu et al. 2023, ImageReward"))
register(Metric("hpsv2", ("image",), ("hpsv2",), "pip install hpsv2", "file", _load_hpsv2,
                "Wu et al. 2023, Human Preference Score v2"))


# ---------------------------------------------------------------------------------------------- requirements


@dataclass
class MetricSet:
    """The checked ``metrics`` config of a run: names in order, each one's model path and its provenance."""

    names: List[str]
    paths: Dict[str, Path]
    sources: Dict[str, Dict[str, Any]]
    batch_size: int
    digests: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def _model_problems(m: Metric, value: Optional[str]) -> Tuple[List[str], Optional[Path], Dict[str, Any]]:
    """The model location of ``m``: problems (naming the key, the value and the fix), the path, its provenance."""
    key = f"metrics.models.{m.name}"
    want = ("a dir holding a transformers CLIPModel (config.json, *.safetensors) saved with its CLIPProcessor "
            "(preprocessor_config.json or processor_config.json, tokenizer files), or a Hub id in the local cache"
            if m.model != "file" else "the metric's checkpoint file")
    if not value:
        return [f"{key} is not set; metric {m.name} needs {want}; fix: {key}=<path>"], None, {}
    from runner.core.weights import looks_like_repo_id, resolve_model_path

    local = Path(str(value)).expanduser()
    if not local.exists() and not looks_like_repo_id(str(value)):
        return [f"{key}={value!r} does not exist; fix: {want}"], None, {}
    try:
        path, source = resolve_model_path(str(value))
    except UserInputError as e:  # a Hub id not in the local cache: the message names the cache and the download
        return [f"{key}={value!r}: {e}"], None, {}
    if m.model == "file":
        return ([] if path.is_file() else [f"{key}={value!r} is not a file; fix: {want}"]), path, source
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    if m.model == "clip_dir+head" and AESTHETIC_HEAD not in names:
        return [f"{key}={value!r} lacks {AESTHETIC_HEAD} (the predictor's MLP: layers.{{0,2,4,6,7}}.weight/bias); "
                f"fix: save the head's state dict there with safetensors (a .pth is pickle, never loaded) beside "
                "the CLIP ViT-L/14 it was trained on"], None, {}
    missing = [n for n, ok in (("config.json", "config.json" in names),
                               ("*.safetensors", any(n.endswith(".safetensors") for n in names)),
                               ("preprocessor_config.json or processor_config.json",
                                bool({"preprocessor_config.json", "processor_config.json"} & names)),
                               ("tokenizer.json or vocab.json", bool({"tokenizer.json", "vocab.json"} & names)))
               if not ok]
    if missing:
        return [f"{key}={value!r} lacks {', '.join(missing)}; fix: {want} (e.g. CLIPModel.save_pretrained and "
                "CLIPProcessor.save_pretrained into one dir)"], None, {}
    return [], path, source


def problems(names: Sequence[str], models: Mapping[str, Any], output: str) -> List[str]:
    """Every reason the configured metrics cannot run for a run whose artifacts are ``output`` (``image``,
    ``video``, ``text``): unknown names (with the closest), a kind the metric does not score, a missing package
    (the ``pip install`` fix), a model location unset or unusable, a ``metrics.models`` key no name uses."""
    import difflib

    out: List[str] = []
    for n in names:
        m = REGISTRY.get(n)
        if m is None:
            close = difflib.get_close_matches(n, list(REGISTRY), n=1)
            out.append(f"metrics.names: unknown metric {n!r}; fix: "
                       + (f"did you mean {close[0]}? " if close else "") + f"one of {', '.join(REGISTRY)}")
            continue
        if output not in m.kinds:
            out.append(f"metrics.names: {n} scores {'/'.join(m.kinds)} artifacts, this run writes {output}; fix: "
                       f"drop {n} or use one of {', '.join(k for k, r in REGISTRY.items() if output in r.kinds)}")
            continue
        lacking = [p for p in m.packages if importlib.util.find_spec(p) is None]
        if lacking:
            out.append(f"metrics.names: {n} needs the package(s) {', '.join(lacking)}, not installed; fix: "
                       f"{m.install}")
            continue
        out += _model_problems(m, models.get(n))[0]
    out += [f"metrics.models.{k} is set but {k} is not in metrics.names; fix: metrics.names=[...,{k}] or drop it"
            for k, v in models.items() if v is not None and k not in names]
    return out


def floor_problems(floors: Mapping[str, Any], key: str = "report.min_metric_ratio") -> List[str]:
    """Every entry of a gate's metric floors (name -> ratio; None: not gated) that is no registered metric or no
    finite ratio > 0."""
    import math

    out = []
    for k, v in floors.items():
        if v is None:  # not gated
            continue
        try:
            ok = float(v) > 0 and math.isfinite(float(v))
        except (TypeError, ValueError):
            ok = False
        if k not in REGISTRY or not ok:
            out.append(f"{key}: {k}={v!r} must name a metric ({', '.join(REGISTRY)}) with a ratio > 0; fix: "
                       f"{key}.clip_score=0.99")
    return out


def check(metrics: Any, output: str, data_parallel: bool = False,
          floors: Optional[Mapping[str, Any]] = None) -> Optional[MetricSet]:
    """The run's ``metrics`` group (and the sweep gate's metric ``floors``, ``report.min_metric_ratio``) checked
    before anything loads; None when no metric is configured.

    Raises:
        MetricError: every problem at once (:func:`problems`); also ``parallelism`` with several workers (the
            workers' journals are merged after the run: score the merged dir with ``python -m runner.score``).
    """
    names = [str(n) for n in (metrics.names or [])] if metrics is not None else []
    models = {str(k): (None if v is None else str(v)) for k, v in dict(metrics.models or {}).items()} \
        if metrics is not None else {}
    bad_floors = floor_problems(dict(floors or {}))
    if not names and not any(v is not None for v in models.values()):
        if bad_floors:
            raise MetricError("metrics cannot run:\n  " + "\n  ".join(bad_floors))
        return None
    found = bad_floors + problems(names, models, output)
    if len(set(names)) != len(names):
        found.append(f"metrics.names lists a metric twice ({names}); fix: each once")
    if int(metrics.batch_size) < 1:
        found.append(f"metrics.batch_size={metrics.batch_size} must be >= 1; fix: metrics.batch_size=32")
    if data_parallel and names:
        found.append("metrics with several workers are not scored during the run; fix: drop metrics.names and "
                     "score the merged run dir afterwards: python -m runner.score <run dir> --metrics ...")
    if found:
        raise MetricError("metrics cannot run:\n  " + "\n  ".join(found))
    paths, sources = {}, {}
    for n in names:
        _, paths[n], sources[n] = _model_problems(REGISTRY[n], models.get(n))
    return MetricSet(names=names, paths=paths, sources=sources, batch_size=int(metrics.batch_size))


def model_digests(ms: MetricSet, cache_dir: Optional[Path] = None) -> Dict[str, Dict[str, Any]]:
    """Per metric: ``{source, files: {relative path: sha256}, sha256}`` of its model (every file of a model dir, or
    the checkpoint file); ``sha256`` covers the metric's name and the files' digests, so it changes when either
    does (``runner.core.weights.hash_files``)."""
    from runner.core.weights import hash_files

    out: Dict[str, Dict[str, Any]] = {}
    for n in ms.names:
        p = ms.paths[n]
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        digests, _ = hash_files(files, p if p.is_dir() else p.parent, cache_dir)
        whole = hashlib.sha256(json.dumps({"metric": n, "files": digests}, sort_keys=True).encode()).hexdigest()
        out[n] = {"source": ms.sources[n], "files": digests, "sha256": whole}
    ms.digests = out
    return out


# ---------------------------------------------------------------------------------------------- scoring


def load_artifact(path: Path) -> np.ndarray:
    """A written artifact decoded: a PNG as ``uint8`` (H, W, 3), an MP4 as its frames (F, H, W, 3)."""
    if str(path).endswith(".mp4"):
        from runner.core.video import decode_mp4

        return decode_mp4(path)
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def check_artifacts(run_dir: Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Every record's artifact exists and still has its recorded ``file_sha256``, so a score is that of the
    item's own output.

    Raises:
        MetricError: naming every missing or changed file (exit 2).
    """
    from runner.core.dataset import file_sha256

    bad = []
    for r in records:
        p = Path(run_dir) / r["file"]
        if not p.is_file():
            bad.append(f"{r['file']}: missing")
        elif r.get("file_sha256") and file_sha256(p) != r["file_sha256"]:
            bad.append(f"{r['file']}: sha256 differs from its record's file_sha256 (changed after the run)")
    if bad:
        raise MetricError(f"{run_dir}: artifacts to score do not match items.jsonl:\n  " + "\n  ".join(bad)
                          + "\nfix: restore them, or re-run (python -m runner.repro) before scoring")


def needs_scoring(rec: Mapping[str, Any], name: str, digest: str) -> bool:
    """An ok record with a file lacks ``name``'s score, or has one from another metric model."""
    if rec.get("status") != "ok" or not rec.get("file"):
        return False
    return (rec.get("metrics") or {}).get(name) is None or (rec.get("metrics_models") or {}).get(name) != digest


def score_records(run_dir: Path, records: List[Dict[str, Any]], ms: MetricSet, device: Any) -> Dict[str, int]:
    """Score in place every record of ``records`` that :func:`needs_scoring`, metric by metric, in batches of
    ``ms.batch_size`` in record order, from the artifacts under ``run_dir``: ``rec["metrics"][name]`` (rounded to
    :data:`DECIMALS`) and ``rec["metrics_models"][name]`` (the model digest). :func:`model_digests` first.

    Returns:
        ``{name: items scored}`` (the others kept their scores).

    Raises:
        MetricError: an artifact to score is missing or changed (:func:`check_artifacts`).
    """
    done: Dict[str, int] = {}
    check_artifacts(run_dir, [r for r in records if any(needs_scoring(r, n, ms.digests[n]["sha256"])
                                                        for n in ms.names)])
    for n in ms.names:
        digest = ms.digests[n]["sha256"]
        todo = [r for r in records if needs_scoring(r, n, digest)]
        done[n] = len(todo)
        if not todo:
            continue
        scorer = REGISTRY[n].load(ms.paths[n], device, ms.batch_size)
        for i in range(0, len(todo), ms.batch_size):
            chunk = todo[i:i + ms.batch_size]
            vals = scorer([load_artifact(Path(run_dir) / r["file"]) for r in chunk],
                          [str(r.get("prompt") or "") for r in chunk])
            for r, v in zip(chunk, vals):
                r.setdefault("metrics", {})[n] = round(float(v), DECIMALS)
                r.setdefault("metrics_models", {})[n] = digest
        del scorer
    return done


def summary(records: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Per metric over the ok records holding its score: ``{n, mean, std, min, p10, p25, p50, p75, p90, max}``
    (numpy's linear-interpolation quantiles); ``{n: 0}`` when none."""
    out: Dict[str, Dict[str, Any]] = {}
    for n in names:
        v = np.array([r["metrics"][n] for r in records if r.get("status") == "ok"
                      and (r.get("metrics") or {}).get(n) is not None], dtype=np.float64)
        if not len(v):
            out[n] = {"n": 0}
            continue
        q = {f"p{int(round(x * 100))}": round(float(np.quantile(v, x)), DECIMALS) for x in QUANTILES}
        out[n] = {"n": int(len(v)), "mean": round(float(v.mean()), DECIMALS), "std": round(float(v.std()), DECIMALS),
                  "min": round(float(v.min()), DECIMALS), **q, "max": round(float(v.max()), DECIMALS)}
    return out


def score_journal(run_dir: Path, journal: str, ms: MetricSet, device: Any,
                  cache_dir: Optional[Path] = None, rescore: bool = False) -> Dict[str, Any]:
    """Score ``run_dir/journal`` (``items.jsonl``) in place (atomic rewrite, same order, only once every score is
    computed) and return the manifest's ``metrics`` section: ``{names, device, batch_size, models
    (:func:`model_digests`), summary (:func:`summary`), scored, kept, score_s}``. ``rescore``: every ok item is
    scored again, also those holding a score of the same model.

    Raises:
        MetricError: an artifact to score is missing or changed (the journal is left as it was).
        runner.core.errors.StorageError: the journal could not be rewritten.
    """
    from runner.core.artifacts import atomic_write_bytes
    from runner.core.sinks import read_journal

    t0 = time.perf_counter()
    path = Path(run_dir) / journal
    records = read_journal(path)
    for r in records if rescore else []:
        for n in ms.names:
            (r.get("metrics") or {}).pop(n, None)
    models = model_digests(ms, cache_dir)
    scored = score_records(Path(run_dir), records, ms, device)
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode())
    ok = sum(1 for r in records if r.get("status") == "ok" and r.get("file"))
    return {"names": list(ms.names), "device": str(device), "batch_size": ms.batch_size,
            "models": models, "summary": summary(records, ms.names), "scored": scored,
            "kept": {n: ok - scored[n] for n in ms.names}, "score_s": round(time.perf_counter() - t0, 3)}
