"""Issue 42: each test asserts a rule of a feature on a case where the wrong version of the code gives another answer
(a run that does not crash but is wrong), with expectations computed here by hand or by an independent
implementation (numpy, transformers, diffusers' own offload hooks). Each test names the wrong version it kills.

Areas: conditioning inputs, run identity under quantization, LoRA fusing, the memory planner and the quantization
evidence, metrics, the two-expert schedule, audio reproduction, the gate's metric floor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from PIL import Image

from _helpers import execute, skip_without_extra, tiny_clip
from models.toy_shapes.data import draw, quadrant_mask
from runner.core import dataset as ds
from runner.core import media

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "runner" / "data"
TOY = REPO / "models" / "toy_shapes" / "weights"


def _png(path: Path, array: np.ndarray) -> Path:
    Image.fromarray(array).save(path)
    return path


def _row(values: Dict[str, Any], w: int = 64, h: int = 64, rid: str = "x") -> Any:
    return ds.Row(id=rid, prompt="p", negative_prompt=None, seed=1, width=w, height=h, num_inference_steps=4,
                  guidance_scale=None, num_images_per_prompt=1, line=1, values=values, spec=ds.DIFFUSION_ROW)


def _rows(path: Path, rows: List[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------- conditioning inputs
def test_an_input_of_the_rows_area_but_another_shape_is_refused(tmp_path):
    """Kills: a size check that compares areas (``w * h``). 32x128 and 128x32 hold the 4,096 pixels of a 64x64
    row; each is refused naming both sizes, and a mask of its image's area but transposed is named too."""
    tall = _png(tmp_path / "tall.png", np.full((128, 32, 3), 200, np.uint8))  # (H, W): 32 wide, 128 high
    wide = _png(tmp_path / "wide.png", np.full((32, 128), 255, np.uint8))
    good = _png(tmp_path / "good.png", draw("red", "circle", "top left"))
    with pytest.raises(ds.DatasetError) as e:
        media.attach_inputs([_row({"image": tall.name})], tmp_path / "rows.jsonl")
    assert "is 32x128, and the row generates 64x64" in str(e.value)
    with pytest.raises(ds.DatasetError) as e:
        media.attach_inputs([_row({"image": tall.name, "mask_image": wide.name}, w=32, h=128)],
                            tmp_path / "rows.jsonl")
    msg = str(e.value)
    assert "field 'mask_image' = 'wide.png' is 128x32, its image 'tall.png' is 32x128" in msg, msg
    # the rule's own case passes: the exact size, also for a non-square row
    assert media.attach_inputs([_row({"image": tall.name}, w=32, h=128)], tmp_path / "rows.jsonl")[0].inputs
    assert media.attach_inputs([_row({"image": good.name})], tmp_path / "rows.jsonl")[0].inputs["image"].width == 64


def test_each_item_of_a_batch_gets_its_own_input_and_mask(tmp_path):
    """Kills: a batch whose call passes one item's input (or mask) for every item. ``call_inputs`` over three items
    with three different inputs gives each item exactly its own file's pixels, in batch order."""
    from diffusers import FluxInpaintPipeline

    from models.conditioning import call_inputs

    arrays = {k: draw(*a) for k, a in {"a": ("red", "circle", "top left"), "b": ("green", "triangle", "bottom left"),
                                         "c": ("blue", "square", "top right")}.items()}
    masks = {"a": quadrant_mask(0, 0), "b": quadrant_mask(32, 0), "c": quadrant_mask(0, 32)}
    items = []
    for k in arrays:
        _png(tmp_path / f"{k}.png", arrays[k]), _png(tmp_path / f"{k}_m.png", masks[k])
        row = media.attach_inputs([_row({"image": f"{k}.png", "mask_image": f"{k}_m.png"}, rid=k)],
                                  tmp_path / "rows.jsonl")[0]
        items.append(ds.Item(row=row, index=0, seed=1))
    import inspect

    params = set(inspect.signature(FluxInpaintPipeline.__call__).parameters)
    kw = call_inputs("inpaint", items, params, FluxInpaintPipeline)
    assert [np.asarray(x).tolist() == arrays[k].tolist() for x, k in zip(kw["image"], arrays)] == [True] * 3
    assert [np.array_equal(np.asarray(x), masks[k]) for x, k in zip(kw["mask_image"], masks)] == [True] * 3
    assert kw["strength"] == 0.6  # FluxInpaintPipeline's default, as the row sets none


@pytest.fixture(scope="module")
def img2img_first_latents():
    """The first forward's latents of a real toy_shapes FluxImg2ImgPipeline call over two items (CPU, 4 steps)."""
    from diffusers import FluxImg2ImgPipeline

    from models.conditioning import SequenceProbe

    pipe = FluxImg2ImgPipeline.from_pretrained(TOY, local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    probe = SequenceProbe(pipe.transformer)
    probe.arm(keep=True)
    imgs = [Image.open(DATA / f"{n}.png").convert("RGB") for n in ("shapes_input_red_circle_top_left",
                                                                    "shapes_input_blue_square_top_right",
                                                                    "shapes_input_green_triangle_bottom_left")]
    with torch.inference_mode():
        pipe(prompt=["a green triangle in the center on a white background"] * 2, image=imgs[:2], strength=0.25,
             num_inference_steps=16, height=64, width=64, max_sequence_length=16, output_type="np",
             generator=[torch.Generator().manual_seed(s) for s in (1, 2)])
    return pipe, imgs, probe.hidden, probe.timestep


def test_first_latents_check_fails_a_batch_where_only_one_item_has_its_own_input(img2img_first_latents):
    """Kills: a first-latents verdict that looks at one item of the batch (or at any). Item 0 checked against its
    own input, item 1 against a third image: item 0's statistic is ~1, item 1's is not, and the verdict is mismatch;
    the same with the wrong input on item 0."""
    from models.conditioning import first_latents_check

    pipe, imgs, hidden, t = img2img_first_latents
    own = first_latents_check(pipe, imgs[:2], hidden, t, 64, 64)
    lo, hi = own["range"]
    assert own["verdict"] == "verified" and all(lo <= s <= hi for s in own["statistic"]), own
    for wrong in ([imgs[0], imgs[2]], [imgs[2], imgs[1]]):
        half = first_latents_check(pipe, wrong, hidden, t, 64, 64)
        inside = [lo <= s <= hi for s in half["statistic"]]
        assert sorted(inside) == [False, True] and half["verdict"] == "mismatch", half


def test_an_input_changed_after_the_startup_check_fails_its_item_alone(tmp_path):
    """Kills: an input read again at generation without checking it against the sha256 recorded at startup. The
    file of row b is replaced after the weights loaded: b fails with the reason, a and c are generated, and b's
    record does not claim the new bytes."""
    d = tmp_path / "in"
    d.mkdir()
    for k, attrs in {"a": ("red", "circle", "top left"), "b": ("green", "triangle", "bottom left"),
                     "c": ("blue", "square", "top right")}.items():
        _png(d / f"{k}.png", draw(*attrs))
    rows = _rows(d / "rows.jsonl", [{"id": k, "prompt": "a yellow circle in the center on a white background",
                                     "image": f"{k}.png", "strength": 0.25} for k in "abc"])

    def swap(_engine):
        _png(d / "b.png", draw("yellow", "square", "bottom right"))

    r = execute(tmp_path / "run", ["model=toy_shapes", "model.task=image_to_image", "dataset=jsonl",
                                   f"dataset.path={rows}", "batch_size=3"], on_loaded=swap)
    status = {rec["key"]: rec["status"] for rec in r.items}
    assert status == {"a": "ok", "b": "failed", "c": "ok"}, status
    b = next(rec for rec in r.items if rec["key"] == "b")
    assert "changed since the startup check" in b["reason"] and str(d / "b.png") in b["reason"], b["reason"]
    # the direct rule: the recorded input loads while unchanged and is refused once changed
    row = media.attach_inputs([_row({"image": "a.png"})], d / "rows.jsonl")[0]
    assert np.array_equal(np.asarray(media.load_input(row.inputs["image"])), draw("red", "circle", "top left"))
    _png(d / "a.png", draw("red", "circle", "top right"))
    with pytest.raises(media.InputChangedError, match="changed since the startup check"):
        media.load_input(row.inputs["image"])
    (d / "a.png").unlink()
    with pytest.raises(media.InputChangedError, match="cannot be read any more"):
        media.load_input(row.inputs["image"])


def test_a_changed_mask_changes_the_item_identity_and_resume_regenerates_it(tmp_path):
    """Kills: an item identity (``inputs_sha256``) that holds the image's bytes but not the mask's. Two items that
    differ only in the mask's bytes have different identities (a renamed mask of the same bytes has the same);
    end to end, a resume after one row's mask changed regenerates that row and reuses the other."""
    from runner.core.resume import inputs_sha256

    _png(tmp_path / "img.png", draw("red", "circle", "top left"))
    _png(tmp_path / "m1.png", quadrant_mask(0, 0))
    shutil.copy(tmp_path / "m1.png", tmp_path / "m1_renamed.png")
    _png(tmp_path / "m2.png", quadrant_mask(32, 32))

    def ident(mask):
        row = media.attach_inputs([_row({"image": "img.png", "mask_image": mask})], tmp_path / "rows.jsonl")[0]
        return inputs_sha256("run", ds.Item(row=row, index=0, seed=1))

    assert ident("m1.png") == ident("m1_renamed.png") != ident("m2.png")

    d = tmp_path / "in"
    d.mkdir()
    for k, (x, y) in {"a": (0, 0), "b": (32, 0)}.items():
        _png(d / f"{k}.png", draw("green", "square", "center"))
        _png(d / f"{k}_mask.png", quadrant_mask(x, y))
    rows = _rows(d / "rows.jsonl", [{"id": k, "prompt": "a red circle in the center on a white background",
                                     "image": f"{k}.png", "mask_image": f"{k}_mask.png"} for k in "ab"])
    over = ["model=toy_shapes", "model.task=inpaint", "dataset=jsonl", f"dataset.path={rows}",
            "model.generation.num_inference_steps=4"]
    first = execute(tmp_path / "run", over)
    assert first.code == 0, first.error
    before = {rec["key"]: rec for rec in first.items}
    _png(d / "b_mask.png", quadrant_mask(0, 32))
    again = execute(tmp_path / "run", over)
    assert again.code == 0, again.error
    assert (again.manifest["counts"]["ok"], again.manifest["counts"]["reused"]) == (1, 1)
    after = {rec["key"]: rec for rec in again.items}
    assert after["a"]["file_sha256"] == before["a"]["file_sha256"]
    assert after["b"]["inputs"]["mask_image"]["sha256"] != before["b"]["inputs"]["mask_image"]["sha256"]
    out = np.asarray(Image.open(again.run_dir / after["b"]["file"]).convert("RGB"))
    keep = quadrant_mask(0, 32) < 128  # the overlay keeps the input outside the NEW mask
    assert np.array_equal(out[keep], draw("green", "square", "center")[keep])


# ------------------------------------------------------------------------------------------- run identity
@pytest.mark.parametrize("model, component", [("tiny_flux", "text_encoder"), ("tiny_flux", "text_encoder_2"),
                                              ("tiny_wan22", "transformer_2")])
def test_quantizing_a_text_encoder_or_the_second_expert_changes_the_run_identity(compose, model, component):
    """Kills: a run identity that reads the quantization of ``transformer`` only. The composed config of a run that
    quantizes only ``component`` has another identity than the plain run's and than the run that quantizes only
    the transformer, and the identity diff names the component's key."""
    from omegaconf import OmegaConf

    from runner.core.resume import identity_diff, identity_sha256, run_identity

    def ident(*over):
        cfg = OmegaConf.to_container(compose([f"model={model}", "platform=cpu", *over]), resolve=True)
        return run_identity(cfg, "float32", {"kind": "cpu"}, {}, {}, {})

    plain, comp, tr = (ident(), ident(f"model.quantization.{component}=int8wo"),
                       ident("model.quantization.transformer=int8wo"))
    both = ident("model.quantization.transformer=int8wo", f"model.quantization.{component}=int8wo")
    shas = [identity_sha256(x) for x in (plain, comp, tr, both)]
    assert len(set(shas)) == 4, shas
    assert comp["config"]["model.quantization"] == {component: "int8wo"}
    assert any(k.startswith("config.model.quantization") for k in identity_diff(tr, both)), identity_diff(tr, both)


# ------------------------------------------------------------------------------------------- LoRA
@pytest.fixture(scope="module")
def toy_adapter(tmp_path_factory) -> Path:
    from test_lora import write_adapter

    return write_adapter(tmp_path_factory.mktemp("lora42") / "a.safetensors", 7)


def _fused(adapter: Path, wrong_scale: Optional[float] = None) -> Dict[str, Any]:
    """The fused-set evidence of ``adapter`` at scale 1 on a fresh toy_shapes pipeline; ``wrong_scale``: diffusers'
    ``fuse_lora`` made to fuse at that scale instead (a fuse that changes the weights by another delta)."""
    from diffusers import FluxPipeline

    from models import lora

    skip_without_extra("lora")
    pipe = FluxPipeline.from_pretrained(TOY, local_files_only=True, dtype=torch.float32)
    if wrong_scale is not None:
        real = pipe.fuse_lora

        def fuse_lora(*a, **k):
            return real(*a, **{**k, "lora_scale": wrong_scale})

        pipe.fuse_lora = fuse_lora
    lib = [lora.Adapter(name="a", path=str(adapter), scale=1.0, sha256=lora.file_sha256(adapter), layers=())]
    rt = lora.Runtime(lib, True, "test", [(("a", 1.0),)], observe=True)
    rt.load(pipe)
    return rt.evidence("denoise")


def test_a_fused_change_that_is_not_the_adapters_delta_is_a_mismatch(toy_adapter):
    """Kills: a fused-LoRA check that asks only whether the weights changed. Fused at twice its scale, every adapted
    layer's weight changes, by twice the adapter's ``scaling * B @ A``: each layer is a delta mismatch (not
    'changed nothing'), the verdict mismatch; fused as asked, verified."""
    from test_lora import MODULES

    sec, mm = _fused(toy_adapter)
    assert sec["fused"]["verdict"] == "verified" and not mm, (sec, mm)
    sec, mm = _fused(toy_adapter, wrong_scale=2.0)
    f = sec["fused"]
    assert f["verdict"] == "mismatch" and f["changed_nothing"] == [], f
    assert sorted(f["delta_mismatch"]) == sorted(MODULES), f
    assert len(mm) == 1 and f"{len(MODULES)} whose change is not the adapter's delta" in mm[0], mm


# ------------------------------------------------------------------------------------------- memory
class _Net(torch.nn.Module):
    """An input Linear, three blocks of different sizes in a ModuleList, an output Linear (float32)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)  # 144 parameters
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16), torch.nn.Linear(16, 32),  # 272, 544
                                           torch.nn.Linear(32, 16)])  # 528
        self.out = torch.nn.Linear(16, 4)  # 68

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _resident_peak(m: torch.nn.Module, prefetch: bool) -> int:
    """The most bytes diffusers' block-level group offload holds onloaded at once during one forward on CPU
    (onload = offload device = CPU; each group's ``onload_``/``offload_`` tracked). ``prefetch``: the groups
    chained as diffusers chains them for a stream (``LazyPrefetchGroupOffloadingHook.post_forward``: each group's
    hook onloads the next one; the stream itself needs an accelerator)."""
    from diffusers.hooks import apply_group_offloading
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING

    from runner.core.memory import tensor_bytes

    apply_group_offloading(m, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1)
    hooks = [m._diffusers_hook.get_hook(_GROUP_OFFLOADING)] + [b._diffusers_hook.get_hook(_GROUP_OFFLOADING)
                                                                 for b in m.blocks]
    on: Dict[int, int] = {}
    peak = [0]
    for h in hooks:
        g = h.group
        tensors = {id(t): t for mod in g.modules for t in (*mod.parameters(), *mod.buffers())}
        tensors.update({id(t): t for t in (*g.parameters, *g.buffers)})
        size = sum(tensor_bytes(t) for t in tensors.values())

        def wrap(g=g, size=size, up=g.onload_, down=g.offload_):
            def onload_():
                on[id(g)] = size
                peak[0] = max(peak[0], sum(on.values()))
                return up()

            def offload_():
                on.pop(id(g), None)
                return down()

            g.onload_, g.offload_ = onload_, offload_

        wrap()
    if prefetch:
        for a, b in zip(hooks, hooks[1:]):
            a.next_group, b.group.onload_self = b.group, False
    with torch.no_grad():
        m(torch.ones(2, 8))
    return peak[0]


def test_group_offload_plans_count_the_prefetched_group_a_cpu_run_holds():
    """Kills: a planner that counts one group resident under ``use_stream`` (the prefetched next group left out).
    Sizes by hand (float32): unmatched = inp + out = (144 + 68) * 4 = 848 bytes; blocks 1088, 2176, 2112. Without
    a stream the peak is unmatched + the largest block = 3024, with prefetch unmatched + two blocks; a CPU run of
    diffusers' own hooks holds exactly the first and at most the second; ``auto`` under a budget between the one-
    and the two-group counts does not take group_block."""
    from runner.core import memory as planner

    size = planner.size_module("t", _Net())
    assert (size.unmatched, size.blocks, size.max_leaf, size.other) == (848, (1088, 2176, 2112), 2176, 0)
    stage = [planner.Stage("denoise", {"t": 1000})]
    no_stream = planner.plan("group_block", {"t": size}, stage, "t", 4, use_stream=False, blocks_per_group=1)
    stream = planner.plan("group_block", {"t": size}, stage, "t", 4, use_stream=True)
    leaf = planner.plan("group_leaf", {"t": size}, stage, "t", 4, use_stream=True)
    assert no_stream.stages["denoise"] == 848 + 2176 + 1000
    assert stream.stages["denoise"] == 848 + 2 * 2176 + 1000
    assert leaf.stages["denoise"] == 0 + 2 * 2176 + 1000
    assert _resident_peak(_Net(), prefetch=False) == 848 + 2176
    held = _resident_peak(_Net(), prefetch=True)
    assert held == 848 + 2176 + 2112 and 848 + 2176 < held <= stream.stages["denoise"] - 1000
    cands = planner.plans({"t": size}, stage, "t", 4, use_stream=True)
    budget = planner.RESERVE_BYTES + 848 + 2176 + 2112 + 1000  # what the prefetching run holds, plus the reserve
    p, why = planner.choose("auto", cands, budget)
    assert p.offload != "group_block" and p.peak <= budget, (p.offload, why)
    assert "group_block needs" in why


def test_a_component_claiming_quantization_with_no_quantized_linear_is_a_mismatch():
    """Kills: quantization evidence that reports the method without checking any Linear holds its weight class.
    A component declared int8wo whose Linears are plain float: 0 quantized Linears and a mismatch naming it;
    quantized for real (torchao, as the runner's loader does): every Linear counted, no mismatch."""
    from models.memory import QuantProbe

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    probe = QuantProbe({"transformer": "int8wo"})
    plain = net()
    probe.attach({"transformer": plain})
    plain(torch.ones(1, 16))
    sec, bad = probe.section()
    assert sec["transformer"]["linears"] == 2 and sec["transformer"]["quantized_linears"] == 0
    assert sec["transformer"]["quantized_calls"] == 0
    assert bad == ["model.quantization.transformer=int8wo: none of its 2 Linears holds a "
                   f"{'/'.join(__import__('runner.kernels.quantization', fromlist=['get']).get('int8wo').tensor_classes)}"
                   " weight after loading"], bad
    pytest.importorskip("torchao.quantization")
    from models.memory import quantize_built

    q = net()
    quantize_built(q, "int8wo", "diffusers", torch.float32)
    probe = QuantProbe({"transformer": "int8wo"})
    probe.attach({"transformer": q})
    q(torch.ones(1, 16))
    sec, bad = probe.section()
    assert sec["transformer"]["quantized_linears"] == 2 and sec["transformer"]["quantized_calls"] == 2 and not bad


# ------------------------------------------------------------------------------------------- metrics
@pytest.fixture(scope="module")
def clip_models(tmp_path_factory) -> Dict[str, Path]:
    d = tmp_path_factory.mktemp("clip42")
    return {"pos": tiny_clip(d / "pos"), "mixed": tiny_clip(d / "mixed", offset=0.5)}


def _clip_reference(clip: Path, images: List[np.ndarray], prompts: List[str]) -> List[float]:
    """``100 * cos`` of each (image, prompt) pair with transformers alone (float64), unclamped."""
    from transformers import CLIPModel, CLIPProcessor

    from _helpers import clip_cosines

    model = CLIPModel.from_pretrained(clip).double().eval()
    return [100.0 * c for c in clip_cosines(model, CLIPProcessor.from_pretrained(clip), images, prompts)]


def test_the_tiny_clip_scores_depend_on_the_prompt(clip_models):
    """The metric tests below need a CLIP whose text embedding depends on the prompt (pooled at the end-of-text
    token): else a score paired with another prompt is the same number."""
    from runner.core.metrics import REGISTRY

    img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    s = REGISTRY["clip_score"].load(clip_models["pos"], "cpu")([img] * 3, ["a red circle", "a blue square", "x"])
    assert len({round(x, 3) for x in s}) == 3, s


def test_resumed_scoring_pairs_each_artifact_with_its_own_prompt(tmp_path, clip_models):
    """Kills: scoring that pairs a chunk's artifacts with the prompts of other records (e.g. the run's records
    where only some need scoring after a resume). Five records, two keep their scores, three are scored in chunks
    of two: each score is CLIPScore of its own image and prompt, recomputed pair by pair."""
    from runner.core.dataset import file_sha256
    from runner.core.metrics import MetricSet, model_digests, score_records

    clip = clip_models["pos"]
    (tmp_path / "images").mkdir()
    rng = np.random.default_rng(5)
    prompts = ["a red circle", "a blue square", "a green triangle", "a red circle in the top left", "x"]
    images, records = [], []
    for i, p in enumerate(prompts):
        a = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        images.append(a)
        _png(tmp_path / "images" / f"{i}.png", a)
        records.append({"key": str(i), "status": "ok", "file": f"images/{i}.png", "prompt": p,
                        "file_sha256": file_sha256(tmp_path / "images" / f"{i}.png")})
    ms = MetricSet(names=["clip_score"], paths={"clip_score": clip}, sources={"clip_score": {}}, batch_size=2)
    digest = model_digests(ms)["clip_score"]["sha256"]
    for i in (0, 2):  # scored before the resume
        records[i].update(metrics={"clip_score": -1.0}, metrics_models={"clip_score": digest})
    assert score_records(tmp_path, records, ms, "cpu") == {"clip_score": 3}
    want = [max(x, 0.0) for x in _clip_reference(clip, images, prompts)]
    got = [r["metrics"]["clip_score"] for r in records]
    assert got[0] == got[2] == -1.0  # kept
    assert [got[i] for i in (1, 3, 4)] == pytest.approx([want[i] for i in (1, 3, 4)], abs=1e-4)


def test_summary_quantiles_are_numpys_on_asymmetric_scores():
    """Kills: quantiles of another rule (nearest rank, reversed, percentiles of 0-1 fractions). Scores 1, 2, 3, 4,
    100 (and a failed item and an unscored one, left out): numpy's linear rule by hand, position q * (n - 1):
    p10 = 1.4, p25 = 2, p50 = 3, p75 = 4, p90 = 4 + 0.6 * 96 = 61.6; mean 22, population std."""
    from runner.core.metrics import summary

    vals = [4.0, 100.0, 1.0, 3.0, 2.0]
    recs = [{"status": "ok", "metrics": {"m": v}} for v in vals]
    recs += [{"status": "failed", "metrics": {"m": 1000.0}}, {"status": "ok", "metrics": {}}]
    s = summary(recs, ["m", "other"])
    assert s["other"] == {"n": 0}
    want = {"n": 5, "mean": 22.0, "min": 1.0, "p10": 1.4, "p25": 2.0, "p50": 3.0, "p75": 4.0, "p90": 61.6,
            "max": 100.0}
    assert {k: s["m"][k] for k in want} == pytest.approx(want, abs=1e-9)
    assert s["m"]["std"] == pytest.approx(float(np.std(vals)), abs=1e-5)
    assert {f"p{int(q * 100)}": s["m"][f"p{int(q * 100)}"] for q in (0.1, 0.25, 0.5, 0.75, 0.9)} == pytest.approx(
        {f"p{int(q * 100)}": float(np.quantile(vals, q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9)}, abs=1e-9)


def test_clip_score_clamps_each_image_and_each_frame_at_zero(clip_models):
    """Kills: CLIPScore without its clamp, or clamping a video's mean instead of each frame. With a CLIP whose
    cosines take both signs: each image's score is ``max(100 * cos, 0)`` (recomputed with transformers), and a
    video of one negative and one positive frame scores the mean of the clamped frames."""
    from runner.core.metrics import REGISTRY

    clip = clip_models["mixed"]
    rng = np.random.default_rng(0)
    images = list(rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)) + [np.zeros((32, 32, 3), np.uint8)]
    prompts = ["a red circle"] * 5
    raw = _clip_reference(clip, images, prompts)
    assert min(raw) < -1 and max(raw) > 1, raw  # both signs: the clamp decides
    score = REGISTRY["clip_score"].load(clip, "cpu")
    assert score(images, prompts) == pytest.approx([max(x, 0.0) for x in raw], abs=1e-4)
    neg, pos = int(np.argmin(raw)), int(np.argmax(raw))
    video = np.stack([images[neg], images[pos]])
    assert score([video], ["a red circle"]) == pytest.approx([(0.0 + raw[pos]) / 2], abs=1e-4)


# ------------------------------------------------------------------------------------------- two experts
def test_a_step_partly_run_by_the_wrong_expert_is_a_mismatch():
    """Kills: an expert check that accepts a step when the expected expert is among those that ran it (or looks
    at its first forward only). Two steps of two forwards (CFG), one forward of one step on the other expert (either
    step, either forward): one mismatch naming that step and both experts; the same call run right is verified."""
    from models.denoiser_evidence import expert_schedule

    expected = [(1000.0, "transformer"), (500.0, "transformer_2")]
    right = [("transformer", 1000.0), ("transformer", 1000.0), ("transformer_2", 500.0), ("transformer_2", 500.0)]
    sec, mm = expert_schedule("denoise", [{"item": "a", "expected": expected, "observed": right, "per_step": 2}],
                              "rule")
    assert sec["verdict"] == "verified" and mm == [] and sec["expected_forwards"] == {"transformer": 2,
                                                                                       "transformer_2": 2}
    for step, partly in ((1, [right[0], right[1], right[2], ("transformer", 500.0)]),
                         (1, [right[0], right[1], ("transformer", 500.0), right[3]]),
                         (0, [right[0], ("transformer_2", 1000.0), right[2], right[3]]),
                         (0, [("transformer_2", 1000.0), right[1], right[2], right[3]])):
        sec, mm = expert_schedule("denoise", [{"item": "a", "expected": expected, "observed": partly,
                                               "per_step": 2}], "rule")
        t, e = expected[step]
        assert sec["verdict"] == "mismatch" and len(mm) == 1, mm
        assert f"step {step} (timestep {t:g}) ran transformer+transformer_2" in mm[0], mm
        assert f"expected {e} (rule)" in mm[0], mm
        assert sec["first"]["steps"][step]["observed"] == ["transformer", "transformer_2"]


# ------------------------------------------------------------------------------------------- audio
def test_the_same_samples_at_another_sample_rate_are_not_reproduced(tmp_path):
    """Kills: an audio comparison by samples alone. The same int16 samples muxed at 8 kHz and at 16 kHz (another
    sound: twice as fast) are a mismatch, exact (CPU) and by PSNR; at the same rate they reproduce."""
    from runner.core import video
    from runner.tools import repro

    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    pcm = video.to_pcm16(rng.uniform(-0.5, 0.5, (1, 400)))
    video.write_video(tmp_path / "a.mp4", frames, 8, "h264_lossless", audio=pcm, sample_rate=8000)
    video.write_video(tmp_path / "b.mp4", frames, 8, "h264_lossless", audio=pcm, sample_rate=16000)
    video.write_video(tmp_path / "c.mp4", frames, 8, "h264_lossless", audio=pcm, sample_rate=8000)
    assert np.array_equal(video.read_audio(tmp_path / "b.mp4")[0], pcm)  # the samples are the same
    for exact in (True, False):
        row, notes = repro._compare_audio(tmp_path / "a.mp4", tmp_path / "b.mp4", exact, 40)
        assert notes and "rate" in notes[0] and "8000 Hz" in notes[0] and "16000 Hz" in notes[0], notes
        assert row["audio_psnr_db"] is None
        assert repro._compare_audio(tmp_path / "a.mp4", tmp_path / "c.mp4", exact, 40)[1] == []


# ------------------------------------------------------------------------------------------- gate
def test_min_metric_ratio_with_a_negative_lossless_mean_needs_the_lossy_mean_at_least_as_high(tmp_path):
    """Kills: a ratio taken against a negative mean (a worse, more negative lossy mean then reads as a ratio > 1).
    Lossless scores -2, -4 (mean -3): lossy -4, -5 (mean -4.5, ratio 1.5) fails; lossy -1, -2 (mean -1.5, ratio
    0.5) passes; the gate's verdict follows."""
    from runner.tools.gate import compare, metric_ratios
    from test_metrics import _scored_job

    ref = _scored_job(tmp_path, "ref", {"a": -2.0, "b": -4.0})
    worse = _scored_job(tmp_path, "worse", {"a": -4.0, "b": -5.0})
    better = _scored_job(tmp_path, "better", {"a": -1.0, "b": -2.0})
    w = metric_ratios(worse, ref, {"clip_score": 0.99})["clip_score"]
    assert (w["lossy"], w["lossless"], w["pass"]) == (-4.5, -3.0, False), w
    b = metric_ratios(better, ref, {"clip_score": 0.99})["clip_score"]
    assert (b["lossy"], b["lossless"], b["pass"]) == (-1.5, -3.0, True), b
    for job, verdict in ((worse, "fail"), (better, "pass")):
        for j in (job, ref):
            (j.path / "images").mkdir(parents=True, exist_ok=True)
            for r in j.items:  # equal images: the metric alone decides
                _png(j.path / r["file"], np.full((8, 8, 3), 128, np.uint8))
        doc = compare(job, ref, min_metric_ratio={"clip_score": 0.99})
        assert doc["verdict"] == verdict, doc


# ------------------------------------------------------------------------------- the oracle's accuracy (field)
def _accuracy(d: Path) -> Dict[str, Any]:
    return json.loads((d / "manifest.json").read_text())["accuracy"]


def test_items_restored_from_the_unlisted_journal_are_read_not_counted_as_misses(execute, tmp_path):
    """A new user's session: ``dataset.limit=4``, then ``2`` (items 3-4 move to items.unlisted.jsonl), then ``4``
    again: the third run reuses all four (the same bytes), so its accuracy is the first run's. It recorded 0.5: the
    two restored items had no record in items.jsonl when the oracle read them (``read`` null, scored as misses)."""
    d = tmp_path / "run"
    first = execute(["model=toy_shapes", "dataset.limit=4"], d)
    assert first.code == 0 and _accuracy(d)["all"] == 1.0
    assert execute(["model=toy_shapes", "dataset.limit=2"], d).code == 0 and (d / "items.unlisted.jsonl").is_file()
    third = execute(["model=toy_shapes", "dataset.limit=4"], d)
    assert third.code == 0 and third.manifest["counts"]["reused"] == 4
    acc = _accuracy(d)
    assert acc["n"] == 4 and acc["all"] == 1.0, acc
    assert all(v["color"] is not None for v in acc["read"].values())


def test_an_interrupted_run_scores_the_items_it_got_to(compose, tmp_path):
    """SIGINT during item 2 of 4 (batch 1): items 1-2 finish, 3-4 are never attempted. The accuracy is over the two
    items it has (both read right), not over four with two never-attempted ones counted wrong (it recorded
    ``all 0.5 (n 4)``); the resume then scores all four."""
    import os
    import signal

    from runner.app.execute import run

    steps = {"n": 0}

    def on_loaded(engine):
        def hook(mod, args):
            steps["n"] += 1
            if steps["n"] == engine.cfg.generation.num_inference_steps + 1:  # item 2's first forward
                os.kill(os.getpid(), signal.SIGINT)

        engine.denoiser.register_forward_pre_hook(hook)

    d = tmp_path / "run"
    ov = ["platform=cpu", "model=toy_shapes", "dataset.limit=4", "batch_size=1"]
    assert run(compose(ov), d, ov, on_loaded=on_loaded) == 128 + signal.SIGINT
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "interrupted" and m["counts"]["ok"] == 2
    assert m["accuracy"]["n"] == 2 and m["accuracy"]["all"] == 1.0, m["accuracy"]
    assert run(compose(ov), d, ov) == 0
    assert _accuracy(d)["n"] == 4 and _accuracy(d)["all"] == 1.0
