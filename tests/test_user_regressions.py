"""Regressions from a fresh user's session (each failed before its fix)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from runner.core.dataset import DatasetError, load_rows, safe_stem

REPO = Path(__file__).resolve().parent.parent


def test_shards_are_balanced_whole_batches():
    from runner.core.dataset import Row, batches, expand_items
    from runner.core.distributed import shard

    ids = [json.loads(l)["id"] for l in (REPO / "runner/data/shapes.jsonl").read_text().splitlines()]
    for n in (1, 2, 3, 5, 9):
        rows = [Row(id=i, prompt=i, negative_prompt=None, seed=None, width=64 if k % 3 else 32, height=64,
                    num_inference_steps=2, guidance_scale=1.0, num_images_per_prompt=1, line=k)
                for k, i in enumerate(ids[:n + 3])]  # two shapes: batches never mix them
        items = expand_items(rows, 0)
        for bs in (1, 2, 3):
            whole = batches(items, bs)
            for world in (2, 3, 4):
                parts = [shard(whole, world, r) for r in range(world)]
                assert sorted(it.key for p in parts for it in p) == sorted(it.key for it in items)
                sizes = [len(p) for p in parts]
                assert max(sizes) - min(sizes) <= bs, sizes  # hash-mod once gave rank 0 all of the first 6 ids
                # each rank re-batches its items into exactly the batches a one-worker run forms
                got = sorted(tuple(it.key for it in b) for p in parts for b in batches(p, bs))
                assert got == sorted(tuple(it.key for it in b) for b in whole)


def test_merge_keys_come_from_the_models_builtin_dataset(compose):
    from runner.app.execute import dataset_keys

    cfg = compose(["dataset.limit=4"], test_model=False)  # the default model, toy_shapes
    want = [json.loads(l)["id"] for l in (REPO / "runner/data/shapes.jsonl").read_text().splitlines()][:4]
    assert dataset_keys(cfg) == want  # the merge once read the FLUX prompts and called every row missing


def test_accuracy_counts_each_attribute_over_rows_that_state_it():
    from models.toy_shapes.oracle import accuracy

    got = {"color": "red", "shape": "circle", "position": "center"}
    acc = accuracy([(got, {"color": "red"}), (got, {"color": "red", "shape": "square"})])
    assert acc["color"] == 1.0 and acc["shape"] == 0.0 and acc["position"] is None and acc["all"] == 0.5


def test_empty_id_file_name_does_not_start_with_a_dash():
    stem = safe_stem("")
    assert stem.startswith("id-") and len(stem) == 11


def test_unknown_dataset_format_is_named_before_the_path(tmp_path):
    with pytest.raises(DatasetError, match="dataset.format='xlsx' is not known"):  # parquet is known since #20
        load_rows("xlsx", None, defaults={}, size_multiple=16, max_pixels=1 << 24)


def test_misspelt_engine_extras_key_is_refused(execute, tmp_path):
    from runner.core.resolve import MisplacedBackendKeyError

    with pytest.raises(MisplacedBackendKeyError, match="did you mean the legacy key 'attention_backend'"):
        execute(["+model.stages.denoise.engine_extras.attn_backend=sdpa"], tmp_path / "r")
    assert not (tmp_path / "r" / "images").exists()


def test_model_too_large_for_this_host_is_refused_before_loading(execute, tmp_path, monkeypatch):
    import models.memory as de
    from runner.core.errors import ConfigValueError

    monkeypatch.setattr(de, "available_bytes", lambda plat: 8 * 2**30)  # a host with 8 GiB free
    with pytest.raises(ConfigValueError, match=r"model=flux needs \d+\.\d GiB .* only 8\.0 GiB is free"):
        execute(["model=flux", "model.load_format=dummy", "dataset.limit=1"], tmp_path / "r")
    assert not (tmp_path / "r" / "images").exists()


def test_repro_sh_writes_into_the_new_dir_not_the_original_output_dir(tmp_path, subprocess_env):
    import subprocess

    orig = tmp_path / "outdir"
    args = [sys.executable, "-m", "runner", "model=tiny_flux", "dataset.limit=2", f"output.dir={orig}",
            f"hydra.run.dir={tmp_path / 'hydra'}"]
    assert subprocess.run(args, cwd=tmp_path, env=subprocess_env, capture_output=True).returncode == 0
    before = (orig / "manifest.json").read_bytes()
    script = (orig / "repro.sh").read_text()
    assert "output.dir" not in script and "hydra.run.dir=/" not in script
    new = tmp_path / "newrepro"
    p = subprocess.run(["bash", str(orig / "repro.sh"), str(new)], cwd=tmp_path, env=subprocess_env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    # the re-run once went back into output.dir: 2 reused, and the original manifest was overwritten
    assert (orig / "manifest.json").read_bytes() == before
    m = json.loads((new / "manifest.json").read_text())
    assert m["counts"]["ok"] == 2 and m["counts"]["reused"] == 0
    assert sorted(p.name for p in (new / "images").glob("*.png")) == sorted(p.name for p in (orig / "images").glob("*.png"))


def test_matrix_does_not_call_token_outputs_non_finite():
    from runner.tools.matrix import _all_finite

    ar = {"verdict": "verified", "stages": {"generate": {}}, "mismatches": []}  # an AR run's evidence
    assert _all_finite(ar)  # a verified AR job was listed as "failed: non-finite outputs"
    assert not _all_finite({"all_finite": False})
    assert not _all_finite({"workers": {}}) and _all_finite({"workers": {"0": {"all_finite": True}}})


def test_run_level_backend_error_in_a_pipeline_names_the_stage():
    from _helpers import CPU, compose, ctx, resolve, stage_info
    from runner.kernels.registry import UnknownBackendError

    ov = ["model=prompt_expand_flux", "platform=cpu", "backend.attention=CPU_ATTN"]
    cfg = compose(ov)
    with pytest.raises(UnknownBackendError) as e:
        resolve(cfg, ov, stage_info("denoise", context=ctx(**CPU)))
    msg = str(e.value)  # once only "backend.attention='CPU_ATTN' is not a known backend; closest match: CUDNN_ATTN"
    assert msg.startswith("stage 'denoise' of model.pipeline ['expand', 'denoise']: backend.attention='CPU_ATTN'")
    assert "model.stages.denoise.backend.attention" in msg


def test_expect_keys_and_values_are_checked_before_loading(execute, tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text(json.dumps({"id": "a", "prompt": "a blue square in the center on a white background",
                             "expect": {"colour": "blue", "shape": "sqaure"}}) + "\n")
    with pytest.raises(DatasetError) as e:  # was accepted: accuracy came out color None, shape 0.0
        execute(["model=toy_shapes", "dataset=jsonl", f"dataset.path={p}"], tmp_path / "r")
    msg = str(e.value)
    assert "expect.colour is not an attribute" in msg and "fix: expect.color" in msg
    assert "expect.shape='sqaure' is not a value" in msg and "fix: 'square'" in msg
    assert not (tmp_path / "r" / "images").exists()


def test_repro_sh_refuses_a_dataset_that_changed_or_is_gone(tmp_path, subprocess_env):
    """New-user report: ``repro.sh`` re-ran a run whose dataset file had changed since (other rows: not this run's
    re-run) without a word. Now its check ends the script with exit 2 naming the file, both sha256 and the fix,
    before anything runs; the unchanged file runs the command (the interpreter here prints it instead)."""
    import hashlib
    import subprocess

    from runner.core.provenance import write_repro

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "a", "prompt": "a red cube"}\n')
    sha = hashlib.sha256(rows.read_bytes()).hexdigest()
    orig = tmp_path / "orig"
    orig.mkdir()
    write_repro(orig, ["dataset=jsonl", f"dataset.path={rows}"], {}, {}, {"path": str(rows), "sha256": sha})
    fake = tmp_path / "fakepy"  # the check runs in the real interpreter; the run itself is only printed
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-" ]; then exec {sys.executable} -; fi\necho "RUN $*"\n')
    fake.chmod(0o755)
    env = dict(subprocess_env, PYTHON=str(fake))

    def repro():
        return subprocess.run(["bash", str(orig / "repro.sh"), str(tmp_path / "new")], env=env, capture_output=True,
                              text=True, timeout=60)

    p = repro()
    assert p.returncode == 0 and p.stdout.startswith("RUN -m runner dataset=jsonl"), p.stdout + p.stderr
    rows.write_text('{"id": "a", "prompt": "a blue cube"}\n')
    now = hashlib.sha256(rows.read_bytes()).hexdigest()
    p = repro()
    assert p.returncode == 2 and "RUN" not in p.stdout, p.stdout + p.stderr
    assert (f"repro: the dataset is not the run's: {rows}: sha256 {sha} when the run read it, now {now}; its rows "
            "would not re-run this run; nothing was run; fix: put the run's file back at that path") in p.stderr
    rows.unlink()
    p = repro()
    assert p.returncode == 2 and "now none (FileNotFoundError: No such file or directory)" in p.stderr, p.stderr
    # a dataset read from object storage has no local file of the run's own: nothing to compare
    write_repro(orig, ["seed=1"], {}, {}, {"path": "s3://b/rows.jsonl", "sha256": sha, "local_copy": "/x"})
    assert "hashlib" not in (orig / "repro.sh").read_text() and repro().returncode == 0
