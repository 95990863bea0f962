"""LoRA on both Wan 2.2 experts (issue #41): ``model.lora`` entries name the denoiser they load into
(``expert: transformer | transformer_2 | all``; diffusers' ``load_into_transformer_2``), a scale per expert is one entry
per expert; required on a two-expert model (diffusers' default loads into ``transformer`` alone). Real tiny_wan22 runs
on CPU: 4 steps, ``boundary_ratio`` 0.875 (steps 0-1 run ``transformer``, 2-3 ``transformer_2``); at 1 step only
``transformer`` runs (timestep 999 >= 875). Adapters are seeded random LoRA files for tiny_wan22's transformer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from _helpers import execute, requires_extra
from runner.core.errors import UserInputError

pytestmark = [pytest.mark.cpu, requires_extra("lora")]

REPO = Path(__file__).resolve().parents[1]
MODULES = ("blocks.0.attn1.to_q", "blocks.1.attn2.to_v", "blocks.1.ffn.net.0.proj")
ROWS = [{"id": "cat", "prompt": "a cat on a sofa"}, {"id": "dog", "prompt": "a dog in the snow"}]


def wan_linears() -> Dict[str, tuple]:
    from models import lora

    arch = yaml.safe_load((REPO / "conf/model/tiny_wan22.yaml").read_text())["architecture"]
    return lora.base_linears("WanTransformer3DModel", arch["transformer"])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Dict[str, Path]:
    from test_lora import write_adapter

    d = tmp_path_factory.mktemp("wan_adapters")
    lin = wan_linears()
    return {"hi": write_adapter(d / "hi.safetensors", 1, MODULES, shapes=lin),
            "lo": write_adapter(d / "lo.safetensors", 2, MODULES, shapes=lin)}


def lib(*entries: Dict[str, Any]) -> str:
    return "model.lora=[" + ",".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}" for e in entries) + "]"


def run(tmp: Path, name: str, *extra: str, rows: List[Dict[str, Any]] = ROWS, steps: int = 4, catch: tuple = (),
        on_loaded: Any = None):
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return execute(tmp / name, ["model=tiny_wan22", "dataset=jsonl", f"dataset.path={path}",
                                f"model.generation.num_inference_steps={steps}", *extra], catch=catch,
                   on_loaded=on_loaded)


def frames(r: Any) -> Dict[str, str]:
    return {it["id"]: it["frames_sha256"] for it in r.items if it["status"] == "ok"}


def lora_evidence(r: Any) -> Dict[str, Any]:
    return r.manifest["evidence"]["stages"]["denoise"]["lora"]


def test_an_adapter_per_expert_acts_in_that_expert_s_steps_alone(tmp_path, files):
    """hi in transformer, lo in transformer_2 at another scale, switched per row (unfused, observed): each item
    verified with its set; lo alone changes the 4-step videos but not the 1-step ones (its expert runs no step
    there), hi alone changes both; every call counts each expert's forwards."""
    both = lib({"name": "hi", "path": files["hi"], "expert": "transformer"},
               {"name": "lo", "path": files["lo"], "expert": "transformer_2", "scale": 0.5})
    cat = {"prompt": "a cat", "seed": 7}  # one seed: the rows differ in their adapters alone
    rows = [{"id": "none", **cat, "lora": []}, {"id": "hi", **cat, "lora": ["hi"]}, {"id": "lo", **cat, "lora": ["lo"]},
            {"id": "both", **cat}]
    for steps in (4, 1):
        base = run(tmp_path, f"base{steps}", rows=[{"id": "none", **cat}], steps=steps)
        r = run(tmp_path, f"per_row{steps}", both, "dataset.on_ignored=record", rows=rows, steps=steps)
        assert r.code == 0, r.error
        ev = lora_evidence(r)
        assert ev["verdict"] == "verified" and ev["mode"] == "per_batch" and ev["calls"] == 4, ev
        got = frames(r)
        assert got["none"] == frames(base)["none"]
        assert got["hi"] != got["none"] and got["both"] != got["lo"]
        if steps == 4:
            assert len({got["none"], got["hi"], got["lo"], got["both"]}) == 4
        else:  # transformer_2 runs no step: lo changes nothing, and is recorded ignored, not applied
            assert got["lo"] == got["none"] and got["both"] == got["hi"]
        recs = {it["id"]: it for it in r.items}
        sha = {a["name"]: a["sha256"] for a in r.manifest["model"]["source"]["lora"]["adapters"]}
        if steps == 1:
            lo = {"name": "lo", "sha256": sha["lo"], "scale": 0.5, "experts": ["transformer_2"]}
            assert recs["lo"]["params"]["lora"] == [] and recs["lo"]["ignored"]["lora"]["value"] == [lo]
            assert recs["lo"]["ignored"]["lora"]["from"].endswith(":3")  # the row named it
            assert recs["both"]["params"]["lora"] == [{"name": "hi", "sha256": sha["hi"], "scale": 1.0,
                                                       "experts": ["transformer"]}]
            assert recs["both"]["ignored"]["lora"] == {**recs["both"]["ignored"]["lora"], "value": [lo],
                                                       "from": "model.lora"}
            assert "runs no step" in recs["both"]["ignored"]["lora"]["why"] or "run(s) no step" in \
                recs["both"]["ignored"]["lora"]["why"]
            assert "ignored" not in recs["hi"] or "lora" not in recs["hi"]["ignored"]
            continue
        assert not any("lora" in (it.get("ignored") or {}) for it in r.items)
        assert recs["both"]["params"]["lora"] == [
            {"name": "hi", "sha256": r.manifest["model"]["source"]["lora"]["adapters"][0]["sha256"], "scale": 1.0,
             "experts": ["transformer"]},
            {"name": "lo", "sha256": r.manifest["model"]["source"]["lora"]["adapters"][1]["sha256"], "scale": 0.5,
             "experts": ["transformer_2"]}]
        assert r.manifest["model"]["lora"]["experts"] == {"transformer": ["hi"], "transformer_2": ["lo"]}


def test_each_expert_s_adapter_fused_at_its_scale_matches_it_unfused(tmp_path, files):
    """The same two entries fused at load (one set for every row): verified by each expert's weight checksums, and
    the videos within the fused-vs-unfused rounding of the unfused run's; a scale per expert changes the video."""
    import numpy as np

    entries = lib({"name": "hi", "path": files["hi"], "expert": "transformer", "scale": 0.7},
                  {"name": "lo", "path": files["lo"], "expert": "transformer_2", "scale": 0.4})
    fused = run(tmp_path, "fused", entries)
    unfused = run(tmp_path, "unfused", entries, "model.lora_fuse=unfused")
    assert fused.code == 0 and unfused.code == 0, (fused.error, unfused.error)
    ev = lora_evidence(fused)
    assert ev["mode"] == "fused" and ev["fused"]["verdict"] == "verified" and ev["fused"]["layers"] == 6, ev
    assert lora_evidence(unfused)["verdict"] == "verified"
    other = run(tmp_path, "other_scale", entries.replace("scale: 0.4", "scale: 0.9"))
    assert frames(other) != frames(fused)
    import imageio_ffmpeg

    def video(r: Any, it: Dict[str, Any]) -> np.ndarray:
        gen = imageio_ffmpeg.read_frames(str(r.run_dir / it["file"]))
        meta = next(gen)
        w, h = meta["size"]
        return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in gen]).astype(np.int16)

    for a, b in zip(sorted(fused.items, key=lambda i: i["id"]), sorted(unfused.items, key=lambda i: i["id"])):
        assert np.abs(video(fused, a) - video(unfused, b)).mean() < 2.0


def test_all_loads_one_file_into_both_experts(tmp_path, files):
    r = run(tmp_path, "all", lib({"name": "hi", "path": files["hi"], "expert": "all"}), "model.lora_fuse=unfused")
    assert r.code == 0, r.error
    assert r.manifest["model"]["lora"]["layers"] == 6 and lora_evidence(r)["verdict"] == "verified"
    assert r.manifest["model"]["lora"]["experts"] == {"transformer": ["hi"], "transformer_2": ["hi"]}
    one = run(tmp_path, "one", lib({"name": "hi", "path": files["hi"], "expert": "transformer"}),
              "model.lora_fuse=unfused")
    assert frames(one) != frames(r)


def test_the_expert_enters_the_identity(tmp_path, files):
    """The same file loaded into the other expert is another output: resuming the dir with it is refused naming the
    key, and rows that name the adapter carry the expert in their inputs (another inputs_sha256)."""
    from runner.core.resume import ResumeConflictError

    named = [{"id": "cat", "prompt": "a cat", "lora": ["x"]}]
    a = run(tmp_path, "same", lib({"name": "x", "path": files["hi"], "expert": "transformer"}), rows=named)
    assert a.code == 0, a.error
    b = run(tmp_path, "same", lib({"name": "x", "path": files["hi"], "expert": "transformer_2"}), rows=named,
            catch=(ResumeConflictError,))
    assert b.error is not None and "expert" in str(b.error), b
    c = run(tmp_path, "other", lib({"name": "x", "path": files["hi"], "expert": "transformer_2"}), rows=named)
    assert c.code == 0, c.error
    assert a.items[0]["inputs_sha256"] != c.items[0]["inputs_sha256"]
    assert a.items[0]["frames_sha256"] != c.items[0]["frames_sha256"]


@pytest.mark.parametrize("entry, says", [
    ({}, "model.lora[0].expert=<transformer | transformer_2 | all>"),
    ({"expert": "transformer_3"}, "expert='transformer_3' is not a denoiser of model=tiny_wan22"),
])
def test_an_entry_without_its_expert_on_a_two_expert_model_is_refused_before_loading(tmp_path, files, entry, says):
    r = run(tmp_path, "refused", lib({"name": "hi", "path": files["hi"], **entry}), catch=(UserInputError,))
    assert r.error is not None and r.error.exit_code == 2, r
    assert says in str(r.error) and "fix:" in str(r.error)
    assert not (tmp_path / "refused" / "items.jsonl").exists()


def test_an_expert_on_a_one_denoiser_model_is_refused(tmp_path, files):
    r = execute(tmp_path / "wan21", ["model=tiny_wan", "dataset.limit=1",
                                     lib({"name": "hi", "path": files["hi"], "expert": "transformer_2"})],
                catch=(UserInputError,))
    assert r.error is not None and "expert='transformer_2' is not a denoiser of model=tiny_wan" in str(r.error)


@pytest.mark.parametrize("fuse", ["fused", "unfused"])
def test_an_adapter_loaded_into_the_wrong_expert_fails_the_evidence(tmp_path, files, monkeypatch, fuse):
    """The planted fault: diffusers loads lo (entry: transformer_2) into transformer. Fused, its layers in
    transformer_2 hold no LoRA; unfused, transformer runs lo's branches where no entry put them: exit 3 either way."""
    from models import lora
    from runner.core.errors import EvidenceError

    monkeypatch.setitem(lora.EXPERT_LOAD_KWARGS, "transformer_2", {})
    r = run(tmp_path, f"wrong_{fuse}", lib({"name": "lo", "path": files["lo"], "expert": "transformer_2"}),
            f"model.lora_fuse={fuse}", catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3, r
    assert "transformer_2.blocks.0.attn1.to_q (lo)" in str(r.error) and "hold no LoRA branch" in str(r.error)


def test_a_row_naming_an_adapter_whose_expert_runs_no_step_is_refused(tmp_path, files):
    """The default ``dataset.on_ignored=error``: at 1 step transformer_2 runs no step, so a row naming lo (loaded into
    transformer_2 alone) is refused before loading, naming file:line, the adapter and the fix."""
    from runner.core.dataset import DatasetError

    rows = [{"id": "hi", "prompt": "a cat", "lora": ["hi"]}, {"id": "lo", "prompt": "a cat", "lora": ["lo"]}]
    r = run(tmp_path, "idle", lib({"name": "hi", "path": files["hi"], "expert": "transformer"},
                                  {"name": "lo", "path": files["lo"], "expert": "transformer_2"}),
            rows=rows, steps=1, catch=(DatasetError,))
    assert r.error is not None and r.error.exit_code == 2, r
    msg = str(r.error)
    assert f"{tmp_path / 'idle.jsonl'}:2: field 'lora' names adapter(s) that act on no step" in msg
    assert "lo load(s) into transformer_2" in msg and "fix:" in msg and ":1:" not in msg


# ------------------------------------------------------------------------------------ each expert, its own adapter
def file_deltas(path: Path) -> Dict[str, Any]:
    """``{module: B @ A}`` of an adapter file written by ``write_adapter`` (no alpha: peft's alpha/r is 1), read
    here from the file, not from the runner."""
    from safetensors.torch import load_file

    sd = load_file(str(path))
    return {m: sd[f"transformer.{m}.lora_B.weight"] @ sd[f"transformer.{m}.lora_A.weight"] for m in MODULES}


def pair(hi: float, lo: float, files: Dict[str, Path]) -> str:
    """hi loaded into transformer at ``hi``, lo into transformer_2 at ``lo``."""
    return lib({"name": "hi", "path": files["hi"], "expert": "transformer", "scale": hi},
               {"name": "lo", "path": files["lo"], "expert": "transformer_2", "scale": lo})


def test_each_expert_s_fused_delta_is_its_own_adapter_s_at_its_scale(tmp_path, files):
    """Fused at load, each expert's weights move by exactly its adapter's ``scale * B @ A`` (computed here from the
    files) in the adapted layers and nowhere else; swapping the two scales between the experts moves them by the
    swapped amounts and changes the videos. Kills: adapters loaded into swapped experts, a scale applied to the
    other expert, one expert's adapter dropped (its delta would be zero), the same scale for both."""
    import torch

    def weights(into: Dict[str, Any]) -> Any:
        def grab(engine: Any) -> None:
            for e in ("transformer", "transformer_2"):
                into[e] = {k: v.detach().clone() for k, v in getattr(engine.pipe, e).state_dict().items()}
        return grab

    base: Dict[str, Any] = {}
    assert run(tmp_path, "base", on_loaded=weights(base)).code == 0
    want = {"hi": file_deltas(files["hi"]), "lo": file_deltas(files["lo"])}
    videos = {}
    for hi, lo in ((0.7, 0.4), (0.4, 0.7)):
        got: Dict[str, Any] = {}
        r = run(tmp_path, f"fused_{hi}_{lo}", pair(hi, lo, files), on_loaded=weights(got))
        assert r.code == 0, r.error
        assert lora_evidence(r)["fused"]["verdict"] == "verified"
        assert lora_evidence(r)["fused"]["scales"] == {"transformer": {"hi": hi}, "transformer_2": {"lo": lo}}
        for expert, name, scale in (("transformer", "hi", hi), ("transformer_2", "lo", lo)):
            for k, w in got[expert].items():
                delta = w - base[expert][k]
                m = k[:-len(".weight")]
                if m in MODULES and k.endswith(".weight"):
                    torch.testing.assert_close(delta, scale * want[name][m], atol=1e-5, rtol=1e-4,
                                               msg=f"{expert}.{k}: not {name}'s B@A x {scale}")
                else:
                    assert torch.equal(w, base[expert][k]), f"{expert}.{k} changed, no adapter adapts it"
        videos[(hi, lo)] = frames(r)
    assert all(videos[(0.7, 0.4)][k] != videos[(0.4, 0.7)][k] for k in videos[(0.7, 0.4)])


def test_each_expert_runs_its_adapter_in_its_own_steps_at_its_scale_unfused(tmp_path, files):
    """Unfused: each expert's LoRA layers hold its adapter alone (the file's weights), and the evidence observes hi's
    branches in transformer's steps (0-1: timesteps 999, 900) and lo's in transformer_2's (2-3: 750, 500), each at
    its scale as peft applies it. Kills: swapped experts, scales on the wrong expert, an adapter dropped."""
    from safetensors.torch import load_file

    held: Dict[str, Any] = {}

    def grab(engine: Any) -> None:
        for key, layer in engine.passes["lora"].runtime.layers.items():
            held[key] = {n: layer.lora_A[n].weight.detach().clone() for n in layer.lora_A}

    r = run(tmp_path, "unfused", pair(0.7, 0.4, files), "model.lora_fuse=unfused", on_loaded=grab)
    assert r.code == 0, r.error
    sd = {n: load_file(str(files[n])) for n in ("hi", "lo")}
    assert sorted(held) == sorted([*MODULES, *(f"transformer_2.{m}" for m in MODULES)])
    for m in MODULES:
        assert list(held[m]) == ["hi"] and list(held[f"transformer_2.{m}"]) == ["lo"]
        assert (held[m]["hi"] == sd["hi"][f"transformer.{m}.lora_A.weight"]).all()
        assert (held[f"transformer_2.{m}"]["lo"] == sd["lo"][f"transformer.{m}.lora_A.weight"]).all()
    ev = lora_evidence(r)
    assert ev["verdict"] == "verified" and ev["calls"] == 2, ev
    assert ev["scales"] == [{"set": [["hi", 0.7], ["lo", 0.4]],
                             "applied": {"transformer": {"hi": 0.7}, "transformer_2": {"lo": 0.4}}}]
    (steps,) = ev["steps"]
    assert steps["observed"] == steps["expected"] == {"hi": [0, 1], "lo": [2, 3]}
    assert steps["experts"] == {"transformer": [0, 1], "transformer_2": [2, 3]}
    assert steps["timesteps"] == [999.0, 900.0, 750.0, 500.0]


def test_an_adapter_skipped_in_one_of_its_expert_s_steps_fails_the_evidence(tmp_path, files):
    """The planted fault: hi's branch in one layer is off in transformer's step 1 alone (timestep 900). Per call it
    still ran (step 0), so only the per-step check sees it: exit 3 naming the step, the expert and the layer."""
    from runner.core.errors import EvidenceError

    def off_at_900(engine: Any) -> None:
        layer = engine.passes["lora"].runtime.layers[MODULES[0]]

        def pre(mod: Any, args: Any, kwargs: Dict[str, Any]) -> None:
            layer._disable_adapters = float(kwargs["timestep"].reshape(-1)[0]) == 900.0

        engine.pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)

    r = run(tmp_path, "skipped", pair(1.0, 1.0, files), "model.lora_fuse=unfused", rows=ROWS[:1],
            on_loaded=off_at_900, catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3, r
    msg = str(r.error)
    assert "step 1 (transformer, timestep 900.0)" in msg and f"('{MODULES[0]}', 'hi')" in msg, msg
    bad = lora_evidence(r)["first_bad"]["bad_forwards"]
    assert {(b["step"], b["expert"]) for b in bad} == {(1, "transformer")}
    assert all(b["missing"] == [[MODULES[0], "hi"]] and not b["foreign"] for b in bad)


@pytest.mark.parametrize("fuse", ["fused", "unfused"])
def test_scales_swapped_between_the_experts_fail_the_evidence(tmp_path, files, monkeypatch, fuse):
    """The planted fault: ``set_adapters`` gets the two scales in reverse (hi at lo's 0.4 in transformer, lo at
    0.7). The layers still run and the fused deltas agree with the scales peft holds, so only reading the scale
    back per expert against the set sees it: exit 3 naming adapter, expert and both scales."""
    from diffusers import WanPipeline

    from runner.core.errors import EvidenceError

    real = WanPipeline.set_adapters
    monkeypatch.setattr(WanPipeline, "set_adapters", lambda self, names, weights=None:
                        real(self, names, list(reversed(weights))))
    r = run(tmp_path, f"swapped_{fuse}", pair(0.7, 0.4, files), f"model.lora_fuse={fuse}", rows=ROWS[:1],
            catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3, r
    msg = str(r.error)
    assert "hi runs at scale 0.4 in transformer, its set says 0.7" in msg, msg
    assert "lo runs at scale 0.7 in transformer_2, its set says 0.4" in msg, msg


def test_a_scale_per_expert_from_one_file_enters_the_identity(tmp_path, files):
    """One file, two entries (a scale per expert): swapping the scales between the experts is another output
    (inputs_sha256 and videos differ) and resuming a run dir with it is refused naming the key; the same config
    resumes, reusing every item."""
    from runner.core.resume import ResumeConflictError

    def one_file(hi: float, lo: float) -> str:
        return lib({"name": "x_hi", "path": files["hi"], "expert": "transformer", "scale": hi},
                   {"name": "x_lo", "path": files["hi"], "expert": "transformer_2", "scale": lo})

    a = run(tmp_path, "a", one_file(0.7, 0.4))
    b = run(tmp_path, "b", one_file(0.4, 0.7))
    assert a.code == b.code == 0, (a.error, b.error)
    ids = lambda r: {it["id"]: it["inputs_sha256"] for it in r.items}  # noqa: E731
    assert all(ids(a)[k] != ids(b)[k] for k in ids(a)) and all(frames(a)[k] != frames(b)[k] for k in frames(a))
    assert a.items[0]["params"]["lora"][1] == {"name": "x_lo", "sha256": a.items[0]["params"]["lora"][0]["sha256"],
                                               "scale": 0.4, "experts": ["transformer_2"]}
    again = run(tmp_path, "a", one_file(0.7, 0.4))
    assert again.code == 0 and again.manifest["counts"]["reused"] == 2
    other = run(tmp_path, "a", one_file(0.4, 0.7), catch=(ResumeConflictError,))
    assert other.error is not None and "scale" in str(other.error), other


def test_all_at_one_step_records_the_idle_expert_s_part_as_ignored(tmp_path, files):
    """``expert: all`` at 1 step: transformer_2 runs no step, so the item records hi as applied in transformer
    alone (the set a transformer-only run records, with its video) and its transformer_2 part under
    ``ignored.lora``. Kills: recording the idle expert's part as applied."""
    r = run(tmp_path, "all1", lib({"name": "hi", "path": files["hi"], "expert": "all"}), steps=1, rows=ROWS[:1])
    one = run(tmp_path, "one1", lib({"name": "hi", "path": files["hi"], "expert": "transformer"}), steps=1,
              rows=ROWS[:1])
    assert r.code == one.code == 0, (r.error, one.error)
    (it,), (ref,) = r.items, one.items
    sha = it["params"]["lora"][0]["sha256"]
    assert it["params"]["lora"] == [{"name": "hi", "sha256": sha, "scale": 1.0, "experts": ["transformer"]}]
    ig = it["ignored"]["lora"]
    assert ig["value"] == [{"name": "hi", "sha256": sha, "scale": 1.0, "experts": ["transformer_2"]}]
    assert ig["from"] == "model.lora" and "hi still acts in transformer" in ig["why"], ig
    assert it["params"]["lora"] == ref["params"]["lora"] and it["frames_sha256"] == ref["frames_sha256"]
    assert "ignored" not in ref or "lora" not in ref["ignored"]


@pytest.mark.parametrize("model", ["tiny_wan", "tiny_flux"])
def test_an_expert_other_than_transformer_on_a_one_transformer_family_names_the_fix(tmp_path, files, model):
    """Wan 2.1 and FLUX have one transformer: ``expert: transformer_2`` is refused at startup, before weights load,
    naming the field, the value and the values it takes."""
    r = execute(tmp_path / model, [f"model={model}", "dataset.limit=1",
                                   lib({"name": "hi", "path": files["hi"], "expert": "transformer_2"})],
                catch=(UserInputError,))
    assert r.error is not None and r.error.exit_code == 2, r
    msg = str(r.error)
    assert (f"model.lora[0] (hi): expert='transformer_2' is not a denoiser of model={model}; "
            "fix: model.lora[0].expert=<transformer | all>") in msg, msg
    assert not (tmp_path / model / "items.jsonl").exists()


def test_a_switch_at_another_step_moves_the_adapters_and_fails_the_lora_evidence(tmp_path, files):
    """The planted fault: after loading, the pipeline switches at boundary 0.7 (step 2, timestep 750, stays on
    transformer). The LoRA evidence itself, against the family's schedule, sees hi run in step 2 and lo only in 3."""
    from runner.core.errors import EvidenceError

    def elsewhere(engine: Any) -> None:
        engine.pipe.register_to_config(boundary_ratio=0.7)

    r = run(tmp_path, "moved", pair(1.0, 1.0, files), "model.lora_fuse=unfused", rows=ROWS[:1], on_loaded=elsewhere,
            catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3, r
    ev = lora_evidence(r)
    assert ev["verdict"] == "mismatch" and ev["first_bad"]["steps_differ"] and not ev["first_bad"]["bad_forwards"]
    steps = ev["first_bad"]["steps"]
    assert steps["observed"] == {"hi": [0, 1, 2], "lo": [3]} and steps["expected"] == {"hi": [0, 1], "lo": [2, 3]}
    assert "the adapters ran in steps {'hi': [0, 1, 2], 'lo': [3]}, their experts' steps are" in str(r.error)
