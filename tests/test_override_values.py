"""Values of command-line overrides at any depth get the runner's message, not OmegaConf's (issue #38): a closed
choice outside its values (``memory.offload``, ``model.task``, ``model.lora_fuse``, every enum of the schema), a
list of adapters given one path (``model.lora=/x.safetensors``), plain strings or entries with a misspelt key
(``model.lora=[{pth: ...}]``), a typed leaf given another type. Each message names the key, the value and a fix
that composes (checked by composing it)."""

from __future__ import annotations

import shlex
from typing import List, Tuple

import pytest
from omegaconf import DictConfig
from omegaconf.nodes import EnumNode

from runner.app.console import _value_problem, override_key_problem

ADAPTER = "/data/adapters/blue.safetensors"

# (override, the message's text before "fix:", the fix): inputs C27-C32 of issue #38 and the same kind elsewhere
CASES: List[Tuple[str, str, str]] = [
    (f"model.lora={ADAPTER}",
     f"model.lora={ADAPTER}: model.lora is a list of entries {{path, scale, name, expert}}, not a single value",
     f"model.lora=[{{path:{ADAPTER}}}]"),
    (f"model.lora=[{{pth:{ADAPTER}}}]",
     "model.lora[0].pth is not a key of model.lora[0], which takes: path, scale, name, expert; did you mean "
     "model.lora[0].path?", f"model.lora=[{{path:{ADAPTER}}}]"),
    (f"model.lora=[{ADAPTER},/data/b.safetensors]",
     f"model.lora[0]={ADAPTER}: each entry of model.lora is {{path, scale, name, expert}}, not a plain value",
     f"model.lora=[{{path:{ADAPTER}}},{{path:/data/b.safetensors}}]"),
    ("model.lora=[{scale:0.5}]", "model.lora[0] has no path (each entry is {path, scale, name, expert})",
     "model.lora=[{path:<path>,scale:0.5}]"),
    (f"model.lora=[{{path:{ADAPTER},scale:strong}}]", "model.lora[0].scale=strong is not a number",
     f"model.lora=[{{path:{ADAPTER},scale:<number>}}]"),
    ("memory.offload=sequentail",
     "memory.offload=sequentail is not a value of memory.offload, which takes: auto, none, model, group_block, "
     "group_leaf", "memory.offload=<auto/none/model/group_block/group_leaf>"),
    ("memory.offload=gruop_block", "memory.offload=gruop_block is not a value of memory.offload, which takes: auto, "
     "none, model, group_block, group_leaf; did you mean group_block?", "memory.offload=group_block"),
    ("model.task=img2img", "model.task=img2img is not a value of model.task, which takes: text_to_image, "
     "image_to_image, inpaint, edit, text_to_video, image_to_video; did you mean image_to_image?",
     "model.task=image_to_image"),
    ("model.lora_fuse=unfsed", "model.lora_fuse=unfsed is not a value of model.lora_fuse, which takes: auto, fused, "
     "unfused; did you mean unfused?", "model.lora_fuse=unfused"),
    ("dtype=bf16", "dtype=bf16 is not a value of dtype, which takes: auto, float32, bfloat16, float16; did you mean "
     "bfloat16?", "dtype=bfloat16"),
    ("batch_size=four", "batch_size=four is not an integer", "batch_size=<integer>"),
    ("model.roles=joint", "model.roles=joint: model.roles is a list, not a single value", "model.roles=[joint]"),
]


@pytest.mark.parametrize("arg,says,fix", CASES, ids=[c[0] for c in CASES])
def test_nested_override_value_gets_field_value_and_a_fix_that_composes(arg, says, fix, compose):
    msg = override_key_problem(["model=toy_shapes", arg])
    assert msg is not None, arg
    text, _, fix_arg = msg.partition(" fix: ")
    assert text.rstrip(";") == says, msg
    (fixed,) = shlex.split(fix_arg)  # quoted for the shell where brackets need it: one argument
    assert fixed == fix, msg
    if "<" not in fixed:  # a concrete fix composes and passes the check itself
        assert override_key_problem(["model=toy_shapes", fixed]) is None
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        o = OverridesParser.create().parse_override(fixed)
        got = OmegaConf.select(compose(["model=toy_shapes", fixed]), o.key_or_group)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        want = o.value()
        if isinstance(want, list) and want and isinstance(want[0], dict):  # the schema fills the entries' defaults
            want = [{"scale": 1.0, "name": None, "expert": None, **w} for w in want]
        assert got == want, (fixed, got)


def test_adapter_path_as_a_string_is_refused_before_hydra_with_exit_2(subprocess_env, tmp_path):
    """C28: ``model.lora=<path>`` (the natural first try) was a Hydra error; now exit 2, the fix, no run dir."""
    from _helpers import cli

    run = tmp_path / "run"
    p = cli([f"model.lora={ADAPTER}", f"hydra.run.dir={run}"], subprocess_env, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert f"fix: 'model.lora=[{{path:{ADAPTER}}}]'" in p.stderr, out
    assert "Traceback" not in out and "Invalid value assigned" not in out and "To append" not in out
    assert not run.exists()


def test_a_forced_override_of_an_existing_key_is_checked_too():
    """``++model.lora=<path>`` (Hydra's force-set) reached OmegaConf's "str is not a ListConfig"; a key ``++`` adds
    is left to the schema check."""
    msg = override_key_problem(["model=toy_shapes", f"++model.lora={ADAPTER}"])
    assert msg is not None and msg.endswith(f"fix: 'model.lora=[{{path:{ADAPTER}}}]'"), msg
    assert override_key_problem(["model=toy_shapes", "++model.architecture.new_key=1", "++foo.bar=2"]) is None


def test_sweep_choice_is_checked_and_the_fix_keeps_the_other_choices():
    msg = override_key_problem(["-m", "model=toy_shapes", "model.lora_fuse=fused,unfsed"])
    assert msg is not None and msg.endswith("did you mean unfused? fix: 'model.lora_fuse=fused,unfused'"), msg


def test_valid_values_pass():
    ok = ["model=toy_shapes", "memory.offload=group_block", "model.task=text_to_image", "model.lora_fuse=fused",
          f"model.lora=[{{path:{ADAPTER},scale:0.5,name:blue}}]", "model.lora=[]", "batch_size=4", "model.task=null",
          "dtype=float16", "compile=regional"]
    assert override_key_problem(ok) is None


def _enum_nodes(node, where: str = ""):
    """(dotted key, node) of every closed choice of a composed config."""
    for k in node.keys():
        child = node._get_node(k)
        key = f"{where}.{k}" if where else str(k)
        if isinstance(child, EnumNode):
            yield key, child
        elif isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from _enum_nodes(child, key)


@pytest.mark.parametrize("model", ["toy_shapes", "tiny_qwen3_moe", "prompt_expand_flux"])
def test_every_closed_choice_of_the_schema_names_its_values(model, compose):
    """The kind, not the five inputs: every enum node of the composed config (run level, model, stages) refuses a
    value outside its choices with the key, the value and the choices, and takes each of its choices."""
    cfg = compose([f"model={model}"])
    nodes = dict(_enum_nodes(cfg))
    assert {"dtype", "compile", "memory.offload"} <= set(nodes), sorted(nodes)
    if model == "toy_shapes":
        assert {"model.task", "model.lora_fuse", "model.load_format"} <= set(nodes), sorted(nodes)
    for key, node in nodes.items():
        allowed = [m.name for m in node.enum_type]
        for value in allowed:
            assert _value_problem(key, node, value) is None, (key, value)
        msg, fix = _value_problem(key, node, "zzz_not_a_choice")
        assert msg == f"{key}=zzz_not_a_choice is not a value of {key}, which takes: {', '.join(allowed)}", msg
        assert fix == f"<{'/'.join(allowed)}>"
