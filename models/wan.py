"""Wan 2.1 / 2.2 text-to-video family (diffusers ``WanPipeline``) on the generic pipeline engine.

UMT5 text encoder, ``WanTransformer3DModel`` (self-attention over video tokens, cross-attention to the text: roles
``self`` and ``cross``), the causal video VAE ``AutoencoderKLWan``. Output: ``frames`` (batch, F, H, W, C).
Rules the pipeline applies silently and the runner refuses instead: ``num_frames`` must be ``k * t + 1`` with ``t``
the VAE's temporal factor (its config's ``scale_factor_temporal``, 4 for Wan 2.1) or the pipeline rounds it down with a
warning; classifier-free guidance (``guidance_scale > 1``) makes a second transformer forward per step (unbatched:
``noise_uncond = current_model(...)``), and the negative prompt is used only then.

Wan 2.2 (issue #31): the A14B checkpoints hold two experts of Wan 2.1-14B's shape, ``transformer`` (high noise) and
``transformer_2`` (low noise); WanPipeline runs ``transformer`` at the steps whose timestep is >= ``boundary_ratio``
x ``num_train_timesteps`` (``model_index.json``: 0.875 for T2V-A14B) and ``transformer_2`` below, each with its own
guidance scale (``guidance_scale``, ``guidance_scale_2``). Both experts are probed and every install pass applies
to both; the evidence records which expert ran at which step against that rule (:meth:`WanEngine.expected_experts`).
TI2V-5B has one transformer, per-token timesteps (``expand_timesteps``) and a VAE of spatial factor 16 with a
2x2 patch (``scale_factor_spatial`` 16; with the transformer's patch 2 widths and heights are multiples of 32,
:func:`models.family.spatial_scale`).

Image-to-video (issue #30, ``WanImageToVideoPipeline``) is a checkpoint of its own (Wan2.1-I2V-14B-480P): the same
classes plus a CLIP ``image_encoder`` (``CLIPVisionModelWithProjection``: its penultimate hidden states are the
image embeds) and its ``image_processor`` (``CLIPImageProcessor``), and a transformer that takes them (``image_dim`` =
the CLIP hidden size, ``added_kv_proj_dim`` = its inner dim: every ``attn2`` attends to image tokens too,
``in_channels`` 36 = the noise latents 16 + the first-frame mask 4 + the condition latents 16). ``last_image`` (first-last-frame) needs the
FLF2V variant (Wan2.1-FLF2V-14B-720P: ``pos_embed_seq_len`` = 2 x the CLIP tokens, the two images' embeds are
concatenated into one sequence); the I2V transformer fails on it (two image embeds for one video), and the FLF2V one
without it. A Wan 2.2-style I2V (``image_dim`` null, no image encoder: the condition reaches the transformer only
through its input channels) runs on the same pipeline class; its A14B variant has two experts (refused for
image-to-video by :meth:`WanEngine.check_source`). What the pipeline does to an input's size (diffusers 0.42):

============== ========================== ===================================================================
task           pipeline                   input size
============== ========================== ===================================================================
image_to_video WanImageToVideoPipeline    ``image`` and ``last_image`` resized to the call's ``height`` x ``width``
                                          for the VAE (``VideoProcessor.preprocess``, aspect ratio not kept; height
                                          and width floored to multiples of 16 with a warning); for the CLIP image
                                          encoder its processor resizes the shortest edge to ``size.shortest_edge``
                                          and center-crops to ``crop_size`` (224 for Wan 2.1: the encoder never sees
                                          the borders of a non-square input); the video is ``height`` x ``width``
============== ========================== ===================================================================
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from models.family import FamilySpec, signature_default, spatial_scale
from models.pipelines import PipelineEngine
from runner.core import dataset as ds
from runner.core.dataset import Item, Row
from runner.core.errors import ConfigValueError


WAN = FamilySpec(
    name="wan",
    tasks={"text_to_video": "WanPipeline", "image_to_video": "WanImageToVideoPipeline"},
    components={"transformer": ("diffusers", "WanTransformer3DModel", None),
                "transformer_2": ("diffusers", "WanTransformer3DModel", None),  # Wan 2.2 A14B's low-noise expert
                "vae": ("diffusers", "AutoencoderKLWan", None),
                "text_encoder": ("transformers", "UMT5EncoderModel", "UMT5Config"),
                "scheduler": ("diffusers", "UniPCMultistepScheduler", None)},
    tokenizers={"tokenizer": ("t5", "umt5", "text_encoder")},
    cfg="separate",  # guidance_scale > 1: a separate unconditional forward per step
    size_rule=spatial_scale, patch="transformer",  # vae_scale_factor_spatial x the spatial patch (16 for Wan 2.1)
    roles={"attn2": "cross"},  # the blocks' attn2: queries video tokens, keys/values text; the rest: self
    quiet_loggers=("diffusers.pipelines.wan.pipeline_wan",),
    # Wan 2.1's text length (``text_len`` 512; WanPipeline's default): UMT5 embeddings are zero-padded to
    # max_sequence_length, so a larger value only costs memory (100000 tried to allocate 80 GB)
    max_sequence_length=512,
    fp8_prefixes=("blocks.",),  # WanTransformer3DModel names its blocks ``blocks.N``
    needs_mask=False,  # WanAttnProcessor passes no mask: text embeddings are zero-padded to max_sequence_length
    engine="models.wan:WanEngine",
    guidance_hint="Wan 2.1: 5.0",
    # Wan 2.1 I2V / FLF2V: a CLIP vision encoder and its image processor beside the T2V components; the class the
    # diffusers conversion script saves (scripts/convert_wan_to_diffusers.py: CLIPVisionModelWithProjection of
    # laion/CLIP-ViT-H-14; the pipeline reads its penultimate hidden states, not the projection)
    task_components={"image_to_video": {"image_encoder": ("transformers", "CLIPVisionModelWithProjection",
                                                          "CLIPVisionConfig")}},
    task_processors={"image_to_video": {"image_processor": ("clip_image", None)}},
    input_sizing={"image_to_video": "resize"},
    # Wan 2.2 A14B: ``transformer`` runs the steps at timesteps >= boundary_ratio x num_train_timesteps,
    # ``transformer_2`` the others (WanPipeline.__call__); TI2V-5B: one transformer, per-token timesteps
    experts=("transformer", "transformer_2"),
    pipeline_config=("boundary_ratio", "expand_timesteps"),
)


class WanEngine(PipelineEngine):
    """The Wan 2.1 text-to-video family (engine ``wan``)."""

    spec = WAN

    def check_source(self) -> None:
        """The base checks, then: image-to-video on a two-expert model is refused (not observed yet), and a
        denoiser whose input channels are not what the task's pipeline feeds it (:meth:`check_input_channels`).

        Raises:
            ConfigValueError: naming the task, the experts (or the channels) and the fix.
        """
        super().check_source()
        experts = self.declared_experts()
        if self.task == "image_to_video" and len(experts) > 1:
            raise ConfigValueError(f"model.task=image_to_video with model={self.cfg.name}'s two experts "
                                   f"({', '.join(experts)}): the image condition is observed on one transformer "
                                   "only so far; fix: model.task=text_to_video, or a one-transformer I2V model")
        self.check_input_channels(experts)

    def task_input_channels(self, task: str) -> Tuple[int, str]:
        """``(channels, what they are)`` the pipeline of ``task`` feeds each denoiser per latent pixel (diffusers 0.42,
        read from the weight source's configs, no weights): ``text_to_video`` (WanPipeline) and image-to-video with
        ``expand_timesteps`` (Wan 2.2 TI2V: the condition replaces the first latent frame) the noise latents alone,
        the VAE's ``z_dim``; image-to-video otherwise (WanImageToVideoPipeline: ``torch.cat([latents, condition])``,
        the condition being the first-frame mask of ``vae_scale_factor_temporal`` channels and the condition latents)
        ``z_dim + t + z_dim`` (36 for Wan2.1-I2V-14B: 16 + 4 + 16)."""
        z = int(self.component_config("vae").get("z_dim") or signature_default("AutoencoderKLWan", "z_dim", 16))
        if task != "image_to_video" or self.pipeline_settings().get("expand_timesteps"):
            return z, f"the VAE's z_dim={z} noise latent channels"
        t = self.temporal_factor()
        return 2 * z + t, (f"the noise latents {z} + the first-frame mask {t} (the VAE's temporal factor) + the "
                           f"condition latents {z}")

    def check_input_channels(self, experts: Sequence[str]) -> None:
        """Every expert's ``in_channels`` (its config, read without weights) must be what ``model.task``'s pipeline
        feeds it (:meth:`task_input_channels`): a checkpoint of the other task gets latents of the wrong width and
        every item fails mid-call (an I2V transformer of 36 channels run as text-to-video: "The size of tensor a (36)
        must match the size of tensor b (16)"), so it is refused here, naming the task that fits.

        Raises:
            ConfigValueError: naming the expert, its ``in_channels``, what the task feeds and the fix.
        """
        want, what = self.task_input_channels(self.task)
        for name in experts:
            have = self.component_config(name).get("in_channels")
            if have is None or int(have) == want:
                continue
            fits = [t for t in self.spec.tasks if t != self.task and self.task_input_channels(t)[0] == int(have)]
            fix = " or ".join([f"model.task={t} (the checkpoint's task)" for t in fits]
                              + [f"a checkpoint of model.task={self.task} (transformer in_channels={want})"])
            raise ConfigValueError(
                f"model.task={self.task}: model={self.cfg.name}'s {name} takes in_channels={have}, but "
                f"{self.spec.tasks[self.task]} feeds it {want} ({what}); every item would fail; fix: {fix}")

    def site_calls_per_forward(self, layer: str, module: Any) -> int:
        """Two dispatcher calls per forward at every cross-attention with added image keys (Wan 2.1 I2V:
        ``add_k_proj``; ``WanAttnProcessor`` attends to the image tokens and the text tokens separately)."""
        return 2 if getattr(module, "add_k_proj", None) is not None else 1

    def temporal_factor(self) -> int:
        """The VAE's temporal compression as WanPipeline reads it: ``vae.config.scale_factor_temporal``
        (``AutoencoderKLWan``'s default 4 when the config lacks it)."""
        vae = self.component_config("vae")
        factor = vae.get("scale_factor_temporal") or signature_default("AutoencoderKLWan", "scale_factor_temporal", 4)
        return int(factor)

    def context_tokens(self, row: Any) -> Dict[str, int]:
        """What ``WanTransformer3DModel._cp_plan`` splits: the video tokens (latent frames x (height / 16) x (width /
        16)); the text tokens are not split (diffusers keeps ``encoder_hidden_states`` whole for Wan)."""
        need = self.size_need()
        frames = (int(row.num_frames) - 1) // self.temporal_factor() + 1
        return {"video": frames * (row.height // need) * (row.width // need)}

    def splits_attention(self, layer: str) -> bool:
        """Only self-attention (``attn1``) runs split: diffusers' ``WanAttnProcessor`` passes its parallel config only
        without ``encoder_hidden_states``; cross-attention (``attn2``) attends local queries to the whole text."""
        return not layer.endswith("attn2")

    def context_fix(self, sequence: str, degree: int) -> str:
        return (f"num_frames, width and height whose latent frames x {self.size_need()}-pixel tiles number a "
                f"multiple of {degree}")

    def check_family_rows(self, rows: List[Row], path: Any) -> None:
        """``num_frames`` of every row must be ``k * t + 1`` (t = the VAE's temporal factor,
        :meth:`models.pipelines.PipelineEngine.check_frame_counts`): WanPipeline rounds other counts down with a
        warning, and the video would have fewer frames than its record says."""
        self.check_frame_counts(rows, path, self.temporal_factor())
        if self.task == "image_to_video":
            self.check_last_images(rows, path)

    def check_last_images(self, rows: List[Row], path: Any) -> None:
        """Whether the transformer's image embedder takes what the rows give it (diffusers 0.42
        ``WanImageEmbedding``): with ``pos_embed_seq_len`` set (Wan2.1-FLF2V) it reshapes the CLIP embeds to
        ``2 x tokens`` per video, so every row needs ``last_image`` (one image: a reshape error in every item); with
        ``image_dim`` set and no ``pos_embed_seq_len`` (Wan2.1-I2V) the two images' embeds become two videos' worth
        for one video, so ``last_image`` is refused. A transformer without ``image_dim`` (Wan 2.2-style I2V) takes
        either: the last frame reaches it through the condition latents.

        Raises:
            dataset.DatasetError: every row that breaks the rule (file:line, the field, why and the fix).
        """
        conf = self.component_config("transformer") or {}
        if conf.get("image_dim") is None:
            return
        flf2v = conf.get("pos_embed_seq_len") is not None
        bad = [r for r in rows if (r.last_image is None) == flf2v]
        if not bad:
            return
        if flf2v:
            why = (f"model={self.cfg.name}'s transformer is first-last-frame (pos_embed_seq_len="
                   f"{conf['pos_embed_seq_len']}: the embeds of two images per video)")
            fix = "a last_image in every row (the video's last frame), or a one-image I2V model (e.g. model=wan_i2v)"
        else:
            why = (f"model={self.cfg.name}'s transformer embeds one image per video (image_dim set, no "
                   "pos_embed_seq_len)")
            fix = "drop last_image, or a first-last-frame model (Wan2.1-FLF2V, e.g. model=tiny_wan_flf2v)"
        raise ds.DatasetError([f"{path}:{r.line}: last_image={r.last_image!r}: {why}; fix: {fix}" for r in bad])

    # ------------------------------------------------------------------------------------ Wan 2.2: two experts
    def boundary_timestep(self) -> Optional[float]:
        """``boundary_ratio * num_train_timesteps`` as WanPipeline computes it (None: no boundary, one expert), from
        the snapshot's recorded ``boundary_ratio`` (:meth:`pipeline_settings`), not the loaded pipeline's."""
        ratio = self.pipeline_settings().get("boundary_ratio")
        if ratio is None:
            return None
        return float(ratio) * int(self.component_config("scheduler").get("num_train_timesteps", 1000))

    def expected_experts(self, row: Any) -> List[Tuple[float, str]]:
        """``(timestep, expert)`` per step of ``row``'s call: a fresh scheduler of the loaded one's config gives the
        timesteps (``set_timesteps(num_inference_steps)``, as WanPipeline's step 4); ``transformer`` runs a step
        whose timestep is >= :meth:`boundary_timestep`, ``transformer_2`` the others (WanPipeline.__call__)."""
        sched = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        sched.set_timesteps(int(row.num_inference_steps), device="cpu")
        boundary = self.boundary_timestep()
        return [(float(t), "transformer" if boundary is None or t >= boundary else "transformer_2")
                for t in sched.timesteps]

    def planned_expert_steps(self, steps: int) -> Dict[str, int]:
        """``{expert: steps it runs}`` of a call of ``steps`` denoising steps, known before loading: the timesteps of
        a scheduler built from the weight source's scheduler config at ``model.generation.shift`` when set
        (``models.scheduler_shift.shifted_config``; ``set_timesteps(steps)``, as WanPipeline), split
        at :meth:`boundary_timestep` as :meth:`expected_experts` splits them (tiny_wan22, boundary 875: 1 step is
        ``{transformer: 1, transformer_2: 0}``; 4 steps at ``boundary_ratio`` 0.5 are ``{4, 0}``). One expert: all
        steps on ``transformer``."""
        cache = self.__dict__.setdefault("_planned_steps", {})
        boundary = self.boundary_timestep()
        if boundary is None:
            return {"transformer": int(steps)}
        if (steps, boundary) not in cache:
            import diffusers

            from models.scheduler_shift import shift_kind, shifted_config

            conf = self.component_config("scheduler")
            cls = getattr(diffusers, str(conf.get("_class_name") or self.component_class("scheduler")))
            shift = self.cfg.generation.shift  # the scheduler the run installs (models.scheduler_shift)
            kind = shift_kind({"_class_name": cls.__name__, **conf})
            conf = shifted_config(conf, shift, kind) if shift is not None and kind else conf
            sched = cls.from_config({k: v for k, v in conf.items() if not k.startswith("_")})
            sched.set_timesteps(int(steps), device="cpu")
            high = sum(1 for t in sched.timesteps if float(t) >= boundary)
            cache[(steps, boundary)] = {"transformer": high, "transformer_2": len(sched.timesteps) - high}
        return dict(cache[(steps, boundary)])

    def expert_rule(self) -> str:
        """WanPipeline's switch rule with this model's numbers."""
        b = self.boundary_timestep()
        return ("no boundary_ratio: transformer at every step" if b is None else
                f"transformer at timesteps >= boundary_ratio x num_train_timesteps = {b:g}, transformer_2 below")

    def row_spec(self) -> Any:
        """The diffusion row and ``guidance_scale_2`` (the low-noise expert's guidance scale; WanPipeline's
        ``guidance_scale_2``, default: ``guidance_scale``)."""
        return WAN_ROW

    def family_kwargs(self, batch: Sequence[Item]) -> Dict[str, Any]:
        """``guidance_scale_2`` when the row sets it (the pipeline uses ``guidance_scale`` otherwise)."""
        kw = super().family_kwargs(batch)
        g2 = batch[0].row.guidance_scale_2
        if g2 is not None:
            kw["guidance_scale_2"] = float(g2)
        return kw

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """The base values, and with two experts ``expert_steps`` (the steps each expert ran in the item's call,
        :meth:`planned_expert_steps`; the evidence checks them) and ``guidance_scale_2`` as applied: the row's, else
        its ``guidance_scale`` (WanPipeline's default), null without classifier-free guidance or when
        ``transformer_2`` runs no step; ``guidance_scale`` is null when ``transformer`` runs no step and
        ``guidance_scale_2`` is the scale applied (it then only turns guidance on: :meth:`check_ignored`)."""
        out = super().applied_params(row)
        if self.boundary_timestep() is not None:
            steps = self.planned_expert_steps(int(row.num_inference_steps))
            out["expert_steps"] = steps
            cfg_on = row.guidance_scale is not None and row.guidance_scale > 1
            g2 = row.guidance_scale_2 if row.guidance_scale_2 is not None else row.guidance_scale
            out["guidance_scale_2"] = g2 if cfg_on and steps["transformer_2"] else None
            if self.switch_only(row):
                out["guidance_scale"] = None
        return out

    def row_expert_steps(self, row: Any) -> Optional[Dict[str, int]]:
        """:meth:`planned_expert_steps` of the row's steps with two experts (``boundary_ratio`` set), else None."""
        return self.planned_expert_steps(int(row.num_inference_steps)) if self.boundary_timestep() is not None else None

    def switch_only(self, row: Any) -> bool:
        """Whether ``row``'s ``guidance_scale`` acts only as classifier-free guidance's switch: ``transformer`` (whose
        scale it is) runs no step of the row's call, guidance is on (> 1), and ``guidance_scale_2`` is set (so it is
        the only scale applied; unset, ``guidance_scale`` is the default of ``guidance_scale_2`` and acts)."""
        return (self.boundary_timestep() is not None and row.guidance_scale is not None and row.guidance_scale > 1
                and row.guidance_scale_2 is not None
                and self.planned_expert_steps(int(row.num_inference_steps))["transformer"] == 0)

    def check_ignored(self, rows: List[Row], path: Any) -> List[Row]:
        """The base handling, then ``guidance_scale`` in rows where it acts only as a switch (:meth:`switch_only`):
        its value changes no output (5 and 7 give the same bytes), so ``dataset.on_ignored=error`` refuses the rows
        that set it (file:line) or, when it is ``model.generation.guidance_scale``, the key; ``record`` runs it
        (the pipeline still gets it: it turns guidance on for ``transformer_2``), records ``guidance_scale: null``
        in the item's params and the value under ``ignored`` with why.

        Raises:
            DatasetError: error mode, every row that sets such a ``guidance_scale``.
            ConfigValueError: error mode, ``model.generation.guidance_scale`` reaches such a row.
        """
        from dataclasses import replace

        from runner.core.dataset import DatasetError

        rows = super().check_ignored(rows, path)
        hit = [r for r in rows if self.switch_only(r)]
        if not hit:
            return rows
        mode, name = str(self.ctx.run.dataset.on_ignored), self.cfg.name

        def why(r: Row) -> str:
            return (f"transformer (the high-noise expert whose scale it is) runs no step of the row's "
                    f"{r.num_inference_steps} ({self.expert_rule()}), so only its > 1 acts, turning guidance on for "
                    f"transformer_2 at guidance_scale_2={r.guidance_scale_2}")
        fix = "set guidance_scale to the value transformer_2 should apply and drop guidance_scale_2, or more steps"
        if mode == "error":
            own = [r for r in hit if "guidance_scale" in r.set_fields]
            if own:
                raise DatasetError([f"{path}:{r.line}: field 'guidance_scale' = {r.guidance_scale!r} is ignored by "
                                    f"model={name}: {why(r)}; fix: {fix}, or dataset.on_ignored=record to run it and "
                                    "record the value as ignored" for r in own])
            r = hit[0]
            raise ConfigValueError(f"model.generation.guidance_scale={r.guidance_scale} is ignored by model={name} "
                                   f"in {len(hit)} row(s) (first: {path}:{r.line}): {why(r)}; fix: {fix}, or "
                                   "dataset.on_ignored=record to run it and record the value as ignored")
        out, hit_ids = [], {id(r) for r in hit}
        for r in rows:
            if id(r) in hit_ids:
                src = f"{path}:{r.line}" if "guidance_scale" in r.set_fields else "model.generation.guidance_scale"
                r = replace(r, ignored={**(r.ignored or {}), "guidance_scale": {
                    "value": r.guidance_scale, "why": why(r), "from": src,
                    "passed": "as the switch of classifier-free guidance (> 1) only"}})
            out.append(r)
        return out

    def ignored_fields(self, rows: Sequence[Row]) -> Dict[str, Tuple[Any, ...]]:
        """The base rules, and ``guidance_scale_2``: a snapshot without ``boundary_ratio`` (one expert) has no
        low-noise expert to apply it to (WanPipeline's ``check_inputs`` raises); with one, it applies only under
        classifier-free guidance (``guidance_scale`` > 1: ``do_classifier_free_guidance`` reads
        ``guidance_scale`` alone)."""
        out = super().ignored_fields(rows)
        if self.boundary_timestep() is None:
            out["guidance_scale_2"] = (f"model={self.cfg.name} has one expert (no boundary_ratio), and "
                                       "guidance_scale_2 is the low-noise expert's", "use guidance_scale")
        else:
            out["guidance_scale_2"] = (self.guidance_2_ignored_why, "guidance_scale > 1 in that row, or steps "
                                       "and model.architecture.pipeline.boundary_ratio under which transformer_2 runs",
                                       self.guidance_2_ignored)
        return out

    def guidance_2_ignored(self, row: Row) -> bool:
        """``guidance_scale_2`` acts on no step of ``row``'s call: guidance is off (``guidance_scale`` <= 1:
        ``do_classifier_free_guidance`` reads ``guidance_scale`` alone) or ``transformer_2`` runs no step
        (:meth:`planned_expert_steps`: 1 step on tiny_wan22, or ``boundary_ratio`` 0.5 at 4 steps)."""
        return (row.guidance_scale is None or row.guidance_scale <= 1
                or self.planned_expert_steps(int(row.num_inference_steps))["transformer_2"] == 0)

    def guidance_2_ignored_why(self, row: Row) -> str:
        """Why :meth:`guidance_2_ignored` holds for ``row``."""
        if row.guidance_scale is None or row.guidance_scale <= 1:
            return "guidance_scale <= 1 turns classifier-free guidance off for both experts"
        return (f"transformer_2 (the low-noise expert whose scale it is) runs no step of the row's "
                f"{row.num_inference_steps} ({self.expert_rule()})")


def check_guidance_2(v: Any, context: Any) -> Optional[str]:
    """``guidance_scale_2``: None or a finite number >= 0."""
    import math

    return ("must be a finite number >= 0; fix: use e.g. 3.0" if v is not None and not (math.isfinite(v) and v >= 0) else None)


#: Wan's row: the diffusion row and the low-noise expert's ``guidance_scale_2`` (identity only when set, so
#: Wan 2.1 rows keep theirs; rows of different values never share a call).
WAN_ROW = ds.DIFFUSION_ROW.extend("wan", ds.Field("guidance_scale_2", float, check=check_guidance_2,
                                                  default="guidance_scale_2", identity="set", batch_key=True))
