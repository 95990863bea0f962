"""The resume decision (runner/core/resume.py: plan, ResumePlan, log_not_reused) on a run dir written here as a
run leaves it (manifest, journal, artifacts with their sha256), for the mutation run (benchmarks/mutation.py,
group ``resume_plan``): a fresh dir, ``run.resume`` without a run, a stage that does not resume, everything reused,
a batch regenerated whole for one item, a crashed earlier run, a config or dataset that differs (refused, or
forced), and the log naming why each finished item is regenerated."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.core import resume
from runner.core.dataset import Item, Row
from runner.core.resume import ResumeConflictError

IDENTITY = {"config": {"model": "toy"}, "packages": {"torch": "1"}}


def _items():
    rows = [Row(id=r, prompt=f"a {r}", negative_prompt=None, seed=None, width=64, height=64, num_inference_steps=2,
                guidance_scale=None, num_images_per_prompt=1, line=i + 1) for i, r in enumerate("abc")]
    items = [Item(r, 0, 10 + i) for i, r in enumerate(rows)]
    return items, [items[:2], items[2:]]


@pytest.fixture(scope="module")
def config(compose):
    return OmegaConf.to_container(compose(["model=toy_shapes"]), resolve=True)


def _plan(d: Path, config, **kw):
    items, batches = _items()
    args = dict(items=items, batches=batches, identity=IDENTITY, resumable=True,
                manifest_names=("manifest.json",), resume_dir=None, force=False, config=config,
                dataset_sha="d" * 64)
    args.update(kw)
    return resume.plan(d, **args)


def _earlier_run(d: Path, config, status="completed", identity=IDENTITY, batches=None, name="manifest.json",
                 journal="items.jsonl", **manifest):
    """A run dir as a finished run leaves it: every item written, its record with inputs_sha256 and batch."""
    items, default_batches = _items()
    expected = resume.expected_inputs(resume.identity_sha256(identity), batches or default_batches)
    (d / "images").mkdir(parents=True, exist_ok=True)
    recs = []
    for it in items:
        data = it.key.encode()
        (d / "images" / f"{it.key}.png").write_bytes(data)
        recs.append({"key": it.key, "status": "ok", "file": f"images/{it.key}.png",
                     "file_sha256": hashlib.sha256(data).hexdigest(), "seed": it.seed,
                     "prompt_sha256": hashlib.sha256(it.row.prompt.encode()).hexdigest(), **expected[it.key]})
    (d / journal).write_text("".join(json.dumps(r) + "\n" for r in recs))
    doc = {"run_id": "r0", "status": status, "config": config, "dataset": {"sha256": "d" * 64},
           "identity": {**identity, "sha256": resume.identity_sha256(identity)}, **manifest}
    (d / name).write_text(json.dumps(doc))
    return recs


def test_a_fresh_dir_generates_everything(tmp_path, config):
    p = _plan(tmp_path, config)
    items, batches = _items()
    assert p.run_sha == resume.identity_sha256(IDENTITY)
    assert p.expected == resume.expected_inputs(p.run_sha, batches)
    assert p.expected["b"]["batch"] == {"size": 2, "position": 1}
    assert (p.prev, p.done, p.reuse) == (None, {}, {})
    assert p.todo == items


def test_run_resume_without_a_run_is_refused(tmp_path, config):
    with pytest.raises(ResumeConflictError) as e:
        _plan(tmp_path, config, resume_dir="/old")
    assert str(e.value) == ("run.resume='/old' holds no manifest.json, so there is no run to resume; fix: point at "
                            "an earlier run dir")


def test_everything_finished_is_reused(tmp_path, config):
    recs = _earlier_run(tmp_path, config)
    p = _plan(tmp_path, config, resume_dir=str(tmp_path))
    assert p.prev["run_id"] == "r0" and p.prev["status"] == "completed"
    assert p.done == {r["key"]: r for r in recs} and p.reuse == p.done
    assert p.todo == []


def test_a_stage_that_does_not_resume_generates_everything(tmp_path, config):
    _earlier_run(tmp_path, config)
    items, _ = _items()
    p = _plan(tmp_path, config, resumable=False, batches=[])
    assert p.prev is None and p.done == {} and p.todo == items


def test_the_manifest_is_read_from_the_first_name_that_exists(tmp_path, config):
    _earlier_run(tmp_path, config, name="manifest.rank1.json", journal="items.rank1.jsonl")
    p = _plan(tmp_path, config, manifest_names=("manifest.rank1.json", "manifest.json"))
    assert p.prev["run_id"] == "r0" and p.todo == []
    assert _plan(tmp_path / "x", config, manifest_names=("manifest.json",)).prev is None


def test_a_running_earlier_run_is_crashed(tmp_path, config):
    _earlier_run(tmp_path, config, status="running")
    p = _plan(tmp_path, config)
    assert p.prev["status"] == "crashed" and p.prev["run_id"] == "r0"
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "running"


def test_one_item_not_reusable_regenerates_its_batch_whole(tmp_path, config, caplog):
    _, batches = _items()
    a, b, c = (it for bb in batches for it in bb)
    _earlier_run(tmp_path, config, batches=[[a], [b], [c]])  # b ran alone: batch 1/0, not 2/1
    with caplog.at_level(logging.WARNING, logger="runner"):
        p = _plan(tmp_path, config)
    assert set(p.reuse) == {"c"} and set(p.done) == {"a", "b", "c"}
    assert [it.key for it in p.todo] == ["a", "b"]
    msgs = [r.getMessage() for r in caplog.records if "regenerated" in r.getMessage()]
    assert msgs == ["2 finished item(s) are regenerated, their inputs differ from this run's: a (its batch: "
                    "size/position 1/0), b (its batch: size/position 1/0)"]


def test_a_changed_run_identity_is_logged_with_what_differs(tmp_path, config, caplog):
    old = {"config": {"model": "toy"}, "packages": {"torch": "0"}}
    _earlier_run(tmp_path, config, identity=old)
    with caplog.at_level(logging.WARNING, logger="runner"):
        p = _plan(tmp_path, config)
    assert p.reuse == {} and len(p.todo) == 3
    msgs = [r.getMessage() for r in caplog.records if "regenerated" in r.getMessage()]
    assert msgs == ["3 finished item(s) are regenerated, their inputs differ from this run's: a (run config/platform/"
                    "backends/packages), b (run config/platform/backends/packages), c (run config/platform/backends/"
                    "packages); run identity differs: packages.torch: '0' -> '1'"]


def test_more_than_ten_regenerated_items_are_elided(caplog):
    rows = [Row(id=f"r{i:02d}", prompt="p", negative_prompt=None, seed=None, width=64, height=64,
                num_inference_steps=2, guidance_scale=None, num_images_per_prompt=1, line=i) for i in range(12)]
    items = [Item(r, 0, 1) for r in rows]
    done = {it.key: {"key": it.key, "seed": 2} for it in items}
    with caplog.at_level(logging.WARNING, logger="runner"):
        resume.log_not_reused(done, {}, items, IDENTITY, IDENTITY)
        resume.log_not_reused(done, done, items, IDENTITY, IDENTITY)  # nothing stale: no line
        resume.log_not_reused({"zz": {}}, {}, items, IDENTITY, IDENTITY)  # not an item of this run: no line
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1
    assert msgs[0].startswith("12 finished item(s) are regenerated, their inputs differ from this run's: r00 (seed), ")
    assert msgs[0].endswith("r09 (seed) ...") and "r10" not in msgs[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runner"):
        resume.log_not_reused(done, {}, items[:1], None, IDENTITY)
    assert caplog.records[0].getMessage().endswith("r00 (seed); run identity differs: (the earlier run recorded no "
                                                   "identity)")


def test_a_different_config_is_refused_naming_the_keys_unless_forced(tmp_path, config):
    _earlier_run(tmp_path, config)
    new = {**config, "seed": int(config["seed"]) + 1}
    with pytest.raises(ResumeConflictError) as e:
        _plan(tmp_path, new, dataset_sha="e" * 64)
    assert str(e.value) == (
        f"{tmp_path} holds a run with a different config; resuming would mix artifacts. Differing keys:\n  "
        f"seed: {config['seed']!r} -> {config['seed'] + 1!r}\n  dataset.sha256: {'d' * 12}… -> {'e' * 12}…\n"
        "fix: use a new run dir, or run.force=true to resume anyway (only items whose inputs still match are kept)")
    p = _plan(tmp_path, new, force=True)
    assert set(p.done) == {"a", "b", "c"} and set(p.reuse) == {"a", "b", "c"}, "the identity decides what is reused"
    assert p.prev["run_id"] == "r0"


def test_a_sink_config_key_counts_only_when_given(tmp_path, config):
    _earlier_run(tmp_path, config)
    new = {**config, "output": {**config["output"], "video_codec": "other"}}
    assert _plan(tmp_path, new).todo == []
    with pytest.raises(ResumeConflictError) as e:
        _plan(tmp_path, new, config_keys=("output.video_codec",))
    assert "output.video_codec: " in str(e.value) and "-> 'other'" in str(e.value)


def test_refused_or_invalid_earlier_runs_are_no_runs(tmp_path, config):
    for st in ("refused", "invalid"):
        _earlier_run(tmp_path, config, status=st)
        with pytest.raises(ResumeConflictError):
            _plan(tmp_path, config, resume_dir=str(tmp_path))
        assert _plan(tmp_path, config).prev is None


def test_canonical_json_writes_paths_and_other_values_as_text():
    assert resume._canonical({"b": Path("/x"), "a": 1}) == b'{"a":1,"b":"/x"}'


def test_a_large_json_of_a_snapshot_is_fingerprinted_by_size(tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    small, big = snap / "small.json", snap / "big.json"
    small.write_bytes(b" " * ((1 << 24) - 1))
    big.write_bytes(b" " * (1 << 24))
    (snap / "w.safetensors").write_bytes(b"123")
    got = resume._source_fingerprint({"kind": "path", "path": str(snap), "files": {"stale": 1}})
    assert got["files"] == {"big.json": 1 << 24, "small.json": hashlib.sha256(small.read_bytes()).hexdigest(),
                            "w.safetensors": 3}
    assert got["kind"] == "path" and got["path"] == str(snap)


def test_a_when_set_key_without_its_rule_is_a_programming_error(monkeypatch):
    keys = resume._when_set_keys(resume.RESUME)
    assert keys, "the schema declares keys that enter the resume comparison only while set"
    monkeypatch.setattr(resume, "WHEN_SET", {k: v for k, v in resume.WHEN_SET.items() if k != keys[0]})
    with pytest.raises(KeyError) as e:
        resume._when_set_keys(resume.RESUME)
    assert e.value.args[0] == (f"['{keys[0]}'] enter only while set, but WHEN_SET does not say what set means for "
                               "them")


def test_an_earlier_manifest_without_config_or_dataset_is_compared_as_empty(tmp_path, config):
    _earlier_run(tmp_path, config)
    m = json.loads((tmp_path / "manifest.json").read_text())
    del m["config"], m["dataset"]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ResumeConflictError) as e:
        _plan(tmp_path, config)
    assert "Differing keys:\n  " in str(e.value) and "dataset.sha256" not in str(e.value)
    p = _plan(tmp_path, config, force=True)
    assert p.todo == [] and set(p.reuse) == {"a", "b", "c"}


def _stale(n: int):
    rows = [Row(id=f"r{i:02d}", prompt="p", negative_prompt=None, seed=None, width=64, height=64,
                num_inference_steps=2, guidance_scale=None, num_images_per_prompt=1, line=i) for i in range(n)]
    items = [Item(r, 0, 1) for r in rows]
    return items, {it.key: {"key": it.key, "seed": 2} for it in items}


@pytest.mark.parametrize("n,elided", [(10, False), (11, True)])
def test_the_log_elides_after_ten_items_on_the_runner_logger(caplog, n, elided):
    items, done = _stale(n)
    with caplog.at_level(logging.WARNING, logger="runner"):
        resume.log_not_reused(done, {}, items, IDENTITY, IDENTITY)
    (rec,) = caplog.records
    assert rec.name == "runner" and rec.levelno == logging.WARNING
    assert rec.getMessage().endswith(" ...") is elided
    assert rec.getMessage().count("(seed)") == 10


def test_the_log_names_at_most_eight_identity_differences(caplog):
    items, done = _stale(1)
    old = {"packages": {f"p{i}": "0" for i in range(9)}}
    new = {"packages": {f"p{i}": "1" for i in range(9)}}
    with caplog.at_level(logging.WARNING, logger="runner"):
        resume.log_not_reused(done, {}, items, old, new)
    msg = caplog.records[0].getMessage()
    assert msg.endswith("; run identity differs: " + "; ".join(f"packages.p{i}: '0' -> '1'" for i in range(8)))
