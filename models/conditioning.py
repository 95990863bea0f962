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
