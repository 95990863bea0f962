"""Weight hashing with the digest cache (issue #17): the first and the second hashing of a diffusers-like snapshot.

A snapshot of ``--gb`` GB of dummy safetensors-like files (an 8-byte header length, a JSON header, then the
tensor bytes) is written to a temp dir: a transformer in 5 GB-style shards with its index, a VAE, two text
encoders, plus a variant file and an extra folder that must not be hashed. Then :func:`runner.core.weights.hash_snapshot`
runs twice with a fresh runner cache dir: the first call computes every digest (the files are dropped from the
page cache first where ``posix_fadvise`` allows, so it reads from the disk), the second finds them all cached.

Usage: ``python benchmarks/weight_hashing.py [--gb 2] [--dir /fast/disk] [--out result.json]``
Prints one JSON object: sizes, seconds and throughput of each call, and what each call computed or found cached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHUNK = 8 << 20


def write_safetensors_like(path: Path, nbytes: int, seed: int) -> None:
    """A file laid out like a safetensors file (u64 header length, JSON header, data) of about ``nbytes`` bytes.
    The data repeats one pseudo-random 8 MiB block (sha256 does not care what the bytes are)."""
    header = json.dumps({"w": {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [0, nbytes]}}).encode()
    block = (seed.to_bytes(8, "little") + os.urandom(56)) * (CHUNK // 64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        left = nbytes
        while left > 0:
            f.write(block[:min(left, CHUNK)])
            left -= CHUNK
        f.flush()
        os.fsync(f.fileno())


def build_snapshot(root: Path, total_bytes: int) -> None:
    """A FLUX-like snapshot: transformer 70% in 3 shards + index, text_encoder_2 20% in 2 shards + index, text
    encoder 6%, VAE 4%; plus files the pipeline does not load (a fp16 variant, an ``old/`` folder)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"], "scheduler": ["diffusers", "X"]}))
    seed = 0
    for comp, share, shards, stem in (("transformer", 0.70, 3, "diffusion_pytorch_model"),
                                      ("text_encoder_2", 0.20, 2, "model")):
        names = [f"{stem}-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        for name in names:
            seed += 1
            write_safetensors_like(root / comp / name, int(total_bytes * share / shards), seed)
        (root / comp / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"weight_map": {f"t{i}": n for i, n in enumerate(names)}}))
    write_safetensors_like(root / "text_encoder" / "model.safetensors", int(total_bytes * 0.06), 90)
    write_safetensors_like(root / "vae" / "diffusion_pytorch_model.safetensors", int(total_bytes * 0.04), 91)
    write_safetensors_like(root / "vae" / "diffusion_pytorch_model.fp16.safetensors", 1 << 20, 92)  # not loaded
    write_safetensors_like(root / "old" / "diffusion_pytorch_model.safetensors", 1 << 20, 93)  # not loaded


def drop_page_cache(files) -> bool:
    """Ask the kernel to drop the files' cached pages (``POSIX_FADV_DONTNEED``); False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(os.path.realpath(f), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.0, help="snapshot size in GB (10**9 bytes)")
    p.add_argument("--dir", default=None, help="where to create the temp snapshot (default: the system temp dir)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()

    from runner.core.weights import hash_snapshot, weight_files

    with tempfile.TemporaryDirectory(prefix="weight-hashing-", dir=args.dir) as tmp:
        snap, cache = Path(tmp) / "snapshot", Path(tmp) / "runner-cache"
        t0 = time.perf_counter()
        build_snapshot(snap, int(args.gb * 1e9))
        write_s = time.perf_counter() - t0
        files = weight_files(snap)
        dropped = drop_page_cache(files)
        _, first = hash_snapshot(snap, cache)
        _, second = hash_snapshot(snap, cache)
        total = first["bytes_total"]
        result = {
            "benchmark": "weight_hashing", "host": platform.node(), "python": platform.python_version(),
            "gb": args.gb, "files_hashed": len(files), "bytes_total": total, "write_s": round(write_s, 3),
            "page_cache_dropped": dropped,
            "first": {"hash_s": round(first["hash_s"], 4), "computed": len(first["computed"]),
                      "cached": len(first["cached"]), "bytes_hashed": first["bytes_hashed"],
                      "MB_per_s": round(first["bytes_hashed"] / 1e6 / first["hash_s"], 1)},
            "second": {"hash_s": round(second["hash_s"], 4), "computed": len(second["computed"]),
                       "cached": len(second["cached"]), "bytes_hashed": second["bytes_hashed"]},
            "speedup": round(first["hash_s"] / second["hash_s"], 1),
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
