"""The engine protocol: what one stage of a run must provide to the run loop (``runner.app.execute.run``).

An engine runs one stage of a run (``denoise`` of a diffusion model, ``generate`` of an AR model, ``expand`` of a
pipeline). The loop calls it in this order, and only in this order:

1. ``check_config()``: run-config checks of this engine's own fields (no I/O).
2. ``prepare()``: everything that needs no weights: the weight source checked, the backends resolved under the
   precedence contract and checked against the platform (fail closed). Returns the manifest's ``model.source``.
3. ``read_rows()`` / ``items(rows, seed)``: the dataset read and validated for this engine by the one row driver
   (``runner.core.dataset.validate_rows``) over the engine's ``row_spec()`` (its fields: type, check, identity,
   batching key, default), then the work items.
   ``check_inputs(rows)`` lets an upstream stage check the prompts it will be fed (token counts).
4. ``load(on_loaded)``: weights, backends installed, probes attached; returns manifest sections to add.
5. ``batches(items, batch_size)``; ``warmup(batch)`` (may do nothing), then ``generate(batch)`` per batch: one
   :class:`ImageOutput`, :class:`VideoOutput` or :class:`TextOutput` per item (by the engine's ``output``), in batch
   order; raising fails the batch (the loop retries its items alone).
6. ``record(item, output, batch_len, generate_s)``: the journal record of one item (without ``status``/``file``:
   the sink adds those once the artifact is durable).
7. ``evidence(result)``: the stage's evidence section and its mismatches, from what was observed;
   ``prompts_section(records)``: the manifest's ``prompts`` (truncated prompts counted), from the final journal.
8. ``close()``: free the engine (always called, also after an error).

Every ``check_config``/``prepare``/``read_rows``/``check_inputs`` error is a ``runner.core.errors.RunnerError``
raised before any weight loads. Engines are looked up by name in :mod:`models.registry` (lazy import paths).
Model knowledge (forward counts, FP8 module prefixes, oracles) lives with the model's engine, not in the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np

from runner.core.schema import RunConfig, to_typed


@dataclass
class ImageOutput:
    """One generated image: ``image`` float32, layout (H, W, C), values in [0, 1]; NaN/inf are kept so that the
    sink can refuse a non-finite output instead of writing it."""

    image: np.ndarray

    def nonfinite(self) -> int:
        """Number of non-finite values (0: the image can be written)."""
        return int((~np.isfinite(self.image)).sum())


@dataclass
class VideoOutput:
    """One generated video: ``frames`` layout (F, H, W, C) with C = 3 (RGB), frames in time order, either ``uint8``
    (the bytes the sinks write: converted on the device that decoded them, ``models.video_decode.frames_arrays``) or
    float32 in [0, 1] (what ``diffusers.WanPipeline(..., output_type="np").frames[i]`` holds; NaN/inf are kept so
    that the sink can refuse a non-finite output instead of writing it). ``fps``: the frame rate (frames per second) the
    engine generated for, used when the record's ``params`` carry no ``fps`` (``runner.core.sinks.MP4Sink``).
    ``audio``: the video's sound track, float32 (channels, samples) in [-1, 1] (``LTX2Pipeline``'s ``audio[i]``),
    at ``sample_rate`` Hz; None: a silent video (no audio stream is written)."""

    frames: np.ndarray
    fps: Optional[float] = None
    audio: Optional[np.ndarray] = None
    sample_rate: Optional[int] = None

    def nonfinite(self) -> int:
        """Number of non-finite values of the frames and the audio (0: the video can be written)."""
        bad = int((~np.isfinite(self.frames)).sum())
        return bad + (int((~np.isfinite(self.audio)).sum()) if self.audio is not None else 0)


@dataclass
class TextOutput:
    """One generated text record (an AR output): ``record`` holds ``id``, ``key``, ``prompt``,
    ``prompt_token_ids``, ``output_token_ids``, ``text``, ``finish_reason``, ``timing``, ``tokens``, ..."""

    record: Dict[str, Any]


@dataclass
class StageContext:
    """What the loop hands an engine when it builds it.

    Attributes:
        cfg: the composed run config; only handed on to the precedence resolution of ``runner.core.resolve``
            (which reads its layers together with ``overrides``). Engines read settings from ``run``.
        overrides: the CLI overrides (they decide the CLI precedence layers).
        stage: the stage name (``denoise``, ``generate``, ``expand``).
        plat: ``runner.core.platform.PlatformInfo`` of this process.
        dtype: ``torch.dtype`` of the stage's compute.
        parallel: the context-parallel ``runner.core.distributed.Layout`` of the run (``parallelism=ulysses|ring``),
            None otherwise; an engine that cannot split a sequence refuses it in ``prepare``.
        run: the run config as the schema's dataclasses (``runner.core.schema.to_typed``): typed run-level groups
            (``run.optimize.compile_cache``, ``run.dataset.format``); built from ``cfg`` when not given.
        model: the stage's model config as its family's dataclass (``run.model``, or
            ``run.model.stages[<stage>].model`` in a pipeline), built by ``runner.app.stages.stage_graph``;
            ``run.model`` when not given.
    """

    cfg: Any
    overrides: Sequence[str]
    stage: str
    plat: Any
    dtype: Any
    parallel: Any = None
    run: Optional[RunConfig] = None
    model: Any = None

    def __post_init__(self) -> None:
        if self.run is None and self.cfg is not None:
            self.run = self.cfg if isinstance(self.cfg, RunConfig) else to_typed(self.cfg)
        if self.model is None and self.run is not None:
            self.model = self.run.model


@dataclass
class StageResult:
    """What the loop observed while a stage generated, handed to :meth:`Engine.evidence`.

    Attributes:
        records: the journal records written with ``status: ok`` in this process, in order.
        nonfinite: items refused because their output held NaN/inf.
        generated: whether any batch was generated (False: every item was reused from an earlier run).
    """

    records: List[Dict[str, Any]] = field(default_factory=list)
    nonfinite: int = 0
    generated: bool = False


@runtime_checkable
class Engine(Protocol):
    """One stage's model: see the module docstring for the call order.

    Class attributes:
        output: ``"image"`` (written by the PNG sink), ``"video"`` (the MP4 sink; the record's ``params.fps``, else
            ``VideoOutput.fps``, is the frame rate) or ``"text"`` (the text-record sink): a key of
            ``runner.core.sinks.SINKS``.
        unit: the progress-bar unit (``img``, ``video``, ``row``).
        resumable: a re-run into the run dir reuses finished items (otherwise a dir holding a run is refused).
        default_stage: the stage name of a single-stage model (``denoise``, ``generate``).

    ``stage_model_cfg(run, stage)`` is the typed model config of this engine's stage in a pipeline, from the typed
    run config (``runner.core.schema.RunConfig``); ``items_from(rows)``
    turns downstream dataset rows into this engine's items when it feeds another stage.
    """

    output: ClassVar[str]
    unit: ClassVar[str]
    resumable: ClassVar[bool]
    default_stage: ClassVar[str]
    stage: str
    source: Dict[str, Any]

    @classmethod
    def stage_model_cfg(cls, run: RunConfig, stage: str) -> Any: ...

    def items_from(self, rows: Sequence[Any]) -> List[Any]: ...

    def check_config(self) -> None: ...

    def prepare(self) -> Dict[str, Any]: ...

    def row_spec(self) -> Any: ...

    def read_rows(self) -> Tuple[List[Any], Path]: ...

    def items(self, rows: Sequence[Any], run_seed: int) -> List[Any]: ...

    def check_inputs(self, rows: Sequence[Any], path: Any) -> None: ...

    def batches(self, items: Sequence[Any], batch_size: int) -> List[List[Any]]: ...

    def backends_section(self) -> Dict[str, Any]: ...

    def start_parallel(self) -> None: ...

    def load(self, on_loaded: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]: ...

    def warmup(self, batch: Sequence[Any]) -> float: ...

    def generate(self, batch: Sequence[Any]) -> List[Any]: ...

    def record(self, item: Any, output: Any, batch_len: int, generate_s: float) -> Dict[str, Any]: ...

    def evidence(self, result: StageResult) -> Tuple[Dict[str, Any], List[str]]: ...

    def timing_phases(self, generate_s: float) -> Dict[str, float]: ...

    def timing_extra(self, result: StageResult, generate_s: float) -> Dict[str, Any]: ...

    def final_sections(self) -> Dict[str, Any]: ...

    def accuracy(self, items: Sequence[Any], records: Dict[str, Dict[str, Any]], out_dir: Path
                 ) -> Optional[Dict[str, Any]]: ...

    def prompts_section(self, records: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]: ...

    def close(self) -> None: ...


class EngineBase:
    """Defaults of the protocol's optional steps, for engines to inherit (no probing with ``hasattr``: every
    engine has every method)."""

    output: ClassVar[str] = "image"
    unit: ClassVar[str] = "item"
    resumable: ClassVar[bool] = False
    default_stage: ClassVar[str] = "generate"
    applies_cache: ClassVar[bool] = False
    """The engine applies ``cache.*`` (step caching of a denoiser); a run with a cache and no such engine is
    refused."""
    stage: str = ""

    @classmethod
    def stage_model_cfg(cls, run: RunConfig, stage: str) -> Any:
        """``run.model.stages[<stage>].model`` of a pipeline (typed)."""
        return run.model.stages[stage].model

    def lossy_traits(self) -> Dict[str, Any]:
        """What the engine's configured features say about the run's lossy lanes (``runner.core.lossy.section``'s
        keyword arguments: ``cache_schedule``, a step cache's validated schedule); none by default."""
        return {}

    def items_from(self, rows: Sequence[Any]) -> List[Any]:
        """An engine that cannot feed another stage refuses to be placed before one.

        Raises:
            runner.core.errors.UserInputError: naming the stage.
        """
        from runner.core.errors import UserInputError

        raise UserInputError(f"stage {self.stage!r} ({type(self).__name__}) cannot feed another stage; fix: put it "
                             "last in model.pipeline")

    def row_spec(self) -> Any:
        """The engine's dataset row spec (``runner.core.dataset.RowSpec``); the diffusion row
        (``runner.core.dataset.VIDEO_ROW``) by default."""
        from runner.core.dataset import VIDEO_ROW

        return VIDEO_ROW

    def check_config(self) -> None:
        """No engine-specific config checks."""

    def check_inputs(self, rows: Sequence[Any], path: Any) -> None:
        """An upstream stage accepts any downstream prompt."""

    def start_parallel(self) -> None:
        """Under context parallelism (``ctx.parallel``), create what its ranks share (device mesh, process groups):
        called by every rank at the same point, after every startup check and before any stage loads. Nothing by
        default (an engine that cannot split a sequence refuses it in ``prepare``)."""

    def warmup(self, batch: Sequence[Any]) -> float:
        """No warm-up; returns 0 seconds."""
        return 0.0

    def timing_phases(self, generate_s: float) -> Dict[str, float]:
        """No per-phase timing."""
        return {}

    def timing_extra(self, result: StageResult, generate_s: float) -> Dict[str, Any]:
        """No engine-specific timing figures."""
        return {}

    def final_sections(self) -> Dict[str, Any]:
        """Manifest sections the engine's features own at the end of the run (``{name: section}``: ``compile``);
        none by default."""
        return {}

    def accuracy(self, items: Sequence[Any], records: Dict[str, Dict[str, Any]], out_dir: Path
                 ) -> Optional[Dict[str, Any]]:
        """No oracle."""
        return None

    def prompts_section(self, records: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """The manifest's ``prompts`` (what the text encoders truncated, fields ignored), from the final journal's
        records; None: nothing to report."""
        return None

    def close(self) -> None:
        """Nothing to free."""


# ------------------------------------------------------------------------------------- startup checks of models
#: Weight files deserialized with pickle (``torch.load`` can run code from them): never loaded by the runner.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def pickle_only_weights(folder: Path) -> Optional[Path]:
    """The first pickle weight file of ``folder`` (top level) when it holds no ``*.safetensors`` file, else None:
    such a folder can only be loaded by unpickling."""
    folder = Path(folder)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return None
    return next((f for f in sorted(folder.iterdir()) if f.is_file() and f.suffix in PICKLE_SUFFIXES), None)


def unknown_init_keys(cls: type, keys: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(keys cls(**kw) does not take, names it takes)``: from its ``__init__`` signature, plus, for a
    transformers config (which may store any keyword silently), its ``attribute_map`` aliases and the attributes of
    a default instance. A class taking ``**kwargs`` otherwise is not checked (``([], [])``)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    is_config = hasattr(cls, "attribute_map") and hasattr(cls, "to_dict")
    if any(p.kind is p.VAR_KEYWORD for p in params.values()) and not is_config:
        return [], []
    takes = {n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if is_config:
        takes |= set(getattr(cls, "attribute_map", None) or {})
        try:
            takes |= set(cls().to_dict())
        except Exception:  # noqa: BLE001 - a config without defaults: its signature alone
            pass
    return sorted(k for k in keys if k not in takes), sorted(takes)


def check_init_keys(cls: type, keys: Sequence[str], where: str) -> None:
    """Refuse keys of a config node (``where``, dotted) that ``cls`` does not take, before anything is built.

    Raises:
        runner.core.errors.ConfigValueError: naming the key, the class, the closest parameter and the fix.
    """
    import difflib

    from runner.core.errors import ConfigValueError

    unknown, takes = unknown_init_keys(cls, keys)
    if not unknown:
        return
    k = unknown[0]
    close = difflib.get_close_matches(k, takes, n=1)
    raise ConfigValueError(
        f"{where}.{k} is not a parameter of {cls.__module__.split('.')[0]}.{cls.__name__} (it would fail or be "
        f"ignored when the model is built)" + (f"; did you mean {where}.{close[0]}?" if close else "")
        + f" fix: remove or correct it" + ("" if close else f" (it takes: {', '.join(takes)})")
        + (f"; also unknown: {', '.join(unknown[1:])}" if len(unknown) > 1 else ""))
