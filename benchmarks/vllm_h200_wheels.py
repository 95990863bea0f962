"""vLLM 0.24.0 (CUDA 13, torch 2.11) and what it needs, with every optional package of the runner that installs there
(torchao, cache-dit, imageio-ffmpeg, bitsandbytes, sageattention 1.x, jsonschema), carried to the H200 in pieces of
at most what a device call leaves beside the working tree (:func:`part_limit`).

The H200 image has torch 2.11.0+cu130, transformers, triton and most of vLLM's requirements, but no vLLM, no
pydantic, no hydra; it cannot reach a package index, and one device call carries at most ~45 MB beside the
working tree. So the wheels travel in parts:

* ``prepare`` (here, with network): downloads the pinned wheels below (``pip download --no-deps
  --only-binary=:all:`` for CPython 3.12 / manylinux x86-64), repacks the vLLM wheel without the files this path
  never loads (:data:`DROP`), writes one uncompressed tar of all wheels, splits it into chunks and puts one chunk
  into each of ``.vpart1 .. .vpartN`` in the repository root (each folder <= 44 MiB), with ``vparts.json`` (sizes
  and sha256 of every wheel, of the tar and of every chunk) in every folder, and adds the folders to
  ``.git/info/exclude``. The vLLM wheel itself (:data:`VLLM_WHEEL`, 279 MB) is downloaded there first when absent
  (a new sandbox keeps nothing of the last session's).
* ``stage K`` (device, one call per part, carry ``.vpartK``): copies ``.vpartK/*`` into ``/tmp/keep`` and checks
  the chunk's sha256. ``/tmp/keep`` survives between calls while the machine stays warm (30 s idle).
* ``install`` (device, after the last stage): checks that every chunk is in ``/tmp/keep`` with its sha256, joins
  them, checks the tar and every wheel, installs all wheels into ``/tmp/site`` (``pip install --no-index --no-deps
  --target``), then imports vLLM and its CUDA extensions and prints the versions. Use with
  ``export PYTHONPATH=/tmp/site:$PWD``.
* ``status`` (either side): what ``/tmp/keep`` holds and what is missing.

Which wheels, and why these (vLLM 0.24.0 ``Requires-Dist`` lists ~70 names): the module-level imports of ``from
vllm import LLM``, the V1 engine core, the uni-process executor, the GPU worker and model runner, Qwen3-MoE, the
fused-MoE layer, the FLASH_ATTN backend, the sampler and the dummy loader were read off an import of those modules
(vLLM 0.24.0 source on a fake CUDA platform, every package the H200 already has allowed, everything else blocked
until the import succeeded); the function-level imports on that path were read from the source. What the H200
lacks: pydantic (+ pydantic-core, typing-inspection, annotated-types), cbor2, pyzmq, msgspec, pybase64, cachetools,
openai (+ distro, jiter, sniffio; 2.x: 3.x needs httpx2), openai-harmony, fastapi, starlette, partial-json-parser,
and llguidance + xgrammar (+ apache-tvm-ffi), which ``vllm.v1.structured_output`` imports at class definition
(dataclass annotations). Not carried (imported lazily, not on this path): flashinfer, tilelang, nvidia-cutlass-dsl,
quack-kernels, tokenspeed-mla, humming-kernels, fastsafetensors, mistral-common, lm-format-enforcer,
outlines-core, compressed-tensors, depyf (debug dumps only), ray, opentelemetry, anthropic, mcp. The runner's own
requirements the image lacks (hydra-core, omegaconf, antlr4-python3-runtime, diffusers) travel too.

FlashInfer absent has one consequence the runner handles: vLLM's CUDA sampler imports FlashInfer unless
``VLLM_USE_FLASHINFER_SAMPLER=0`` (``vllm/v1/sample/ops/topk_topp_sampler.py``), which
``models.vllm.adapter.VLLMAdapter`` sets when ``flashinfer`` does not import.

Usage:
    python benchmarks/vllm_h200_wheels.py prepare [--vllm-wheel PATH]      # here
    python3 benchmarks/vllm_h200_wheels.py stage K                         # device, carry .vpartK
    python3 benchmarks/vllm_h200_wheels.py install                         # device, after the last stage
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEEP = Path(os.environ.get("VPART_KEEP", "/tmp/keep"))
SITE = Path(os.environ.get("VPART_SITE", "/tmp/site"))
MANIFEST = "vparts.json"
#: A device call carries at most 64 MiB: the working tree (tracked files) plus one part. The tree grows with the
#: project (27.5 MiB on 2026-12-06, when 44 MiB parts no longer fitted), so a part's size is what the tree leaves,
#: less 2 MiB of headroom for files added between ``prepare`` and the stage calls (:func:`part_limit`).
CARRY_LIMIT = 64 * 2**20
HEADROOM = 2 * 2**20


def part_limit() -> int:
    """Bytes a part folder (chunk + manifest) may hold: :data:`CARRY_LIMIT` - the tracked tree - :data:`HEADROOM`.

    Raises:
        SystemExit: the tree leaves less than 8 MiB (too many calls to stage)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((REPO / f.decode()).stat().st_size for f in files if f and (REPO / f.decode()).is_file())
    limit = CARRY_LIMIT - tree - HEADROOM
    if limit < 8 * 2**20:
        sys.exit(f"prepare: the tracked tree is {tree / 2**20:.1f} MiB, leaving {limit / 2**20:.1f} MiB per part; "
                 "fix: move large tracked files out of the tree")
    return limit
VLLM_WHEEL = "/work/vllmwhl/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"

#: Pinned wheels the H200 lacks (versions satisfy vLLM 0.24.0's pins; apache-tvm-ffi is 0.1.15.post2, not vLLM's
#: ==0.1.9, because xgrammar 0.2.8 needs >=0.1.11 and vLLM itself never imports tvm_ffi).
WHEELS = [
    "pydantic==2.14.4", "pydantic-core==2.50.5", "typing-inspection==0.4.5", "annotated-types==0.8.0",
    "typing-extensions==4.16.0",  # pydantic 2.14 needs >=4.16; the image may hold an older one
    "cbor2==6.3.0", "pyzmq==27.3.0", "msgspec==0.23.0", "pybase64==1.5.1", "cachetools==7.3.3",
    "sniffio==1.3.1", "openai==2.54.0", "distro==1.9.0", "jiter==0.19.0", "openai-harmony==0.0.8",
    "fastapi==0.136.3", "starlette==1.10.0", "partial-json-parser==0.2.1.1.post7",
    "llguidance==1.7.6", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2",
    # the runner's own (pyproject dependencies) that the image lacks
    "hydra-core==1.3.2", "omegaconf==2.3.0", "diffusers==0.42.1", "ftfy==6.3.1", "wcwidth==0.9.4",
    # issue #37: every optional package the registries know that installs on the H200, so scripts/ci/cuda.sh
    # skips only for absent hardware (imageio-ffmpeg 0.6.0: 29 MB, where 0.8.1's 68 MB would not fit a part)
    "torchao==0.18.0", "cache-dit==1.5.3", "imageio-ffmpeg==0.6.0", "bitsandbytes==0.50.2", "sageattention==1.0.6",
    "jsonschema==4.26.0", "referencing==0.37.0", "rpds-py==2026.9.1", "jsonschema-specifications==2025.9.1",
]
#: Published only as an sdist: built here into a pure-Python wheel.
SDIST_WHEELS = ["antlr4-python3-runtime==4.9.3"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]

#: Files left out of the vLLM wheel: (glob, why it is never loaded on the H200 path: sm90, bf16, FLASH_ATTN, Triton
#: fused MoE, in-process engine). Everything else, vllm_flash_attn's FA3 among it, stays.
DROP = [
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
     "FlashAttention 2 (190 MB): on sm90 vLLM picks FA3 (v1/attention/backends/fa_utils.py get_flash_attn_version: "
     "capability 9.x and FA3 supported -> 3; FA2 only for ALiBi, which Qwen3 has not); flash_attn_interface.py imports "
     "it in try/except (FA2_AVAILABLE=False), and vllm_flash_attn/__init__ only needs one of FA2/FA3"),
    ("vllm/vllm-rs", "the Rust OpenAI frontend binary (37 MB): used only with VLLM_USE_RUST_FRONTEND (serving)"),
    ("vllm/third_party/deep_gemm/*", "DeepGEMM (FP8 block GEMMs/MoE): only for FP8 models; without it "
     "vllm.utils.import_utils.has_deep_gemm() is False and nothing imports it"),
    ("vllm/third_party/fmha_sm100/*", "sm100 sparse FMHA for MiniMax-M3 only (vllm/models/minimax_m3)"),
    ("vllm/_flashmla_C.abi3.so", "FlashMLA (MLA models: DeepSeek); v1/attention/ops/flashmla.py imports it in "
     "try/except"),
    ("vllm/_flashmla_extension_C.abi3.so", "FlashMLA extension, same guard"),
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dropped(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat, _ in DROP)


def repack_vllm(src: Path, dst_dir: Path) -> dict:
    """Copy the vLLM wheel without :data:`DROP` (entries copied compressed as they are; RECORD rewritten)."""
    dst = dst_dir / src.name
    dropped = {pat: {"files": 0, "bytes": 0, "compressed": 0, "why": why} for pat, why in DROP}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if _dropped(info.filename):
                d = dropped[next(pat for pat, _ in DROP if fnmatch.fnmatch(info.filename, pat))]
                d["files"] += 1
                d["bytes"] += info.file_size
                d["compressed"] += info.compress_size
                continue
            if info.filename == record_name:
                lines = zin.read(info).decode().splitlines()
                kept = [ln for ln in lines if ln and not _dropped(ln.split(",")[0])]
                zout.writestr(info, "\n".join(kept) + "\n")
                continue
            # copy the compressed bytes as they are (no recompression of 200 MB of fatbins)
            with zin.open(info) as fin, zout.open(info, "w") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
    return {"source": str(src), "source_sha256": sha256(src), "source_bytes": src.stat().st_size,
            "wheel": dst.name, "bytes": dst.stat().st_size, "dropped": dropped}


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def prepare(a: argparse.Namespace) -> int:
    src = Path(a.vllm_wheel)
    if not src.is_file() and a.vllm_wheel == VLLM_WHEEL:  # the pinned wheel, fetched once (279 MB) where it is kept
        src.parent.mkdir(parents=True, exist_ok=True)
        pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "-d", str(src.parent), "vllm==0.24.0")
    if not src.is_file():
        sys.exit(f"prepare: the vLLM wheel {src} is not there; fix: --vllm-wheel PATH")
    work = Path(tempfile.mkdtemp(prefix="vparts-"))
    whl = work / "wheels"
    whl.mkdir()
    plat = [x for p in PLATFORMS for x in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *plat, "-d", str(whl), *WHEELS)
    pip("wheel", "--no-deps", "-w", str(whl), *SDIST_WHEELS)
    vllm = repack_vllm(src, whl)
    names = sorted(p.name for p in whl.glob("*.whl"))
    if len(names) != len(WHEELS) + len(SDIST_WHEELS) + 1:
        sys.exit(f"prepare: expected {len(WHEELS) + len(SDIST_WHEELS) + 1} wheels, got {names}")
    tar = work / "wheels.tar"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        for n in names:
            ti = t.gettarinfo(str(whl / n), arcname=n)
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 0
            with open(whl / n, "rb") as f:
                t.addfile(ti, f)
    for old in REPO.glob(".vpart*"):
        shutil.rmtree(old)
    chunks = []
    limit = part_limit()
    with open(tar, "rb") as f:
        k = 0
        while True:
            data = f.read(limit - 256 * 1024)  # the manifest beside the chunk
            if not data:
                break
            k += 1
            d = REPO / f".vpart{k}"
            d.mkdir()
            name = f"wheels.tar.{k:02d}"
            (d / name).write_bytes(data)
            chunks.append({"part": k, "file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": "cp312", "platform": "manylinux x86_64",
           "wheels": [{"file": n, "bytes": (whl / n).stat().st_size, "sha256": sha256(whl / n)} for n in names],
           "vllm": vllm, "tar": {"file": "wheels.tar", "bytes": tar.stat().st_size, "sha256": sha256(tar)},
           "chunks": chunks, "parts": len(chunks),
           "device": ["python3 benchmarks/vllm_h200_wheels.py stage K   (one call per part, carry .vpartK)",
                      "python3 benchmarks/vllm_h200_wheels.py install   (after the last stage)",
                      "export PYTHONPATH=/tmp/site:$PWD"]}
    for c in chunks:
        d = REPO / f".vpart{c['part']}"
        (d / MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")
        size = sum(p.stat().st_size for p in d.iterdir())
        assert size <= limit, (d, size)
    shutil.rmtree(work)
    exclude = REPO / ".git" / "info" / "exclude"  # the parts travel as ignored paths (carry), never committed
    if exclude.parent.is_dir():
        have = set(exclude.read_text().split()) if exclude.is_file() else set()
        with exclude.open("a") as f:
            f.writelines(f"/.vpart{c['part']}/\n" for c in chunks if f"/.vpart{c['part']}/" not in have)
    total = sum(w["bytes"] for w in doc["wheels"])
    print(json.dumps({"parts": [f".vpart{c['part']}" for c in chunks], "wheels_bytes": total,
                      "vllm_wheel_bytes": vllm["bytes"], "dropped_bytes": sum(d["compressed"] for d in vllm["dropped"].values()),
                      "wheels": {w["file"]: w["bytes"] for w in doc["wheels"]}}, indent=1))
    return 0


def _manifest(*dirs: Path) -> dict:
    for d in dirs:
        if (d / MANIFEST).is_file():
            return json.loads((d / MANIFEST).read_text())
    sys.exit(f"no {MANIFEST} in {', '.join(map(str, dirs))}; fix: stage a part first (it carries the manifest)")


def stage(a: argparse.Namespace) -> int:
    src = REPO / f".vpart{a.k}"
    if not src.is_dir():
        sys.exit(f"stage: {src} is not here; fix: name .vpart{a.k} in the call's carry list")
    KEEP.mkdir(parents=True, exist_ok=True)
    doc = _manifest(src)
    want = {c["file"]: c for c in doc["chunks"] if c["part"] == a.k}
    for p in src.iterdir():
        shutil.copy2(p, KEEP / p.name)
    for name, c in want.items():
        got = sha256(KEEP / name)
        if got != c["sha256"]:
            sys.exit(f"stage {a.k}: {name} sha256 {got} != {c['sha256']} (a broken transfer; stage it again)")
    print(f"stage {a.k}: {', '.join(want)} ok")
    return status(a)


def status(a: argparse.Namespace) -> int:
    doc = _manifest(KEEP, *(REPO / f".vpart{k}" for k in range(1, 20)))
    have = [c["part"] for c in doc["chunks"] if (KEEP / c["file"]).is_file()]
    missing = [c["part"] for c in doc["chunks"] if c["part"] not in have]
    print(f"{KEEP}: parts {have} of {doc['parts']}" + (f"; missing {missing}" if missing else "; complete")
          + (f"; {SITE} installed" if (SITE / ".vparts_installed").is_file() else ""))
    return 0


def install(a: argparse.Namespace) -> int:
    doc = _manifest(KEEP)
    marker = SITE / ".vparts_installed"
    if marker.is_file() and marker.read_text().strip() == doc["tar"]["sha256"] and not a.force:
        print(f"install: {SITE} already holds these wheels (tar {doc['tar']['sha256'][:12]})")
        return check(a)
    missing = [c["part"] for c in doc["chunks"] if not (KEEP / c["file"]).is_file()]
    if missing:
        sys.exit(f"install: parts {missing} are not in {KEEP}; fix: run `stage K` for each (the machine was given "
                 "back in between if earlier parts are missing too)")
    for c in doc["chunks"]:
        if sha256(KEEP / c["file"]) != c["sha256"]:
            sys.exit(f"install: {c['file']} does not match its sha256; stage part {c['part']} again")
    tar = KEEP / "wheels.tar"
    with open(tar, "wb") as out:
        for c in doc["chunks"]:
            with open(KEEP / c["file"], "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    if sha256(tar) != doc["tar"]["sha256"]:
        sys.exit("install: the joined tar does not match its sha256")
    whl = KEEP / "wheels"
    shutil.rmtree(whl, ignore_errors=True)
    with tarfile.open(tar) as t:
        t.extractall(whl, filter="data")
    for w in doc["wheels"]:
        if sha256(whl / w["file"]) != w["sha256"]:
            sys.exit(f"install: {w['file']} does not match its sha256")
    tar.unlink()
    shutil.rmtree(SITE, ignore_errors=True)
    SITE.mkdir(parents=True)
    t0 = time.time()
    # the tags pip checks are the ones prepare downloaded for (VPART_PYVER only for a dry run on another Python)
    pyver = os.environ.get("VPART_PYVER", f"{sys.version_info[0]}.{sys.version_info[1]}")
    tags = ["--only-binary=:all:", "--python-version", pyver, "--implementation", "cp",
            *(x for p in PLATFORMS for x in ("--platform", p))]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", *tags, "--target", str(SITE), *sorted(str(p) for p in whl.glob("*.whl"))],
                   check=True)
    marker.write_text(doc["tar"]["sha256"] + "\n")
    print(f"install: {len(doc['wheels'])} wheels into {SITE} in {time.time() - t0:.1f} s")
    return check(a)


CHECK = r"""
import importlib, json, sys, time
t0 = time.time()
import torch, vllm
out = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
import vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch  # the CUDA extensions load beside this torch
from vllm.vllm_flash_attn import flash_attn_interface as fa
out["fa3"], out["fa2"] = fa.FA3_AVAILABLE, fa.FA2_AVAILABLE
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.platforms import current_platform
out["platform"] = type(current_platform).__name__
out["import_s"] = round(time.time() - t0, 1)
print(json.dumps(out))
"""


def check(a: argparse.Namespace) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")]),
               VLLM_LOGGING_LEVEL="WARNING")
    r = subprocess.run([sys.executable, "-c", CHECK], env=env)
    return r.returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="download, repack and split into .vpart1..N (here)")
    pp.add_argument("--vllm-wheel", default=VLLM_WHEEL)
    ps = sub.add_parser("stage", help="copy .vpartK into /tmp/keep (device)")
    ps.add_argument("k", type=int)
    pi = sub.add_parser("install", help="join, verify and install into /tmp/site (device)")
    pi.add_argument("--force", action="store_true")
    sub.add_parser("status", help="what /tmp/keep holds")
    sub.add_parser("check", help="import vLLM from /tmp/site")
    a = p.parse_args()
    return {"prepare": prepare, "stage": stage, "install": install, "status": status, "check": check}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
