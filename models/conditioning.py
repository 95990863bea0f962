"""What the conditioning tasks (``model.task``: image_to_image, inpaint, edit, image_to_video) add to a pipeline
call, and what the runner observes of them.

* :func:`call_inputs`: the rows' checked inputs (``runner.core.media``) loaded as PIL images, one list entry per
  item of the batch (one pipeline call for the batch: ``image=[...]``, ``mask_image=[...]``), ``strength`` as
  applied (the row's, else the pipeline's ``__call__`` default, read from its signature), and for
  ``FluxKontextPipeline`` the arguments that keep the output at the row's size (``max_area = width * height``,
  ``_auto_resize=False``: else it would pick one of its preferred resolutions).
* :func:`steps_run`: the denoising steps an img2img / inpaint call makes, by diffusers' own ``get_timesteps`` rule.
* :class:`SequenceProbe`: the denoiser's input at the first forward of a call, observed: for ``edit`` its sequence
  must hold the reference image's tokens beside the target's (:func:`edit_tokens`); for FLUX img2img / inpaint its
  latents must be each item's own input, noised (:func:`first_latents_check`).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

from runner.core import media

#: Tasks whose pipelines take ``strength`` and run only the last steps of the schedule (``get_timesteps``).
STRENGTH_TASKS = ("image_to_image", "inpaint")

#: Pipelines that condition one call on ONE input (not one per prompt), so the runner calls them one item at a time
#: (:func:`unbatched_reason`; the batch size applied is recorded in the evidence and in every item's
#: ``batch_size``), passing the item's input as they take it (:func:`call_inputs`): pipeline -> why (diffusers 0.42).
UNBATCHED = {
    "QwenImageEditPlusPipeline": "its image argument is the list of reference images of ONE prompt (several prompts "
                                 "would share them; it checks batch size 1 only)",
    "WanImageToVideoPipeline": "it encodes one image (and last_image) and repeats its CLIP embeds and condition "
                               "latents over the prompts",
}


def strength_default(pipeline_cls: type) -> Optional[float]:
    """The ``strength`` default of ``pipeline_cls.__call__`` (FluxImg2ImgPipeline and FluxInpaintPipeline: 0.6);
    None when it takes no ``strength``."""
    p = inspect.signature(pipeline_cls.__call__).parameters.get("strength")
    return None if p is None or p.default is inspect.Parameter.empty else float(p.default)


def steps_run(num_inference_steps: int, strength: float, order: int = 1) -> int:
    """Denoising steps (transformer forwards per guidance pass) an img2img / inpaint call makes: diffusers' own
    ``get_timesteps`` (FluxImg2Img/InpaintPipeline, StableDiffusion3Img2Img/InpaintPipeline, QwenImageImg2Img/
    InpaintPipeline, diffusers 0.42; the one rule of the runner, checked against diffusers in
    tests/test_conditioning.py and tests/test_conditioning_families.py)::

        init_timestep = min(num_inference_steps * strength, num_inference_steps)
        t_start = int(max(num_inference_steps - init_timestep, 0))
        return num_inference_steps - t_start

    times the scheduler's ``order``. The same float arithmetic, so the count is the pipeline's exactly: the ceiling of
    ``steps * strength``, not its rounding or truncation (4 steps at strength 0.3 run 2, 28 at 0.3 run 9), and the
    float product decides (100 steps at 0.55 run 56: ``100 * 0.55 = 55.00000000000001``); 0 < strength <= 1 gives at
    least 1."""
    init_timestep = min(num_inference_steps * strength, num_inference_steps)
    t_start = int(max(num_inference_steps - init_timestep, 0))
    return (num_inference_steps - t_start) * order


def applied_strength(row: Any, default: Optional[float]) -> Optional[float]:
    """The strength a row's call applies: its own, else the pipeline's default."""
    return float(row.strength) if getattr(row, "strength", None) is not None else default


def load_field(row: Any, field: str) -> Any:
    """A row's input ``field`` as the pipeline gets it (a PIL image, or a list of them for a list of references),
    read again and checked against its recorded sha256 (``runner.core.media.load_input``)."""
    inp, value = row.inputs[field], getattr(row, field)
    if isinstance(inp, list):
        return [media.load_input(x, v) for x, v in zip(inp, value)]
    return media.load_input(inp, value)


def call_inputs(task: str, batch: Sequence[Any], params: set, pipeline_cls: type) -> Dict[str, Any]:
    """The conditioning arguments of one pipeline call over ``batch`` (items of one shape key, so one strength
    and one input size): each media input the pipeline's ``__call__`` takes (``image``, ``mask_image``,
    ``last_image``, a family's own media field) as a list (one entry per item; a row with a list of references runs
    alone and passes its list), ``strength``, and Kontext's size arguments.

    Raises:
        runner.core.media.InputChangedError: an input changed since the startup check.
    """
    r0 = batch[0].row
    if not r0.inputs:
        return {}
    kw: Dict[str, Any] = {}
    single = pipeline_cls.__name__ == "WanImageToVideoPipeline"  # one PIL image, not a list (VideoProcessor, CLIP)
    for field in r0.inputs:  # every media field of the row's spec the row set, in the spec's order
        if field in params:
            loaded = [load_field(it.row, field) for it in batch]
            kw[field] = loaded[0] if isinstance(loaded[0], list) or single else loaded
    if task in STRENGTH_TASKS and "strength" in params:
        kw["strength"] = applied_strength(r0, strength_default(pipeline_cls))
    if "max_area" in params:  # FluxKontextPipeline: keep the row's size (its max_area rounding is then the identity)
        kw["max_area"] = r0.width * r0.height
    if "_auto_resize" in params:
        kw["_auto_resize"] = False
    return kw


def unbatched_reason(pipeline: str, batch_size: int) -> Optional[str]:
    """Why ``pipeline`` runs one item per call (:data:`UNBATCHED`) when ``batch_size`` > 1; None when it batches or
    the batch size is 1."""
    return UNBATCHED.get(pipeline) if batch_size > 1 else None


def overlay_outside(task: str, outputs: List[Any], kw: Dict[str, Any], enabled: bool) -> List[Any]:
    """Inpaint with ``output.inpaint_overlay``: each output with its input composited back outside its mask
    (``runner.core.media.overlay``); other tasks, or the option off, unchanged."""
    if task != "inpaint" or not enabled or "mask_image" not in kw:
        return outputs
    return [media.overlay(o, img, m) for o, img, m in zip(outputs, kw["image"], kw["mask_image"])]


def edit_tokens(row: Any, need: int) -> Tuple[int, int]:
    """``(target tokens, reference tokens)`` of a FLUX Kontext call: the packed latent tokens of the target,
    ``(height / need) * (width / need)`` (``need``: VAE factor x 2x2 packing), and of every reference image alike
    (``FluxKontextPipeline.prepare_latents`` packs the encoded reference the same way and concatenates it after the
    target's tokens along the sequence)."""
    target = (row.height // need) * (row.width // need)
    refs = row.inputs.get("image") if row.inputs else None
    refs = refs if isinstance(refs, list) else [refs] if refs is not None else []
    return target, sum((x.height // need) * (x.width // need) for x in refs)


class SequenceProbe:
    """Observes the denoiser's ``hidden_states`` at the first forward after each :meth:`arm` (one pipeline call),
    through a forward pre-hook with keyword arguments: its sequence length (dim 1) always, and with ``keep`` a copy
    of it and of the ``timestep`` passed (for :func:`first_latents_check`)."""

    def __init__(self, model: Any) -> None:
        self.seen: Optional[int] = None
        self.hidden: Any = None
        self.timestep: Any = None
        self.armed = self.keep = False
        model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def arm(self, keep: bool = False) -> None:
        """The next forward is the first of a call; ``keep``: copy its hidden states and timestep."""
        self.seen, self.hidden, self.timestep, self.armed, self.keep = None, None, None, True, keep

    def _pre(self, module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        if not self.armed:
            return
        hs = kwargs.get("hidden_states", args[0] if args else None)
        self.seen = int(hs.shape[1]) if hs is not None and getattr(hs, "dim", lambda: 0)() >= 2 else None
        if self.keep and hs is not None:
            self.hidden, self.timestep = hs.detach().float().clone(), kwargs.get("timestep")
            self.timestep = None if self.timestep is None else self.timestep.detach().float().clone()
        self.armed = False


#: The normalised residual of the first latents (:func:`first_latents_check`) is the mean of n ~chi-square(1)
#: terms: 1 when the latents are ``sigma * noise + (1 - sigma) * encode(input)``, standard error sqrt(2 / n) (0.044
#: for the 1,024 latent values of a 64x64 toy_shapes image; measured there over 72 items: mean 1.002, sd 0.035, range
#: 0.91-1.07). Accepted: within ``max(FIRST_LATENTS_TOLERANCE, 6 * sqrt(2 / n))`` of 1; a swapped input reads > 1.5
#: (``tests/test_conditioning.py``).
FIRST_LATENTS_TOLERANCE = 0.25


def first_latents_check(pipe: Any, images: Sequence[Any], hidden: Any, timestep: Any, height: int,
                        width: int) -> Dict[str, Any]:
    """Whether the latents that entered the transformer at a FLUX img2img / inpaint call's first forward are its
    inputs, noised: ``scheduler.scale_noise`` gives ``sigma * noise + (1 - sigma) * x0`` with ``x0`` the VAE
    posterior sample of the input (shifted, scaled, packed), ``sigma`` the timestep FluxImg2ImgPipeline passes
    (``t / 1000``). Per item, the residual ``hidden - (1 - sigma) * mean(x0)`` divided by its variance
    ``sigma**2 + (1 - sigma)**2 * std(x0)**2`` (the posterior's, per latent) averages 1 for its own input; the same
    statistic with zero latents (no input) is reported beside it (``without_input``) to show what it separates.

    Returns:
        ``{"sigma", "statistic": [per item], "without_input": [per item], "range", "verdict"}``.
    """
    import math

    import torch

    vae = pipe.vae
    sig = float(timestep.flatten()[0])
    sig = sig / 1000.0 if sig > 1.0 else sig
    stats, null = [], []
    with torch.inference_mode():
        for i, img in enumerate(images):
            t = pipe.image_processor.preprocess(img, height, width).to(vae.device, vae.dtype)
            d = vae.encode(t).latent_dist
            mean = (d.mode() - vae.config.shift_factor) * vae.config.scaling_factor
            std = d.std * vae.config.scaling_factor
            b, c, h, w = mean.shape
            mean, std = (pipe._pack_latents(x.float(), b, c, h, w)[0] for x in (mean, std))
            var = sig ** 2 + (1 - sig) ** 2 * std ** 2
            stats.append(float((((hidden[i] - (1 - sig) * mean) ** 2) / var).mean()))
            null.append(float(((hidden[i] ** 2) / var).mean()))
    tol = max(FIRST_LATENTS_TOLERANCE, 6 * math.sqrt(2 / max(1, hidden[0].numel())))
    ok = all(abs(x - 1) <= tol for x in stats)
    return {"sigma": round(sig, 6), "statistic": [round(x, 4) for x in stats],
            "without_input": [round(x, 4) for x in null], "range": [round(1 - tol, 4), round(1 + tol, 4)],
            "verdict": "verified" if ok else "mismatch"}


class ImageConditionProbe:
    """Observes what an image-to-video denoiser (``WanTransformer3DModel``) receives at the first forward after each
    :meth:`arm`: the channels of its ``hidden_states`` (noise latents + first-frame mask + condition latents) and a
    copy of ``encoder_hidden_states_image`` (the CLIP image embeds; None for a transformer without ``image_dim``)."""

    def __init__(self, model: Any) -> None:
        self.channels: Optional[int] = None
        self.image_embeds: Any = None
        self.armed = False
        model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def arm(self) -> None:
        """The next forward is the first of a call."""
        self.channels, self.image_embeds, self.armed = None, None, True

    def _pre(self, module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        if not self.armed:
            return
        hs = kwargs.get("hidden_states", args[0] if args else None)
        self.channels = int(hs.shape[1]) if hs is not None else None
        emb = kwargs.get("encoder_hidden_states_image")
        self.image_embeds = None if emb is None else emb.detach().float().clone()
        self.armed = False


def image_condition_check(pipe: Any, kw: Dict[str, Any], probe: ImageConditionProbe, key: str) -> Dict[str, Any]:
    """Whether one image-to-video call's input reached its transformer: the first forward's ``hidden_states`` has the
    transformer's ``in_channels`` (the condition latents and mask beside the noise), and where the transformer takes
    image embeds (``image_dim``) they equal the pipeline's own ``encode_image`` of THIS call's ``image`` (and
    ``last_image``), recomputed here (a swapped or dropped input differs).

    Returns:
        ``{"item", "channels", "expected_channels", "image_embeds" (the embeds' shape: images x CLIP tokens x
        width), "embeds_match", "verdict"}``.
    """
    import torch

    want_ch = int(pipe.transformer.config.in_channels)
    out: Dict[str, Any] = {"item": key, "channels": probe.channels, "expected_channels": want_ch,
                           "image_embeds": None, "embeds_match": None}
    ok = probe.channels == want_ch
    if pipe.transformer.config.get("image_dim") is not None:
        imgs = kw["image"] if kw.get("last_image") is None else [kw["image"], kw["last_image"]]
        with torch.inference_mode():
            ref = pipe.encode_image(imgs, pipe.transformer.device).float()
        got = probe.image_embeds
        match = got is not None and tuple(got.shape) == tuple(ref.shape) and bool(
            torch.allclose(got, ref, atol=1e-4, rtol=1e-3))
        out.update(image_embeds=None if got is None else list(got.shape), embeds_match=match)
        ok = ok and match
    out["verdict"] = "verified" if ok else "mismatch"
    return out


# ------------------------------------------------------------------------------------------------- the pass
from models.passes import Pass  # noqa: E402

#: Edit pipelines whose transformer sequence the engine predicts (the engine's ``expected_sequence``).
EDIT_SEQUENCE_PIPELINES = ("FluxKontextPipeline", "QwenImageEditPlusPipeline")


class ConditioningPass(Pass):
    """``model.task`` image_to_image, inpaint, edit, image_to_video on a diffusion stage (:mod:`models.passes`):
    the rows' inputs as call arguments (:func:`call_inputs`), one item per call for a pipeline that conditions a
    call on one input (:data:`UNBATCHED`), the strength and steps applied in each item's ``params``, the inpaint
    overlay, and the evidence that each call's input reached the denoiser: the sequence of an edit pipeline whose
    packing is predicted (the engine's ``expected_sequence(row)``), FLUX img2img / inpaint first latents
    (:func:`first_latents_check`), an image-to-video transformer's image condition (:func:`image_condition_check`),
    and the input sizes as the pipeline treats them (the engine's ``input_sizes(row)``). Nothing for the generation
    tasks. The engine provides ``task``, ``pipeline_name()``, ``pipeline_cls()``, ``call_params()``, ``family()``."""

    name = "conditioning"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.seq_probe: Optional[SequenceProbe] = None
        self.i2v_probe: Optional[ImageConditionProbe] = None
        self.seq_seen: List[Tuple[str, Optional[int], int]] = []
        self.i2v_seen: List[Dict[str, Any]] = []
        self.batching: Optional[Dict[str, Any]] = None
        self.first_sizes: Optional[Dict[str, Any]] = None
        self.latents_observed = False
        self.first_latents: Optional[Dict[str, Any]] = None
        self._keep = False

    @property
    def conditioned(self) -> bool:
        return self.engine.task not in ("text_to_image", "text_to_video")

    def batch_size(self, requested: int) -> int:
        """1 for a pipeline of :data:`UNBATCHED`, with a warning; recorded in the evidence (``batching``)."""
        e = self.engine
        why = unbatched_reason(e.pipeline_name(), requested)
        if why is None:
            return requested
        import logging

        logging.getLogger("runner").warning("batch_size=%d -> 1 for %s: %s", requested, e.pipeline_name(), why)
        self.batching = {"requested": requested, "applied": 1, "why": f"{e.pipeline_name()}: {why}"}
        return 1

    def install(self, sections: Dict[str, Any]) -> None:
        """The hooks that observe the task's input reaching the transformer."""
        e = self.engine
        task, pipe = e.task, e.pipe
        edit = task == "edit" and e.pipeline_name() in EDIT_SEQUENCE_PIPELINES
        self.latents_observed = (task in STRENGTH_TASKS and e.family() == "flux"
                                 and hasattr(pipe, "_pack_latents"))  # FLUX's packing: first_latents_check
        self.seq_probe = SequenceProbe(pipe.transformer) if edit or self.latents_observed else None
        self.i2v_probe = ImageConditionProbe(pipe.transformer) if task == "image_to_video" else None

    def call_args(self, batch: Sequence[Any]) -> Dict[str, Any]:
        e = self.engine
        return call_inputs(e.task, batch, e.call_params(), e.pipeline_cls())

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """For image_to_image / inpaint the ``strength`` applied (the row's, else the pipeline's default) and
        ``steps_run``, the denoising steps the item's call runs (:func:`steps_run`: 1 of 16 at strength 0.05, 8 at
        0.5); for inpaint ``inpaint_overlay``."""
        e = self.engine
        out: Dict[str, Any] = {}
        if e.task in STRENGTH_TASKS:
            out["strength"] = applied_strength(row, strength_default(e.pipeline_cls()))
            if out["strength"] is not None:
                out["steps_run"] = steps_run(int(row.num_inference_steps), out["strength"])
        if e.task == "inpaint":
            out["inpaint_overlay"] = bool(e.ctx.run.output.inpaint_overlay)
        return out

    def before_pipe(self, batch: Sequence[Any], kwargs: Dict[str, Any]) -> None:
        self._keep = self.latents_observed and self.first_latents is None  # the first call's first latents, once
        if self.seq_probe is not None:
            self.seq_probe.arm(keep=self._keep)
        if self.i2v_probe is not None:
            self.i2v_probe.arm()

    def after_pipe(self, batch: Sequence[Any], kwargs: Dict[str, Any], outputs: List[Any]) -> List[Any]:
        e = self.engine
        row = batch[0].row
        if self._keep and self.seq_probe.hidden is not None:
            self.first_latents = {"item": batch[0].key, **first_latents_check(
                e.pipe, kwargs["image"], self.seq_probe.hidden, self.seq_probe.timestep, row.height, row.width)}
            self.seq_probe.hidden = None
        if e.task == "edit" and self.seq_probe is not None:
            self.seq_seen.append((batch[0].key, self.seq_probe.seen, e.expected_sequence(row)))
        if self.first_sizes is None and row.inputs:
            self.first_sizes = {"item": batch[0].key, **e.input_sizes(row)}
        if self.i2v_probe is not None:
            self.i2v_seen.append(image_condition_check(e.pipe, kwargs, self.i2v_probe, batch[0].key))
        return overlay_outside(e.task, outputs, kwargs, bool(e.ctx.run.output.inpaint_overlay))

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        """``conditioning``, observed: the forward rule (image_to_image / inpaint: the forwards follow ``strength``,
        checked by the forward count; FLUX: the first latents), for ``edit`` the denoiser's input sequence at each
        call's first forward, which must hold the reference images' tokens beside the target's, for
        ``image_to_video`` the image condition at each call's first forward; the input sizes as the pipeline treats
        them and the batch size applied. A call whose input did not arrive is a mismatch (exit 3 under
        ``evidence.strict``)."""
        if not self.conditioned:
            return []
        e = self.engine
        cond: Dict[str, Any] = {"task": e.task, "pipeline": e.pipeline_name()}
        if self.first_sizes is not None:
            cond["input_sizing"] = self.first_sizes
        if self.batching is not None:
            cond["batching"] = self.batching
        checks = section.setdefault("checks", {})
        mismatches = self.strength_evidence(cond, checks) + self.edit_evidence(cond, checks)
        mismatches += self.i2v_evidence(cond, checks)
        section["conditioning"] = cond
        return mismatches

    def strength_evidence(self, cond: Dict[str, Any], checks: Dict[str, Any]) -> List[str]:
        """img2img / inpaint: the forward rule named, and FLUX's first-latents check."""
        if self.engine.task not in STRENGTH_TASKS:
            return []
        cond["forward_rule"] = ("num_inference_steps - int(max(n - min(n * strength, n), 0)) per guidance pass "
                                "(diffusers get_timesteps)")
        fl = self.first_latents
        cond["first_latents"] = fl or {"verdict": "not_observed"}
        if fl is None:
            return []
        checks["first_latents"] = fl["verdict"]
        if fl["verdict"] == "verified":
            return []
        return [f"stage {self.engine.stage}: the first latents of {fl['item']}'s call are not its input noised at "
                f"sigma {fl['sigma']} (normalised residual {fl['statistic']}, expected within {fl['range']}): the "
                "input did not reach the denoiser as configured"]

    def edit_evidence(self, cond: Dict[str, Any], checks: Dict[str, Any]) -> List[str]:
        """edit: the reference tokens in the denoiser's sequence at each call's first forward."""
        if self.engine.task != "edit":
            return []
        if self.seq_probe is None:  # an edit pipeline whose packing the engine does not predict
            checks["reference_tokens"] = "limited"
            return []
        bad = [(k, seen, want) for k, seen, want in self.seq_seen if seen != want]
        cond["sequence"] = {"calls": len(self.seq_seen), "observed_first": self.seq_seen[0][1] if self.seq_seen
                            else None, "expected_first": self.seq_seen[0][2] if self.seq_seen else None,
                            "verdict": "mismatch" if bad or not self.seq_seen else "verified"}
        checks["reference_tokens"] = cond["sequence"]["verdict"]
        return [f"stage {self.engine.stage}: item {k}: the denoiser's first input held {seen} tokens, expected {want} "
                "(target + reference image tokens): the reference did not reach the transformer as configured"
                for k, seen, want in bad]

    def i2v_evidence(self, cond: Dict[str, Any], checks: Dict[str, Any]) -> List[str]:
        """image_to_video: the image condition at each call's first forward."""
        if self.engine.task != "image_to_video":
            return []
        bad = [s for s in self.i2v_seen if s["verdict"] != "verified"]
        verdict = "mismatch" if bad or not self.i2v_seen else "verified"
        cond["image_condition"] = {"calls": len(self.i2v_seen), "first": self.i2v_seen[0] if self.i2v_seen else None,
                                   "verdict": verdict}
        checks["image_condition"] = verdict
        return [f"stage {self.engine.stage}: item {s['item']}: the transformer's first input had {s['channels']} "
                f"channels (expected {s['expected_channels']}) and image embeds matching this item's input: "
                f"{s['embeds_match']}: the input image did not reach the transformer as configured" for s in bad]
