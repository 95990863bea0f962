"""Probe: diffusers 0.42 context parallelism on CPU/gloo with tiny_flux's FluxTransformer2DModel.

    torchrun --nproc-per-node 2 scripts/cp_probe.py ulysses   # max|diff| ~4e-7 vs one process; gloo:all_to_all
    torchrun --nproc-per-node 2 scripts/cp_probe.py ring      # ValueError: native attention returns no LSE

Found (torch 2.13 CPU): enable_parallelism -> _resolve_parallel_config divides by torch.accelerator.device_count()
(0 on CPU); setting the config up with device cpu (as below, and models/context_parallel.py) is the only fix needed
for Ulysses. Ring needs log-sum-exp, which diffusers' `native` entry (the only CP entry that runs on CPU) lacks."""
import os, sys, torch, torch.distributed as dist
from diffusers import FluxTransformer2DModel, ContextParallelConfig
from diffusers.models.attention_dispatch import AttentionBackendName

kind = sys.argv[1] if len(sys.argv) > 1 else "ulysses"
torch.manual_seed(0)
m = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=32,
                           num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
                           axes_dims_rope=[8, 12, 12], guidance_embeds=True).eval()
g = torch.Generator().manual_seed(1)
S, T = 64, 16  # image tokens (8x8 latent grid), text tokens
x = torch.randn(1, S, 16, generator=g); enc = torch.randn(1, T, 64, generator=g); pooled = torch.randn(1, 32, generator=g)
img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(8.), torch.arange(8.), indexing="ij"), -1).reshape(-1, 3)
txt_ids = torch.zeros(T, 3)
kw = dict(hidden_states=x, encoder_hidden_states=enc, pooled_projections=pooled, timestep=torch.tensor([0.5]),
          guidance=torch.tensor([3.5]), img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
with torch.no_grad():
    ref = m(**kw)[0]
dist.init_process_group("gloo")
rank = dist.get_rank()
for mod in m.modules():
    if hasattr(mod, "processor") and hasattr(mod.processor, "_attention_backend"):
        mod.processor._attention_backend = AttentionBackendName.NATIVE
cfg = ContextParallelConfig(ulysses_degree=2) if kind == "ulysses" else ContextParallelConfig(ring_degree=2)
if torch.accelerator.device_count() == 0:  # diffusers: rank % device_count() -> ZeroDivisionError on CPU
    from diffusers.models._modeling_parallel import ParallelConfig
    def _resolve(config):
        config = ParallelConfig(context_parallel_config=config)
        cp = config.context_parallel_config
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
        config.setup(rank, dist.get_world_size(), torch.device("cpu"), mesh=mesh)
        m._parallel_config = config
        return config
    m._resolve_parallel_config = _resolve
try:
    m.enable_parallelism(config=cfg)
except Exception as e:
    print(f"rank {rank}: enable_parallelism: {type(e).__name__}: {e}"); raise
from torch.profiler import profile, ProfilerActivity
with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
    out = m(**kw)[0]
names = sorted({e.name for e in prof.events() if any(k in e.name.lower() for k in ("all_to_all", "alltoall", "gloo", "c10d", "all_gather", "allgather", "wait"))})
print(f"rank {rank}: max|diff|={(out - ref).abs().max().item():.3g} shape={tuple(out.shape)} collectives={names}")
dist.destroy_process_group()
