"""How an upstream stage's text feeds the next stage (runner/app/stages.py: link_records, feed), on real dataset
rows and items, for the mutation run (benchmarks/mutation.py, group ``stages``)."""

from __future__ import annotations

import hashlib
import json

from runner.app.stages import feed, link_records
from runner.core.dataset import Item, Row


def _row(rid: str, prompt: str, n: int = 1) -> Row:
    return Row(id=rid, prompt=prompt, negative_prompt=None, seed=None, width=64, height=64, num_inference_steps=2,
               guidance_scale=None, num_images_per_prompt=n, line=1)


def _rec(rid: str, text: str, index: int = 0, ids=(1, 2)) -> dict:
    return {"id": rid, "index": index, "text": text, "prompt": f"expand {rid}", "output_token_ids": list(ids)}


def test_link_records_keeps_the_first_output_of_each_row():
    recs = [_rec("a", "A1"), _rec("a", "A2", index=1), _rec("b", "B"),
            {k: v for k, v in _rec("c", "C").items() if k != "index"}]
    links = link_records("expand", recs)
    assert list(links) == ["a", "b", "c"]
    assert links["a"] == {"stage": "expand", "file": "expand.jsonl", "id": "a",
                          "output_sha256": hashlib.sha256(json.dumps([1, 2]).encode()).hexdigest(),
                          "text": "A1", "upstream_prompt": "expand a"}
    assert links["c"]["text"] == "C"
    assert link_records("s", [_rec("a", "x", index=1)]) == {}


def test_feed_rebuilds_the_prompts_of_linked_rows_and_records_them():
    a, b = _row("a", "a cat"), _row("b", "a dog", n=2)
    items = [Item(a, 0, 1), Item(b, 0, 2), Item(b, 1, 3)]
    links = {"b": {"text": "  in the snow  "}}
    out = feed(items, links, "{prompt}, {text}")
    assert [it.row.prompt for it in out] == ["a cat", "a dog,   in the snow", "a dog,   in the snow"]
    assert [(it.index, it.seed) for it in out] == [(0, 1), (0, 2), (1, 3)]
    assert out[0] == items[0]
    assert out[1].row is out[2].row, "one rebuilt row per row id"
    assert links == {"b": {"text": "  in the snow  ", "downstream_prompt": "a dog,   in the snow"}}
    assert items[1].row.prompt == "a dog", "the items given are not changed"
    out = feed([Item(a, 0, 1)], {"a": {"text": "x"}}, "  {text} ({prompt})  ")
    assert out[0].row.prompt == "x (a cat)"
