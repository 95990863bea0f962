"""Ring collectives under a ring x Ulysses layout, on CPU with gloo (``models.context_parallel``,
``runner.core.distributed``).

Six real processes form a gloo world with ``parallelism.ring_degree=3 x ulysses_degree=2``: each builds the mesh
and diffusers' context-parallel config with :func:`models.context_parallel.setup`, then runs diffusers' own
unified (Ulysses all-to-all, then ring all-gather) attention on its sixth of the sequence, with an exact
attention that returns its log-sum-exp (CPU's backends return none, which is why ``parallelism=ring`` is refused
on CPU for whole runs). Checked per rank: the ring and Ulysses ranks diffusers uses are the ones the runner
records (:meth:`runner.core.distributed.Layout.role`), its ring and Ulysses groups are the mesh coordinates the
manifest records (:meth:`Layout.section`), the result equals one-process attention, and the profiler sees at
least the collectives the evidence expects (:func:`models.context_parallel.expected_collectives`) of the names it
matches (:data:`models.context_parallel.COLLECTIVES`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from models.context_parallel import expected_collectives
from runner.core.distributed import Layout

REPO = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import json, os, re, sys
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives  # noqa: F401
    from diffusers.models import attention_dispatch as ad
    from models.context_parallel import COLLECTIVES, setup
    from runner.core.distributed import Layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lay = Layout("ring", data=int(sys.argv[1]), ring=int(sys.argv[2]), ulysses=int(sys.argv[3]))
    config = setup(lay, "cpu")
    cp = config.context_parallel_config

    def attention_with_lse(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                           enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D)
        s = qt @ kt.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        lse = torch.logsumexp(s, dim=-1)  # (B, H, S)
        out = (torch.softmax(s, dim=-1) @ vt).transpose(1, 2).contiguous()
        lse = lse.transpose(1, 2).contiguous()  # (B, S, H), as diffusers' LSE backends return it
        return (out, lse) if return_lse else out

    g = torch.Generator().manual_seed(0)
    B, S, H, D = 1, 12, 4, 8
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    full = attention_with_lse(None, q, k, v)
    role = lay.role(rank)
    chunk = S // lay.context
    sl = slice(role["context_rank"] * chunk, (role["context_rank"] + 1) * chunk)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = ad._templated_context_parallel_attention(
            q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(), forward_op=attention_with_lse,
            backward_op=None, _parallel_config=config)
    names = [e.name for e in prof.events()]
    seen = {kind: sum(1 for n in names if re.search(rx, n)) for kind, rx in COLLECTIVES.items()}
    matched = sorted({n for n in names if any(re.search(rx, n) for rx in COLLECTIVES.values())})
    ring_members = [0] * lay.ring
    dist.all_gather_object(ring_members, rank, group=cp._ring_mesh.get_group())
    ulysses_members = [0] * lay.ulysses
    dist.all_gather_object(ulysses_members, rank, group=cp._ulysses_mesh.get_group())
    print("RESULT " + json.dumps({
        "rank": rank, "ring_rank": cp._ring_local_rank, "ulysses_rank": cp._ulysses_local_rank,
        "ring_members": ring_members, "ulysses_members": ulysses_members,
        "degrees": [cp.ring_degree, cp.ulysses_degree], "matched": matched,
        "max_abs_err": float((out - full[:, sl]).abs().max()), "collectives": seen}), flush=True)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world(lay: Layout):
    port = str(_free_port())
    procs = []
    for r in range(lay.world_size):
        env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r),
                   WORLD_SIZE=str(lay.world_size), LOCAL_RANK=str(r), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(lay.data), str(lay.ring), str(lay.ulysses)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = {}
    for p in procs:
        so, se = p.communicate(timeout=300)
        assert p.returncode == 0, se[-3000:]
        doc = json.loads(next(l for l in so.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
        out[doc["rank"]] = doc
    return out


def test_expected_collectives_of_each_layout():
    assert expected_collectives(None, 5) == {}
    assert expected_collectives(Layout("ulysses", data=2, ring=1, ulysses=2), 5) == {"all_to_all": 20}
    assert expected_collectives(Layout("ring", data=1, ring=2, ulysses=1), 5) == {"all_gather": 5}
    assert expected_collectives(Layout("ring", data=1, ring=2, ulysses=2), 3) == {"all_to_all": 12, "all_gather": 3}
    assert expected_collectives(Layout("ring", data=2, ring=1, ulysses=1), 3) == {}
    assert expected_collectives(Layout("ring", data=1, ring=3, ulysses=1), 5) == {"all_gather": 5}
    assert expected_collectives(Layout("ring", data=1, ring=3, ulysses=2), 7) == {"all_to_all": 28, "all_gather": 7}
    assert expected_collectives(Layout("ulysses", data=1, ring=1, ulysses=1), 7) == {}


def test_layout_roles_of_a_ring_times_ulysses_mesh():
    lay = Layout("ring", data=2, ring=2, ulysses=2)
    assert lay.context == 4 and lay.world_size == 8
    assert lay.section()["ranks"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [(lay.role(r)["ring_rank"], lay.role(r)["ulysses_rank"]) for r in range(8)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)] * 2
    assert [lay.role(r)["data_group"] for r in range(8)] == [0] * 4 + [1] * 4
    assert lay.role(6)["context_group"] == [4, 5, 6, 7] and lay.role(6)["context_rank"] == 2
    assert [lay.role(r)["writes_artifacts"] for r in range(8)] == [True, False, False, False] * 2


def test_ring_times_ulysses_attention_on_gloo_matches_one_process():
    lay = Layout("ring", data=1, ring=3, ulysses=2)  # unequal degrees: a swapped mesh dim cannot pass
    res = _world(lay)
    want = expected_collectives(lay, 1)
    assert want == {"all_to_all": 4, "all_gather": 1}
    ranks = lay.section()["ranks"][0]  # [ring][ulysses]
    for r, doc in sorted(res.items()):
        role = lay.role(r)
        assert doc["degrees"] == [lay.ring, lay.ulysses], doc
        assert (doc["ring_rank"], doc["ulysses_rank"]) == (role["ring_rank"], role["ulysses_rank"]), doc
        assert doc["ring_members"] == [ranks[i][role["ulysses_rank"]] for i in range(lay.ring)], doc
        assert doc["ulysses_members"] == ranks[role["ring_rank"]], doc
        assert doc["max_abs_err"] < 1e-5, doc  # diffusers merges the ring chunks in float32
        for kind, n in want.items():  # what the evidence requires was really run, and is matched by name
            assert doc["collectives"][kind] >= n, doc
