"""Issue #17: ``model.path=<org>/<name>`` resolved through the local Hugging Face cache (never the network), the
weight files a diffusers pipeline loads, and their digests cached across jobs and ranks (``runner.core.weights``).

The hub cache is built in its real layout: ``models--org--name/refs/<ref>`` (the commit hash, no newline),
``blobs/<id>`` and ``snapshots/<commit>/<path>`` as relative symlinks to the blobs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

import runner.core.weights as weights
from runner.core.errors import UserInputError
from runner.core.weights import (HubCacheMissError, ModelPathError, hash_files, hash_snapshot, resolve_model_path,
                            weight_files)

FLUX_INDEX = {"_class_name": "FluxPipeline", "_diffusers_version": "0.35.0",
              "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
              "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
              "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "safety_checker": [None, None],
              "image_encoder": None}


def _bytes(tag: str, n: int = 4096) -> bytes:
    return (hashlib.sha256(tag.encode()).digest() * (n // 32 + 1))[:n]


def write_tree(root: Path, files: Dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def flux_files(tag: str = "a") -> Dict[str, bytes]:
    """A diffusers FLUX-like snapshot: a sharded transformer, vae, text encoder, tokenizer, scheduler, plus files
    the pipeline does not load."""
    shard_map = {"a.weight": "diffusion_pytorch_model-00001-of-00002.safetensors",
                 "b.weight": "diffusion_pytorch_model-00002-of-00002.safetensors"}
    return {
        "model_index.json": json.dumps(FLUX_INDEX).encode(),
        "transformer/config.json": b"{}",
        "transformer/diffusion_pytorch_model.safetensors.index.json": json.dumps({"weight_map": shard_map}).encode(),
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors": _bytes(tag + "t1"),
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors": _bytes(tag + "t2"),
        "vae/config.json": b"{}",
        "vae/diffusion_pytorch_model.safetensors": _bytes(tag + "vae"),
        "vae/diffusion_pytorch_model.fp16.safetensors": _bytes(tag + "vae16", 2048),
        "text_encoder/config.json": b"{}",
        "text_encoder/model.safetensors": _bytes(tag + "te"),
        "tokenizer/vocab.json": b"{}",
        "scheduler/scheduler_config.json": b"{}",
        # not loaded: a folder no component names, a root single-file checkpoint, a null component's folder
        "old/diffusion_pytorch_model.safetensors": _bytes(tag + "old"),
        "flux1-dev.safetensors": _bytes(tag + "single"),
        "safety_checker/model.safetensors": _bytes(tag + "sc"),
        "image_encoder/model.safetensors": _bytes(tag + "ie"),
    }


LOADED = ["text_encoder/model.safetensors", "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
          "transformer/diffusion_pytorch_model-00002-of-00002.safetensors", "vae/diffusion_pytorch_model.safetensors"]


def add_to_hub_cache(cache: Path, repo_id: str, files: Dict[str, bytes], commit: Optional[str] = None,
                     refs: tuple = ("main",)) -> str:
    """One snapshot of ``repo_id`` in a hub cache, laid out as ``hf download`` writes it; returns its commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(json.dumps(sorted(files)).encode() + os.urandom(8)).hexdigest()
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()  # LFS blobs are named by their sha256
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no trailing newline, as the hub writes it
    return commit


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """HF_HOME in tmp (HF_HUB_CACHE unset); the hub API fails the test if anything reaches for the network."""
    home = tmp_path / "hf"
    (home / "hub").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("the hub API was called")

    for name in ("repo_info", "list_repo_tree", "model_info"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, no_network)
    return home


# ------------------------------------------------------------------------------------------------ hub ids


def test_local_dir_is_returned_as_is(tmp_path):
    snap = write_tree(tmp_path / "org" / "name", flux_files())
    path, prov = resolve_model_path(str(snap), "my-label")
    assert path == snap and prov == {"kind": "path", "path": str(snap.resolve()), "revision": "my-label"}


def test_existing_relative_dir_wins_over_a_repo_id(tmp_path, hf_home, monkeypatch):
    write_tree(tmp_path / "org" / "name", flux_files())
    add_to_hub_cache(hf_home / "hub", "org/name", flux_files("hub"))
    monkeypatch.chdir(tmp_path)
    path, prov = resolve_model_path("org/name", None)
    assert prov["kind"] == "path" and path.resolve() == (tmp_path / "org" / "name").resolve()


@pytest.mark.parametrize("value", ["/nonexistent/snapshot", "./missing", "../missing", "~/missing-snapshot-xyz",
                                   "a/b/c", "org/na me", "org--x/name"])
def test_local_looking_missing_path_keeps_the_message(value, hf_home):
    with pytest.raises(ModelPathError) as ei:
        resolve_model_path(value, None)
    assert not isinstance(ei.value, HubCacheMissError)
    assert f"model.path={value!r} does not exist; fix: pass a local diffusers snapshot directory" in str(ei.value)
    assert ei.value.exit_code == 2 and ei.value.outcome == "invalid"


def test_repo_id_resolves_through_hf_home(hf_home):
    commit = add_to_hub_cache(hf_home / "hub", "black-forest-labs/FLUX.1-dev", flux_files())
    path, prov = resolve_model_path("black-forest-labs/FLUX.1-dev", None)
    assert path == hf_home / "hub" / "models--black-forest-labs--FLUX.1-dev" / "snapshots" / commit
    assert prov == {"kind": "hub", "repo_id": "black-forest-labs/FLUX.1-dev", "revision": commit,
                    "requested_revision": "main", "cache_dir": str(hf_home / "hub"), "path": str(path)}
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == "FluxPipeline"


def test_hf_hub_cache_takes_precedence_over_hf_home(tmp_path, hf_home, monkeypatch):
    other = tmp_path / "elsewhere"
    commit = add_to_hub_cache(other, "org/name", flux_files())
    add_to_hub_cache(hf_home / "hub", "org/name", flux_files("b"))
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    path, prov = resolve_model_path("org/name", None)
    assert path.parent.parent.parent == other and prov["revision"] == commit and prov["cache_dir"] == str(other)


def test_revision_pinning(hf_home):
    cache = hf_home / "hub"
    old = add_to_hub_cache(cache, "org/name", flux_files("old"), refs=("v1.0",))
    new = add_to_hub_cache(cache, "org/name", flux_files("new"), refs=("main",))
    assert resolve_model_path("org/name", None)[1]["revision"] == new
    assert resolve_model_path("org/name", "main")[1]["revision"] == new
    assert resolve_model_path("org/name", "v1.0")[1]["revision"] == old
    path, prov = resolve_model_path("org/name", old)  # a full commit hash needs no ref
    assert path.name == old and prov["requested_revision"] == old
    assert hash_snapshot(path, hf_home / "rc")[0] != hash_snapshot(cache / "models--org--name" / "snapshots" / new,
                                                                    hf_home / "rc")[0]


def test_missing_repo_names_repo_cache_and_download_command(hf_home):
    add_to_hub_cache(hf_home / "hub", "org/other", flux_files())
    with pytest.raises(HubCacheMissError) as ei:
        resolve_model_path("org/name", None)
    msg = str(ei.value)
    assert isinstance(ei.value, UserInputError) and ei.value.exit_code == 2 and ei.value.outcome == "invalid"
    assert "'org/name'" in msg and str(hf_home / "hub") in msg and "from HF_HOME" in msg
    assert "models--org--name" in msg and "never downloads" in msg
    assert (f"fix: download it where the network is reachable: HF_HOME={hf_home} hf download org/name "
            "--include '*.safetensors' '*.json' '*.txt' '*.model'") in msg


def test_missing_repo_under_hf_hub_cache_names_that_variable(tmp_path, hf_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hc"))
    with pytest.raises(HubCacheMissError, match=r"from HF_HUB_CACHE.*fix: .*HF_HUB_CACHE=\S*hc hf download org/name"):
        resolve_model_path("org/name", "v2")


def test_missing_revision_lists_what_the_cache_holds(hf_home):
    commit = add_to_hub_cache(hf_home / "hub", "org/name", flux_files(), refs=("main", "v1.0"))
    for rev in ("v2.0", "0" * 40, commit[:12]):
        with pytest.raises(HubCacheMissError) as ei:
            resolve_model_path("org/name", rev)
        msg = str(ei.value)
        assert f"model.revision={rev!r}" in msg and "'org/name'" in msg and str(hf_home / "hub") in msg
        assert f"main -> {commit[:12]}" in msg and f"v1.0 -> {commit[:12]}" in msg
        assert f"hf download org/name --revision {rev} --include" in msg


def test_incomplete_snapshot_is_a_cache_miss(hf_home):
    import huggingface_hub.errors as hf_errors

    if not hasattr(hf_errors, "IncompleteSnapshotError"):
        pytest.skip("this huggingface_hub does not check snapshot completeness")
    files = flux_files()
    commit = add_to_hub_cache(hf_home / "hub", "org/name", files)
    repo = hf_home / "hub" / "models--org--name"
    listing = {rel: {"size": len(d), "blob_id": hashlib.sha1(d).hexdigest()} for rel, d in files.items()}
    listing["transformer/diffusion_pytorch_model-00003-of-00003.safetensors"] = {"size": 1, "blob_id": "0" * 40}
    (repo / "trees").mkdir()
    (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    with pytest.raises(HubCacheMissError, match=r"incomplete snapshot.*00003-of-00003.*fix: download it"):
        resolve_model_path("org/name", None)


def test_revision_that_is_no_ref_name_is_refused(hf_home):
    add_to_hub_cache(hf_home / "hub", "org/name", flux_files())
    with pytest.raises(ModelPathError, match="is not a branch, tag or commit name"):
        resolve_model_path("org/name", "../../../etc")


def test_weight_files_of_a_hub_snapshot_hash_the_blobs(hf_home, tmp_path):
    files = flux_files()
    add_to_hub_cache(hf_home / "hub", "org/name", files)
    snap, _ = resolve_model_path("org/name", None)
    want = {rel: hashlib.sha256(files[rel]).hexdigest() for rel in LOADED}
    # the Hub cache names each LFS blob by its sha256: taken as the digest, no byte read, nothing cached
    digests, stats = hash_snapshot(snap, tmp_path / "rc")
    assert digests == want and stats["hub_named"] == sorted(LOADED) and stats["computed"] == []
    assert stats["bytes_hashed"] == 0 and not (tmp_path / "rc" / "weight_digests.json").exists()
    # verified on demand: read like any file and checked against the names
    digests, stats = hash_snapshot(snap, tmp_path / "rc", verify=True)
    assert digests == want and stats["verified"] == sorted(LOADED) and stats["bytes_hashed"] == stats["bytes_total"]
    cache = json.loads((tmp_path / "rc" / "weight_digests.json").read_text())["entries"]
    assert all(Path(p).parent.name == "blobs" for p in cache)  # keyed by the resolved blob, not the symlink


def test_a_corrupt_hub_blob_fails_verification_naming_the_file(hf_home, tmp_path, monkeypatch):
    from runner.core.weights import WeightDigestError

    files = flux_files()
    add_to_hub_cache(hf_home / "hub", "org/name", files)
    snap, _ = resolve_model_path("org/name", None)
    rel = LOADED[0]
    blob = (snap / rel).resolve()
    blob.write_bytes(b"truncated")  # the download broke; the name still claims the original sha256
    assert hash_snapshot(snap, tmp_path / "rc")[0][rel] == blob.name  # unverified: the cache's word
    monkeypatch.setenv("RUNNER_VERIFY_WEIGHTS", "1")
    with pytest.raises(WeightDigestError) as e:
        hash_snapshot(snap, tmp_path / "rc")
    assert rel in str(e.value) and blob.name in str(e.value) and "--force-download" in str(e.value)
    assert e.value.exit_code == 2


# ------------------------------------------------------------------------------------------------ weight files


def test_only_the_listed_components_are_hashed(tmp_path):
    snap = write_tree(tmp_path / "s", flux_files())
    assert [f.relative_to(snap).as_posix() for f in weight_files(snap)] == LOADED


def test_shard_index_lists_the_only_shards(tmp_path):
    files = flux_files()
    files["transformer/diffusion_pytorch_model-00003-of-00003.safetensors"] = _bytes("stray")  # not in the index
    files["transformer/diffusion_pytorch_model.safetensors"] = _bytes("unsharded leftover")
    files["transformer/diffusion_pytorch_model.safetensors.index.fp16.json"] = json.dumps(
        {"weight_map": {"a": "diffusion_pytorch_model.fp16-00001-of-00001.safetensors"}}).encode()
    files["transformer/diffusion_pytorch_model.fp16-00001-of-00001.safetensors"] = _bytes("variant shard")
    snap = write_tree(tmp_path / "s", files)
    got = [f.relative_to(snap).as_posix() for f in weight_files(snap) if f.parent.name == "transformer"]
    assert got == LOADED[1:3]


def test_variant_files_are_skipped_unless_they_are_all_there_is(tmp_path):
    files = flux_files()
    del files["text_encoder/model.safetensors"]
    files["text_encoder/model.fp16.safetensors"] = _bytes("te16")
    files["text_encoder/model.bf16.safetensors"] = _bytes("tebf16")
    snap = write_tree(tmp_path / "s", files)
    got = [f.relative_to(snap).as_posix() for f in weight_files(snap)]
    assert "vae/diffusion_pytorch_model.fp16.safetensors" not in got
    assert [g for g in got if g.startswith("text_encoder/")] == ["text_encoder/model.bf16.safetensors",
                                                                 "text_encoder/model.fp16.safetensors"]


def test_missing_shard_or_index_is_an_input_error(tmp_path):
    files = flux_files()
    del files["transformer/diffusion_pytorch_model-00002-of-00002.safetensors"]
    snap = write_tree(tmp_path / "s", files)
    with pytest.raises(ModelPathError, match=r"1 weight file\(s\).*00002-of-00002.*fix: download the snapshot"):
        weight_files(snap)
    (snap / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelPathError, match="is not a shard index"):
        weight_files(snap)
    (snap / "model_index.json").unlink()
    with pytest.raises(ModelPathError, match="model_index.json cannot be read"):
        weight_files(snap)


def test_dangling_blob_link_is_reported(hf_home):
    add_to_hub_cache(hf_home / "hub", "org/name", flux_files())
    snap, _ = resolve_model_path("org/name", None)
    os.unlink(os.path.realpath(snap / "vae" / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ModelPathError, match="vae/diffusion_pytorch_model.safetensors"):
        weight_files(snap)


# ------------------------------------------------------------------------------------------------ digests


@pytest.fixture
def snap(tmp_path) -> Path:
    return write_tree(tmp_path / "snap", flux_files())


@pytest.fixture
def reads(monkeypatch):
    """Counts the files ``runner.core.weights`` reads to hash (``file_sha256`` calls, by path)."""
    calls = []
    real = weights.file_sha256

    def counting(path, *a, **k):
        calls.append(Path(path))
        return real(path, *a, **k)

    monkeypatch.setattr(weights, "file_sha256", counting)
    return calls


def expected(snap: Path) -> Dict[str, str]:
    return {rel: hashlib.sha256((snap / rel).read_bytes()).hexdigest() for rel in LOADED}


def test_second_call_reads_no_file(snap, tmp_path, reads):
    cache = tmp_path / "rc"
    files = weight_files(snap)
    d1, s1 = hash_files(files, snap, cache)
    assert d1 == expected(snap) and s1["computed"] == LOADED and s1["cached"] == []
    assert s1["bytes_hashed"] == s1["bytes_total"] == sum(f.stat().st_size for f in files) and len(reads) == 4
    reads.clear()
    d2, s2 = hash_files(files, snap, cache)
    assert d2 == d1 and s2["cached"] == LOADED and s2["computed"] == [] and s2["bytes_hashed"] == 0
    assert reads == [] and s2["hash_s"] < 1.0 and s2["cache_file"] == str(cache / "weight_digests.json")
    if os.geteuid() != 0:  # unreadable files are never opened (root reads them anyway)
        for f in files:
            f.chmod(0)
        try:
            assert hash_files(files, snap, cache)[0] == d1
        finally:
            for f in files:
                f.chmod(0o644)


def test_default_cache_dir_is_runner_cache(snap, tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNER_CACHE", str(tmp_path / "envcache"))
    hash_files(weight_files(snap), snap)
    assert (tmp_path / "envcache" / "weight_digests.json").is_file()


def test_touched_file_is_hashed_again(snap, tmp_path, reads):
    cache = tmp_path / "rc"
    hash_files(weight_files(snap), snap, cache)
    vae = snap / "vae" / "diffusion_pytorch_model.safetensors"
    st = vae.stat()
    os.utime(vae, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    reads.clear()
    d, s = hash_files(weight_files(snap), snap, cache)
    assert s["computed"] == ["vae/diffusion_pytorch_model.safetensors"] and reads == [vae] and d == expected(snap)
    reads.clear()
    assert hash_files(weight_files(snap), snap, cache)[1]["computed"] == []  # the new stat is cached


def test_size_change_is_hashed_again_even_with_mtime_restored(snap, tmp_path, reads):
    cache = tmp_path / "rc"
    d0, _ = hash_files(weight_files(snap), snap, cache)
    te = snap / "text_encoder" / "model.safetensors"
    st = te.stat()
    with open(te, "r+b") as f:  # truncated (a half-finished copy), then the modification time put back
        f.truncate(st.st_size // 2)
    os.utime(te, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert te.stat().st_mtime_ns == st.st_mtime_ns
    d, s = hash_files(weight_files(snap), snap, cache)
    assert s["computed"] == ["text_encoder/model.safetensors"] and d == expected(snap)
    assert d["text_encoder/model.safetensors"] != d0["text_encoder/model.safetensors"]
    with open(te, "ab") as f:  # grown: a different size again
        f.write(b"x" * 10)
    d, s = hash_files(weight_files(snap), snap, cache)
    assert s["computed"] == ["text_encoder/model.safetensors"] and d == expected(snap)


def test_same_size_rewrite_with_mtime_restored_is_hashed_again(snap, tmp_path):
    cache = tmp_path / "rc"
    hash_files(weight_files(snap), snap, cache)
    te = snap / "text_encoder" / "model.safetensors"
    st = te.stat()
    time.sleep(0.05)  # past the kernel's coarse timestamp tick
    te.write_bytes(_bytes("other content", st.st_size))
    os.utime(te, ns=(st.st_atime_ns, st.st_mtime_ns))
    if te.stat().st_ctime_ns == st.st_ctime_ns:
        pytest.skip("this filesystem did not move the change time")
    d, s = hash_files(weight_files(snap), snap, cache)
    assert s["computed"] == ["text_encoder/model.safetensors"] and d == expected(snap)


def test_file_changed_while_hashed_is_not_cached(snap, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "rc"
    real = weights.file_sha256
    vae = snap / "vae" / "diffusion_pytorch_model.safetensors"

    def racing(path, *a, **k):
        digest = real(path, *a, **k)
        if Path(path) == vae:
            with open(vae, "ab") as f:
                f.write(b"appended by a concurrent writer")
        return digest

    monkeypatch.setattr(weights, "file_sha256", racing)
    with caplog.at_level(logging.WARNING, logger="runner"):
        hash_files(weight_files(snap), snap, cache)
    assert "changed while it was hashed" in caplog.text
    monkeypatch.setattr(weights, "file_sha256", real)
    d, s = hash_files(weight_files(snap), snap, cache)
    assert s["computed"] == ["vae/diffusion_pytorch_model.safetensors"] and d == expected(snap)


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"version": 1, "entries": [1, 2]}',
                                     b'{"version": 99, "entries": {}}', b"\xff\xfe\x00"])
def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(snap, tmp_path, caplog, content):
    cache = tmp_path / "rc"
    cache.mkdir()
    (cache / "weight_digests.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="runner"):
        d, s = hash_files(weight_files(snap), snap, cache)
    assert d == expected(snap) and s["computed"] == LOADED
    assert caplog.text.count("unreadable or corrupt") == 1
    doc = json.loads((cache / "weight_digests.json").read_text())
    assert doc["version"] == 1 and len(doc["entries"]) == len(LOADED)
    assert hash_files(weight_files(snap), snap, cache)[1]["cached"] == LOADED


def test_unusable_cache_dir_still_gives_digests(snap, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="runner"):
        d, s = hash_files(weight_files(snap), snap, blocker / "cache")
    assert d == expected(snap) and s["computed"] == LOADED and s["cache_file"] is None
    assert "cannot be used" in caplog.text


def _hash_in_process(args):
    snap, cache, rels, barrier = args
    barrier.wait()
    digests, stats = hash_files([Path(snap) / r for r in rels], Path(snap), Path(cache))
    return digests, stats["computed"]


def _run_concurrently(snap: Path, cache: Path, subsets):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(subsets))
    results = ctx.Queue()

    def target(rels):
        results.put(_hash_in_process((str(snap), str(cache), rels, barrier)))

    procs = [ctx.Process(target=target, args=(rels,)) for rels in subsets]
    for p in procs:
        p.start()
    out = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def test_concurrent_processes_hash_each_file_once_and_leave_a_valid_cache(snap, tmp_path):
    cache = tmp_path / "rc"
    out = _run_concurrently(snap, cache, [LOADED] * 4)
    assert all(d == expected(snap) for d, _ in out)
    assert sorted(rel for _, computed in out for rel in computed) == LOADED  # the others waited and read the cache
    doc = json.loads((cache / "weight_digests.json").read_text())
    assert len(doc["entries"]) == len(LOADED)
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_concurrent_disjoint_writers_lose_no_entry(snap, tmp_path):
    cache = tmp_path / "rc"
    _run_concurrently(snap, cache, [[rel] for rel in LOADED])
    d, s = hash_files(weight_files(snap), snap, cache)
    assert s["cached"] == LOADED and d == expected(snap)


def test_cache_keeps_several_stat_variants_per_path(tmp_path):
    """The same path with different inodes (e.g. per-host copies sharing one cache dir) does not evict itself."""
    entries = {}
    for ino in range(6):
        entries = weights._merge(entries, {"/w": {"size": 1, "mtime_ns": 1, "ctime_ns": 1, "ino": ino,
                                                  "sha256": str(ino), "stored": ino}})
    assert [e["ino"] for e in entries["/w"]] == [5, 4, 3, 2]
    assert weights._hit(entries, "/w", {"size": 1, "mtime_ns": 1, "ctime_ns": 1, "ino": 3}) == "3"
    assert weights._hit(entries, "/w", {"size": 1, "mtime_ns": 1, "ctime_ns": 1, "ino": 0}) is None


# ------------------------------------------------------------------------------ the environment that resolved them
def test_hub_environment_names_the_cache_that_resolved_the_weights(hf_home, monkeypatch):
    """Issue 29 (reproduction independent of the shell): the manifest's ``environment`` gets the absolute Hub
    cache that resolved a Hub id as ``HF_HUB_CACHE`` (and ``HF_HOME`` as it was set); a run with no Hub id gets
    nothing, so its environment stays as it was."""
    add_to_hub_cache(hf_home / "hub", "org/name", flux_files())
    _, prov = resolve_model_path("org/name", None)
    src = {"kind": "path", "hub": {k: prov[k] for k in ("repo_id", "revision", "cache_dir")}}
    assert weights.hub_environment([src]) == {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub")}
    assert weights.hub_environment([{"kind": "path", "path": "/x"}, {"kind": "dummy"}]) == {}
    monkeypatch.chdir(hf_home)
    monkeypatch.setenv("HF_HUB_CACHE", "hub")  # a relative cache is recorded absolute
    _, prov = resolve_model_path("org/name", None)
    env = weights.hub_environment([{"hub": {"cache_dir": prov["cache_dir"]}}])
    assert env["HF_HUB_CACHE"] == str(hf_home / "hub")


def test_repro_environment_of_a_manifest_that_only_names_the_cache(tmp_path):
    """A manifest written before the cache was recorded in ``environment`` still names it in
    ``model.source.hub.cache_dir``: the re-run gets it as ``HF_HUB_CACHE``; one recorded wins."""
    from runner.tools.repro import rerun_environment

    m = {"environment": {"TRITON_INTERPRET": "1"}, "model": {"source": {"hub": {"cache_dir": "/c/hub"}}}}
    assert rerun_environment(m) == {"TRITON_INTERPRET": "1", "HF_HUB_CACHE": "/c/hub"}
    m["environment"]["HF_HUB_CACHE"] = "/d/hub"
    assert rerun_environment(m)["HF_HUB_CACHE"] == "/d/hub"
    assert rerun_environment({"model": {"source": {"kind": "dummy"}}}) == {}


@pytest.mark.slow
def test_repro_of_a_hub_id_run_works_in_a_shell_without_its_hf_home(run_job, tiny_snapshot, tmp_path, monkeypatch,
                                                                    subprocess_env):
    """Issue 29: ``runner.repro`` and ``repro.sh`` of a run whose ``model.path`` was a Hub id, from a shell whose
    ``HF_HOME`` points elsewhere (or is unset), resolve the same snapshot and reproduce (it failed with
    ``HubCacheMissError``: nothing recorded where the cache was)."""
    import subprocess

    from runner.tools.repro import reproduce

    home = tmp_path / "hf"
    files = {str(f.relative_to(tiny_snapshot)): f.read_bytes() for f in tiny_snapshot.rglob("*") if f.is_file()}
    commit = add_to_hub_cache(home / "hub", "runner-test/tiny-flux", files)
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    r = run_job(["model=flux", "model.path=runner-test/tiny-flux", "model.generation.width=64",
                 "model.generation.height=64", "model.generation.num_inference_steps=1",
                 "model.generation.max_sequence_length=64", "dataset.limit=1"], name="orig")
    assert r.code == 0 and r.manifest["model"]["source"]["hub"]["revision"] == commit
    assert r.manifest["environment"]["HF_HUB_CACHE"] == str(home / "hub")
    assert f"export HF_HUB_CACHE={home / 'hub'}" in (r.run_dir / "repro.sh").read_text()

    monkeypatch.setenv("HF_HOME", str(tmp_path / "another-hf"))  # the other shell: no such cache there
    code, result = reproduce(r.run_dir, tmp_path / "again")
    assert code == 0 and result["rerun_exit_code"] == 0, result["problems"]
    again = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert again["model"]["source"]["hub"]["revision"] == commit

    env = {k: v for k, v in subprocess_env.items() if k not in ("HF_HOME", "HF_HUB_CACHE")}
    p = subprocess.run(["bash", str(r.run_dir / "repro.sh"), str(tmp_path / "sh")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    sh = json.loads((tmp_path / "sh" / "manifest.json").read_text())
    assert sh["model"]["source"]["hub"]["revision"] == commit and sh["status"] == "completed"
