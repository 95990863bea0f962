"""A diffusion stage's dataset rows and item records: the row spec (``runner.core.dataset.DIFFUSION_ROW`` and the
family's own fields), reading and validating the rows with the run's and the model's defaults, the values the
model ignores (``dataset.on_ignored``), the pipeline's ``__call__`` arguments every set field must have, a video
family's frame rule, the batches, and each item's journal record (``params`` as applied, ``tokens``, ``inputs``,
``ignored`` and each pass's fields).

:class:`DiffusionRows` is a part of :class:`models.diffusers_engine.DiffusersEngine`, :class:`FamilyRows` of
:class:`models.pipelines.PipelineEngine` (the family spec's rules); each pass of the engine checks or extends the
rows after them (:meth:`models.passes.Pass.prepare_rows`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from models.family import negative_prompt_ignored
from models.oracles import oracle
from runner.core import dataset as ds
from runner.core.dataset import BUILTIN_PROMPTS, MAX_FRAMES, Row
from runner.core.errors import ConfigValueError

log = logging.getLogger("runner")

#: row field -> the pipeline ``__call__`` argument it feeds (``fps`` feeds the video sink, not the pipeline)
CALL_ARGS = {"negative_prompt": "negative_prompt", "guidance_scale": "guidance_scale", "num_frames": "num_frames",
             "width": "width", "height": "height", "num_inference_steps": "num_inference_steps"}


class DiffusionRows:
    """Rows and records of a diffusion stage, for :class:`models.diffusers_engine.DiffusersEngine` (see the module
    doc)."""

    def row_spec(self) -> ds.RowSpec:
        """The engine's dataset row (``runner.core.dataset.VIDEO_ROW``: the image fields and the video fields, which
        an image model's ``check_rows`` refuses by name); an engine with further row fields returns
        ``ds.DIFFUSION_ROW.extend(...)`` (their values reach validation, the item identity, ``items.jsonl``'s
        ``params`` and resume through the spec alone). :data:`runner.core.dataset.DIFFUSION_ROW` adds the
        conditioning fields (``image``, ``mask_image``, ``last_image``, ``strength``) to ``VIDEO_ROW``; each is
        allowed only where ``model.task`` takes it (:meth:`row_context`). The engine's passes add their own fields
        after those (:attr:`models.passes.Pass.row_fields`)."""
        from models.passes import pass_names_with_rows, row_fields_of

        extra = row_fields_of(type(self).PASSES)
        if not extra:
            return ds.DIFFUSION_ROW
        return ds.DIFFUSION_ROW.extend("+".join([ds.DIFFUSION_ROW.name, *pass_names_with_rows(type(self).PASSES)]),
                                       *extra)

    def row_context(self) -> Dict[str, Any]:
        """What the row spec's task rule reads (``runner.core.dataset.check_task_inputs``): ``task`` and
        ``multi_image``; a text-to-image row by default."""
        return {"task": "text_to_image", "multi_image": False}

    def builtin_rows(self) -> str:
        """The file under ``runner/data`` that ``dataset=builtin`` reads: the model's ``builtin_prompts``."""
        return self.model_cfg.builtin_prompts

    def read_rows(self) -> Tuple[List[ds.Row], Path]:
        """The run's dataset rows, validated, with the run's and the model's defaults filled in.

        Raises:
            dataset.DatasetError: every problem found (file, line, field, value, fix).
        """
        cfg = self.ctx.run
        g = self.model_cfg.generation
        spec = self.row_spec()
        defaults = {f.default: getattr(g, f.default, None) for f in spec.fields if f.default}  # model.generation.<field>
        defaults.update(negative_prompt=None, num_images_per_prompt=cfg.num_images_per_prompt)
        self.check_generation_defaults(spec, {"size_multiple": self.model_cfg.size_multiple,
                                              "max_pixels": cfg.max_pixels, **self.row_context()})
        rows, path = ds.load_rows(cfg.dataset.format, cfg.dataset.path, defaults=defaults,
                                  size_multiple=self.model_cfg.size_multiple, max_pixels=cfg.max_pixels,
                                  limit=cfg.dataset.limit, builtin=self.builtin_rows(),
                                  split=cfg.dataset.split, columns=ds.columns_option(cfg.dataset.columns),
                                  extra_fields=str(cfg.dataset.extra_fields), spec=spec, context=self.row_context())
        from runner.core import media

        rows = media.attach_inputs(rows, path, cfg.dataset.media_root,  # every input checked, none loaded
                                   any_size=self.inputs_any_size())
        rows = self.check_ignored(rows, path)
        self.check_rows(rows, path)
        rows = self.passes.prepare_rows(rows, path)
        return rows, path

    def check_generation_defaults(self, spec: ds.RowSpec, context: Dict[str, Any]) -> None:
        """Each row field's default from ``model.generation.<key>`` (``Field.default``), checked by the field's own
        rule (``Field.check``, with the context the rows are checked in) before any row is read. A row that leaves the
        field out takes that value, so a bad one is the config key's: reported as it, once, not as a row of whichever
        rows file is read (``model.generation.fps=0`` was ``runner/data/motion.jsonl:1: field 'fps' = 0 ...`` for a
        row that sets no fps). A rule's ``fix: use e.g. <v>`` becomes ``fix: model.generation.<key>=<v>``; a rule without
        a fix (``must be <x>``) gives ``fix: model.generation.<key>=<x>``.

        Raises:
            ConfigValueError: naming the key, the value, the rule and the fix.
        """
        g = self.model_cfg.generation
        for f in spec.fields:
            if not f.default or f.check is None or not hasattr(g, f.default):
                continue  # no rule, or a default that is not model.generation's (num_images_per_prompt: the run's)
            value = getattr(g, f.default)
            why = f.check(value, context)
            if not why:
                continue
            key = f"model.generation.{f.default}"
            why, _, fix = why.partition("; fix: ")
            rule = why[len("must be "):] if why.startswith("must be ") else "a valid value"
            fix = f"{key}={fix[len('use e.g. '):]}" if fix.startswith("use e.g. ") else fix or f"{key}=<{rule}>"
            raise ConfigValueError(f"{key}={value!r} {why} (the value of {f.name!r} in every row that does not set "
                                   f"it); fix: {fix}")

    def ignored_fields(self, rows: Sequence[ds.Row]) -> Dict[str, Tuple[str, str]]:
        """Generation fields the model ignores under the run's config: ``{field: (why, fix)}``; none by default.
        A field listed here that a row or ``model.generation`` sets is handled by ``dataset.on_ignored``."""
        return {}

    def check_ignored(self, rows: List[ds.Row], path: Any) -> List[ds.Row]:
        """Refuse (``dataset.on_ignored=error``) or strip and note (``record``) the values that the model ignores,
        set by a row or by a ``model.generation`` default. A default left null (``guidance_scale: null`` on a
        model without guidance embedding) is not set: the item records it as null (not applicable). A default that a
        rule ignores in some rows only (``applies(row)``: ``guidance_scale_2`` where the low-noise expert runs no
        step) is not refused: the rows that take it record it under ``ignored``, in either mode.

        Raises:
            ConfigValueError: a ``model.generation.<field>`` the model ignores (error mode), naming key, why, fix,
                when the user chose it (:meth:`chosen`); the model's own default is recorded as ignored instead.
            dataset.DatasetError: every row that sets one (error mode), with file:line, field, why and fix.
        """
        ignored = self.ignored_fields(rows)
        if not ignored:
            return rows
        mode, name, g = str(self.ctx.run.dataset.on_ignored), self.model_cfg.name, self.model_cfg.generation
        from_config: Dict[str, Tuple[str, Any]] = {}
        for f, (why, fix, *applies) in ignored.items():
            value = getattr(g, f, None)  # a field model.generation does not have is set by rows only
            if value is not None:
                key = f"model.generation.{f}"
                if applies:  # ignored in some rows only: those that take the default record it, none is refused
                    from_config[f] = (key, value)
                    continue
                if mode == "error" and self.chosen(key, value):
                    raise ConfigValueError(f"{key}={value} is ignored by model={name}: {why}; fix: {key}=null, {fix}, "
                                           "or dataset.on_ignored=record to run it and record the value as ignored")
                from_config[f] = (key, value)
        rows = ds.apply_ignored(rows, path, ignored, mode, name, from_config)
        n = sum(1 for r in rows if r.ignored)
        if n:
            log.warning("%d of %d rows set or take a value that model=%s ignores (%s); it is not applied, and their "
                        "records list it under 'ignored' (a row's value under dataset.on_ignored=record, or a default "
                        "of the model that does not act on them)", n, len(rows), name,
                        ", ".join(sorted({f for r in rows for f in (r.ignored or {})})))
        return rows

    def chosen(self, key: str, value: Any) -> bool:
        """Whether ``key`` = ``value`` is the user's choice rather than the model's own default
        (``runner.core.resolve.user_chose``). A model default that does not act on these rows (Qwen-Image's
        ``true_cfg_scale: 4.0`` with no negative prompt, the model card's setting) is recorded as ignored in each
        item, not refused (field case: ``model=qwen_image`` refused its own builtin prompts); a chosen one is
        refused under ``dataset.on_ignored=error``."""
        from runner.core.resolve import user_chose

        return user_chose(self.ctx.overrides, self.model_cfg.name, key, value)

    def check_rows(self, rows: Sequence[ds.Row], path: Any) -> None:
        """Model-specific row checks (e.g. an oracle's ``expect`` vocabulary); none by default."""

    def check_inputs(self, rows: Sequence[Any], path: Any) -> None:
        """A diffusion stage takes any prompt (the text encoders truncate at ``max_sequence_length``)."""

    def items(self, rows: Sequence[ds.Row], run_seed: int) -> List[ds.Item]:
        """One item per image (``runner.core.dataset.expand_items``: seeds belong to rows, not batches)."""
        return ds.expand_items(rows, run_seed)

    def batches(self, items: Sequence[ds.Item], batch_size: int) -> List[List[ds.Item]]:
        """Batches of equal shape (``runner.core.dataset.batches``), shown to every pass
        (:meth:`models.passes.Pass.batches_planned`)."""
        for p in self.passes:
            batch_size = p.batch_size(batch_size)
        out = ds.batches(list(items), batch_size)
        for p in self.passes:
            p.batches_planned(out)
        return out

    def record(self, item: ds.Item, output: Any, batch_len: int, generate_s: float) -> Dict[str, Any]:
        """The journal record of one image or video (without ``status``/``file``/``file_name``: the sink adds them):
        ``prompt`` and ``negative_prompt`` as given to the pipeline (the negative prompt is null when not applied),
        the seed, the parameters as applied (the engine's further row fields, ``Row.values``, among them), token counts, timing, and ``meta`` (the row's extra fields kept by
        ``dataset.extra_fields=keep``) when it has any; with a step cache, ``cache``: method, schedule, params and
        the forwards and blocks computed and reused in the item's pipeline call."""
        import hashlib

        from runner.core import media

        r = item.row
        spec = r.row_spec.by_name
        values = {k: v for k, v in r.values.items() if not (k in spec and spec[k].media)}  # files: under inputs
        rec: Dict[str, Any] = {
            "id": r.id, "index": item.index, "key": item.key,
            "prompt": r.prompt, "negative_prompt": r.negative_prompt,
            "prompt_sha256": hashlib.sha256(r.prompt.encode()).hexdigest(),
            "seed": item.seed,
            "params": {"width": r.width, "height": r.height, "num_inference_steps": r.num_inference_steps,
                       "guidance_scale": r.guidance_scale, "negative_prompt": r.negative_prompt,
                       **values, **self.applied_params(r), "batch_size": batch_len},
            "tokens": self.prompt_tokens([r.prompt])[0],
            "timing": {"generate_s": round(generate_s, 4)},
        }
        if r.inputs:
            rec["inputs"] = media.records(r.inputs)
        if r.ignored:
            rec["ignored"] = r.ignored
        rec.update(self.passes.record(item))  # each pass's fields (a step cache: what it did in the item's call)
        if r.meta:
            rec["meta"] = r.meta
        return rec

    def applied_params(self, row: ds.Row) -> Dict[str, Any]:
        """Further generation values that determine the item's bytes, as applied (null: not applied); none by
        default."""
        return {}

    def prompts_section(self, records: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The manifest's ``prompts``: items whose prompt a text encoder truncated, in total and per encoder, from
        the items' records (``tokens``); logged when any was."""
        out = ds.prompts_summary(records)
        if out["truncated_items"]:
            log.warning("%d of %d items had prompts truncated by a text encoder (%s); their records say how many "
                        "tokens were dropped", out["truncated_items"], out["items"],
                        ", ".join(f"{k}: {v}" for k, v in out["truncated_by_encoder"].items() if v))
        return {**out, "on_truncation": str(self.ctx.run.dataset.on_truncation),
                "on_ignored": str(self.ctx.run.dataset.on_ignored)}


class FamilyRows:
    """The family spec's row rules, for :class:`models.pipelines.PipelineEngine` (its ``spec``, ``task``, ``cfg``,
    ``video``, ``call_params()``, ``pipeline_name()``, ``family()``)."""

    def row_spec(self) -> Any:
        """The diffusion row (:meth:`DiffusionRows.row_spec`) with the family's own row fields
        (:attr:`models.family.FamilySpec.row_fields`) after its fields, under the family's name."""
        base = super().row_spec()
        extra = self.spec.row_fields if self.spec is not None else ()
        return base.extend(f"{base.name}+{self.spec.name}", *extra) if extra else base

    def row_context(self) -> Dict[str, Any]:
        """The row rule's context: the task, whether the family takes a list of reference images for it, and the
        family's tasks (named first in a refusal's fix)."""
        return {"task": self.task, "multi_image": self.spec is not None and self.task in self.spec.multi_image,
                "tasks": tuple(self.spec.tasks) if self.spec is not None else ()}

    def builtin_rows(self) -> str:
        """``dataset=builtin`` of a conditioning task reads ``<builtin_prompts stem>.<task>.jsonl`` (its input images
        beside it, under ``runner/data``), or ``builtin_prompts`` itself when it is an absolute path (a model's own
        rows file, e.g. ``${repo_root:}/models/toy_edit/builtin/edits.jsonl``); the generation task the model's
        ``builtin_prompts``.

        Raises:
            ConfigValueError: the model ships no builtin rows for the task, naming the fix.
        """
        base = str(self.cfg.builtin_prompts)
        if self.task in ("text_to_image", "text_to_video") or str(self.ctx.run.dataset.format) != "builtin":
            return base
        if Path(base).is_absolute():  # a model's own rows file (models/toy_edit/builtin/edits.jsonl), inputs beside it
            if not Path(base).is_file():
                raise ConfigValueError(f"model.builtin_prompts={base!r} (model={self.cfg.name}) is not a file; fix: "
                                       "the path of the model's rows file, or a name under runner/data")
            return base
        name = f"{Path(base).stem}.{self.task}.jsonl"
        if not (BUILTIN_PROMPTS.parent / name).is_file():
            raise ConfigValueError(f"model={self.cfg.name} ships no builtin rows for model.task={self.task} (no "
                                   f"runner/data/{name}); fix: dataset=jsonl dataset.path=<rows with image paths>")
        return name

    def check_rows(self, rows: List[Row], path: Any) -> None:
        """Every generation field set by a row or a default must be an argument of the pipeline's ``__call__``
        (else the pipeline could not apply it); then the family's rules and the oracle's vocabulary.

        Raises:
            ConfigValueError: a field the pipeline does not take, naming it, the pipeline and the fix.
        """
        params = self.call_params()
        if not self.video and "num_frames" in params:
            raise ConfigValueError(
                f"model={self.cfg.name}: {self.pipeline_name()} generates video, and model.engine={self.family()} "
                "writes images; fix: the video family's engine (model.engine=wan for WanPipeline snapshots)")
        if not self.video:
            setters = [r for r in rows if getattr(r, "fps", None) is not None]  # an image row spec has no fps
            if setters:
                r = setters[0]
                where = f"{path}:{r.line} (row {r.id!r})" if "fps" in r.set_fields else "model.generation.fps"
                raise ConfigValueError(f"fps={r.fps!r} ({where}, {len(setters)} row(s)): model={self.cfg.name} writes "
                                       "images, and fps applies to video output only; fix: remove fps from the rows "
                                       "(and model.generation)")
        for field_name, arg in CALL_ARGS.items():
            if arg in params:
                continue
            setters = [r for r in rows if getattr(r, field_name, None) is not None]
            if setters:
                r = setters[0]
                where = (f"{path}:{r.line} (row {r.id!r})" if field_name in r.set_fields else
                         f"model.generation.{field_name}")
                raise ConfigValueError(
                    f"{field_name}={getattr(r, field_name)!r} ({where}, {len(setters)} row(s)): "
                    f"{self.pipeline_name()} (model={self.cfg.name}) takes no {arg} argument, so it cannot be "
                    f"applied; fix: remove {field_name} from the rows (and model.generation), or use a model "
                    "that takes it")
        self.check_family_rows(rows, path)
        if self.cfg.oracle:
            oracle(self.cfg.oracle).check_expectations(rows, path)

    def ignored_fields(self, rows: Sequence[Row]) -> Dict[str, Tuple[str, ...]]:
        """``true_cfg_scale`` > 1 on a pipeline whose ``__call__`` takes no ``true_cfg_scale`` (SD3, Wan: their
        guidance is ``guidance_scale``), then the rules of the spec's guidance mode
        (:func:`models.family.negative_prompt_ignored`). Families add their own rules to these."""
        tc = float(self.cfg.generation.true_cfg_scale)
        out: Dict[str, Tuple[Any, ...]] = {}
        if tc > 1 and "true_cfg_scale" not in self.call_params():
            out["true_cfg_scale"] = (f"{self.pipeline_name()} takes no true_cfg_scale (its classifier-free "
                                     "guidance is guidance_scale)", "set guidance_scale instead")
        if self.spec is not None:
            out.update(negative_prompt_ignored(self.spec.cfg, self.pipeline_name(), tc, rows, self.spec.guidance_hint,
                                               self.spec.cfg_threshold))
        return out

    def check_family_rows(self, rows: List[Row], path: Any) -> None:
        """Family rules on row values the pipeline would otherwise change silently; none by default."""

    def check_frame_counts(self, rows: List[Row], path: Any, t: int) -> None:
        """A video family's frame rule: ``num_frames`` of every row must be ``k * t + 1`` (``t``: the VAE's temporal
        factor), the counts a causal video VAE decodes back (WanPipeline and LTX2Pipeline turn others into
        ``(n - 1) // t * t + 1`` frames: the video would have fewer frames than its record says).

        Raises:
            DatasetError: every bad row (file:line), with the nearest valid counts.
            ConfigValueError: the bad value is ``model.generation.num_frames`` (every bad row took the default).
        """
        from runner.core.dataset import DatasetError

        bad = [r for r in rows if r.num_frames is None or r.num_frames < 1 or (r.num_frames - 1) % t]
        if not bad:
            return

        def fix(n: Optional[int]) -> str:  # the valid counts around n, within the rows' range (1..MAX_FRAMES)
            lo = max(1, ((n or 1) - 1) // t * t + 1)
            return f"{lo} or {lo + t}" if lo + t <= MAX_FRAMES else str(lo)

        why = f"which model={self.cfg.name}'s VAE needs (temporal factor {t}; {self.pipeline_name()} would round it down"
        defaults = [r for r in bad if "num_frames" not in r.set_fields]
        if defaults and len(defaults) == len(bad):
            n = defaults[0].num_frames
            raise ConfigValueError(f"model.generation.num_frames={n} is not {t}k+1, {why}); fix: "
                                   f"model.generation.num_frames={fix(n).split(' or ')[0]}")
        raise DatasetError([f"{path}:{r.line}: num_frames={r.num_frames} is not {t}k+1, {why}, writing fewer frames "
                            f"than recorded); fix: num_frames={fix(r.num_frames)}" for r in bad])
