"""Context parallelism's own rules (models/context_parallel.py), for the mutation run (benchmarks/mutation.py,
group ``context_parallel``): the refusals of :func:`check_model` with their messages, the collectives the
evidence expects, the profiler names :data:`COLLECTIVES` matches, and :func:`setup` + :func:`enable` on a tiny
FluxTransformer2DModel in a real 2-rank gloo world (Ulysses 2): the manifest section each rank returns, and the
split model's output equal to the unsplit model's."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from models.context_parallel import COLLECTIVES, check_model, expected_collectives
from runner.core.distributed import Layout, ParallelismUnsupportedError

REPO = Path(__file__).resolve().parent.parent


def test_a_denoiser_class_without_a_plan_is_refused_naming_it():
    import diffusers

    for cls in ("NoSuchTransformer", "UNet2DConditionModel", "DDPMScheduler"):  # the last: no ModelMixin at all
        with pytest.raises(ParallelismUnsupportedError) as e:
            check_model("m", cls, {}, Layout("ulysses", data=1, ring=1, ulysses=2))
        assert str(e.value) == (
            f"parallelism=ulysses: model=m's denoiser {cls} has no context-parallel plan (`_cp_plan`) in diffusers "
            f"{diffusers.__version__}, so diffusers cannot split its sequence; fix: parallelism=data or single "
            "(diffusers plans exist for Flux, Qwen-Image and Wan, among others)")


@pytest.mark.parametrize("heads,degree,fix", [(3, 2, "parallelism.ulysses_degree in [3]"),
                                              (6, 4, "parallelism.ulysses_degree in [2, 3, 6]"),
                                              (1, 2, "parallelism=ring")])
def test_heads_not_a_multiple_of_the_ulysses_degree_are_refused_with_the_degrees_that_fit(heads, degree, fix):
    with pytest.raises(ParallelismUnsupportedError) as e:
        check_model("m", "FluxTransformer2DModel", {"num_attention_heads": heads},
                    Layout("ulysses", data=1, ring=1, ulysses=degree))
    assert str(e.value) == (
        f"parallelism.ulysses_degree={degree}: model=m has {heads} attention heads, not a multiple of {degree} "
        f"(Ulysses gives each rank heads / ulysses_degree of them); fix: {fix} or use ring_degree")


@pytest.mark.parametrize("config,lay", [({"num_attention_heads": 4}, Layout("ulysses", data=1, ring=1, ulysses=2)),
                                        ({"num_attention_heads": 3}, Layout("ring", data=1, ring=2, ulysses=1)),
                                        ({}, Layout("ulysses", data=1, ring=1, ulysses=2))])
def test_what_diffusers_can_split_passes(config, lay):
    check_model("m", "FluxTransformer2DModel", config, lay)


# expected_collectives over each layout (ring 2 and 3, Ulysses, both, none): tests/test_ring_ulysses.py


@pytest.mark.parametrize("name,kind", [("c10d::alltoall_", "all_to_all"), ("_c10d_functional::all_to_all_single",
                                        "all_to_all"), ("ncclDevKernel_SendRecv", "all_to_all"),
                                       ("ncclKernel_SendRecv", "all_to_all"),
                                       ("c10d::allgather_", "all_gather"), ("ncclDevKernel_AllGather_RING",
                                        "all_gather"), ("ncclKernel_AllGather", "all_gather"),
                                       ("_c10d_functional::all_gather_into_tensor", "all_gather")])
def test_collective_names_the_profiler_shows(name, kind):
    assert {k for k, rx in COLLECTIVES.items() if re.search(rx, name)} == {kind}


WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from diffusers import FluxTransformer2DModel
    from diffusers.models.attention_dispatch import AttentionBackendName
    from models.context_parallel import enable, setup
    from runner.core.distributed import Layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)).eval()
    for m in model.modules():
        if hasattr(m, "processor"):
            m.processor._attention_backend = AttentionBackendName.NATIVE
    g = torch.Generator().manual_seed(1)
    S, T = 8, 4
    inputs = dict(hidden_states=torch.randn(1, S, 4, generator=g), encoder_hidden_states=torch.randn(1, T, 16, generator=g),
                  pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.randn(S, 3, generator=g), txt_ids=torch.zeros(T, 3))
    with torch.no_grad():
        full = model(**inputs, return_dict=False)[0]
    config = setup(Layout("ulysses", data=1, ring=1, ulysses=2), "cpu")
    section = enable(model, config)
    with torch.no_grad():
        split = model(**inputs, return_dict=False)[0]
    print("RESULT " + json.dumps({"rank": rank, "section": section, "err": float((split - full).abs().max()),
                                  "resolver_left": "_resolve_parallel_config" in vars(model),
                                  "parallel_config": model._parallel_config is config}), flush=True)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_setup_and_enable_split_a_denoiser_over_two_gloo_ranks():
    port, procs = str(_free_port()), []
    for r in range(2):
        env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r),
                   WORLD_SIZE="2", LOCAL_RANK=str(r), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = {}
    for p in procs:
        so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-3000:]
        doc = json.loads(next(l for l in so.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
        out[doc["rank"]] = doc
    for r in (0, 1):
        d = out[r]
        assert d["err"] < 1e-5, d["err"]
        assert d["resolver_left"] is False and d["parallel_config"] is True
        s = d["section"]
        assert s["implementation"] == "diffusers ContextParallelConfig + ModelMixin.enable_parallelism"
        assert (s["ulysses_degree"], s["ring_degree"], s["ulysses_rank"], s["ring_rank"]) == (2, 1, r, 0)
        assert s["process_group_backend"] == "gloo" and s["device"] == "cpu"
        assert s["diffusers_attention_backends"] == ["native"]
        plan = s["plan"]
        assert plan["<model>"] == {"hidden_states": "split dim 1", "encoder_hidden_states": "split dim 1",
                                   "img_ids": "split dim 0", "txt_ids": "split dim 0"}
        assert plan["proj_out"] == "gather dim 1"
