"""Prompt tokens of a diffusion stage: what each text encoder is given and drops, counted with the tokenizers the
pipeline uses (no weights load), and the truncation rule (``dataset.on_truncation``) as a pass.

:class:`PromptTokens` is a part of :class:`models.pipelines.PipelineEngine`: the tokenizers (the snapshot's, built
ones for embedded and dummy weights, the loaded pipeline's once loaded; kinds of :mod:`models.tokenizer_kinds`),
each encoder's limit and count (families override ``token_limit`` / ``count_tokens`` / ``sequence_limit``), and
``prompt_tokens(prompts)``, which every item's record carries under ``tokens``.

:class:`TruncationPass` (:mod:`models.passes`) refuses or records prompts longer than an encoder takes: at startup
for the dataset's prompts, per batch for prompts an upstream stage feeds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from models import snapshot, tokenizer_kinds
from models.passes import Pass

log = logging.getLogger("runner")


class PromptTokens:
    """Tokenizers and token counts per text encoder, for :class:`models.pipelines.PipelineEngine` (its
    ``tokenizers_spec``, ``pipe``, ``source``, ``cfg``, ``max_sequence_length_limit``, ``_toks``, ``_token_cache``)."""

    def tokenizers(self) -> Dict[str, Any]:
        """``{encoder label: tokenizer}`` as the pipeline uses them, without loading weights: the snapshot's
        tokenizer folders (``model.path``, or an embedded model already in the cache), else built from the
        architecture exactly as :meth:`build_components` builds them; the loaded pipeline's own once loaded."""
        if self._toks is None:
            if self.pipe is not None:
                self._toks = {label: getattr(self.pipe, comp) for comp, (_k, label, _e) in self.tokenizers_spec.items()}
            else:
                if not self.source:
                    self.resolve_source()
                kind = self.source.get("kind")
                target = self.embedded_target(self.arch_copy()) if kind == "embedded" else None
                root = (Path(self.source["path"]) if kind == "path" else
                        target if target is not None and (target / "model_index.json").is_file() else None)
                by_comp = (self.snapshot_tokenizers(root) if root is not None else
                           self.build_tokenizers(self.arch_copy(), self.task) if self.task is not None else
                           self.build_tokenizers(self.arch_copy()))
                self._toks = {label: by_comp[comp] for comp, (_k, label, _e) in self.tokenizers_spec.items()}
            self._token_cache = {}
        return self._toks

    def snapshot_tokenizers(self, path: Path) -> Dict[str, Any]:
        """``{tokenizer component: tokenizer}`` of a snapshot (:func:`models.snapshot.snapshot_tokenizers`); no
        weights load.

        Raises:
            ModelPathError: a tokenizer the pipeline needs is missing or cannot be read.
        """
        return snapshot.snapshot_tokenizers(path, self.tokenizers_spec, self.pipeline_name())

    def token_limit(self, label: str, tok: Any) -> int:
        """The most tokens encoder ``label`` sees: CLIP-style encoders their tokenizer's ``model_max_length``, the
        others ``model.generation.max_sequence_length``."""
        kind = next(k for k, lab, _ in self.tokenizers_spec.values() if lab == label)
        return (int(tok.model_max_length) if tokenizer_kinds.get(kind).fixed_length else
                int(self.cfg.generation.max_sequence_length))

    def count_tokens(self, label: str, tok: Any, prompts: List[str]) -> List[int]:
        """Tokens encoder ``label`` would be given for each prompt, untruncated, with special tokens."""
        return [len(ids) for ids in tok(prompts, truncation=False, verbose=False)["input_ids"]]

    def prompt_tokens(self, prompts: Sequence[str]) -> List[Dict[str, Dict[str, int]]]:
        """Per prompt, per text encoder: ``{"count", "limit", "dropped"}`` (tokens with the special tokens,
        untruncated; the most the encoder sees; tokens past the limit, never seen)."""
        toks = self.tokenizers()
        todo = sorted({p for p in prompts if p not in self._token_cache})
        if todo:
            limits = {lab: self.token_limit(lab, t) for lab, t in toks.items()}
            counts = {lab: self.count_tokens(lab, t, todo) for lab, t in toks.items()}
            for i, p in enumerate(todo):
                self._token_cache[p] = {lab: {"count": counts[lab][i], "limit": limits[lab],
                                              "dropped": max(0, counts[lab][i] - limits[lab])} for lab in limits}
        return [self._token_cache[p] for p in prompts]

    def sequence_limit(self) -> Optional[int]:
        """The most ``model.generation.max_sequence_length`` may ask for: the pipeline's ceiling, or the sequence
        tokenizer's ``model_max_length`` if lower (None: no ceiling known)."""
        limit = self.max_sequence_length_limit
        for kind, label, _ in self.tokenizers_spec.values():
            if not tokenizer_kinds.get(kind).fixed_length:
                m = getattr(self.tokenizers()[label], "model_max_length", None)
                if m and m < 10 ** 9:
                    limit = int(m) if limit is None else min(limit, int(m))
        return limit

    def truncation_fix(self, counts: Dict[str, Dict[str, int]]) -> str:
        """A remedy to add to a truncation refusal: raising ``max_sequence_length`` where a sequence encoder dropped
        tokens and the model takes more."""
        limit, msl = self.sequence_limit(), int(self.cfg.generation.max_sequence_length)
        seq = [lab for k, lab, _ in self.tokenizers_spec.values() if not tokenizer_kinds.get(k).fixed_length]
        if limit and any(counts.get(lab, {}).get("dropped") for lab in seq) and msl < limit:
            return f", raise model.generation.max_sequence_length (now {msl}, at most {limit})"
        return ""


def describe(counts: Dict[str, Dict[str, int]]) -> str:
    """``counts`` of one prompt's truncated encoders in words (for messages)."""
    return ", ".join(f"{enc} {c['count']} tokens, {c['dropped']} over its limit of {c['limit']}"
                     for enc, c in counts.items() if c["dropped"])


class TruncationPass(Pass):
    """``dataset.on_truncation`` (:mod:`models.passes`): dataset prompts longer than a text encoder takes are
    logged with their counts, or refused with ``dataset.on_truncation=error`` (file:line, encoder, count, limit,
    fix); a stage whose prompts an upstream stage feeds is checked per batch instead (:meth:`before_call`: the batch
    raises, and the loop fails that item alone with the reason). The engine provides ``prompt_tokens(prompts)`` and
    ``truncation_fix(counts)``."""

    name = "truncation"

    def fed(self) -> bool:
        """The stage's prompts are built from an upstream stage's output (known only after that stage ran)."""
        e = self.engine
        pipeline = list(getattr(e.ctx.run.model, "pipeline", None) or []) if e.ctx.run is not None else []
        return bool(pipeline) and pipeline[-1] == e.stage and len(pipeline) > 1

    def prepare_rows(self, rows: List[Any], path: Any) -> List[Any]:
        """Raises:
            runner.core.dataset.DatasetError: ``on_truncation=error``, every truncated row."""
        from runner.core.dataset import DatasetError

        e = self.engine
        if self.fed():
            return rows
        counts = e.prompt_tokens([r.prompt for r in rows])
        over = [(r, c) for r, c in zip(rows, counts) if any(x["dropped"] for x in c.values())]
        if not over:
            return rows
        if str(e.ctx.run.dataset.on_truncation) == "error":
            raise DatasetError([f"{path}:{r.line}: prompt of row {r.id!r} is truncated: {describe(c)}; the image would "
                                "be that of its first tokens only; fix: shorten the prompt" + e.truncation_fix(c)
                                + ", or dataset.on_truncation=record to run it and record the tokens dropped"
                                for r, c in over])
        per = {enc: sum(1 for _, c in over if c.get(enc, {}).get("dropped")) for enc in counts[0]}
        log.warning("%d of %d rows have prompts longer than a text encoder takes (%s); the encoder sees their first "
                    "tokens, and each item records its token counts and the tokens dropped (dataset.on_truncation="
                    "error refuses them)", len(over), len(rows),
                    ", ".join(f"{enc}: {n} over {counts[0][enc]['limit']}" for enc, n in per.items() if n))
        return rows

    def before_call(self, batch: Sequence[Any]) -> None:
        """Raises:
            runner.core.dataset.DatasetError: a fed prompt is truncated under ``on_truncation=error``, naming the
                row, the encoder and the counts."""
        e = self.engine
        if not self.fed() or str(e.ctx.run.dataset.on_truncation) != "error":
            return
        from runner.core.dataset import DatasetError

        bad = [(it, c) for it, c in zip(batch, e.prompt_tokens([it.row.prompt for it in batch]))
               if any(x["dropped"] for x in c.values())]
        if bad:
            raise DatasetError([f"row {it.row.id!r} (line {it.row.line}): the prompt fed by the upstream stage is "
                                f"truncated: {describe(c)} (dataset.on_truncation=error)" for it, c in bad])
