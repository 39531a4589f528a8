"""docs/errors.md's table of bad input refused before any work: every row is produced here, and the
message adaptex gives is the one the page shows."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def _rows() -> list[str]:
    text = DOC.read_text().split("## Bad input refused before any work", 1)[1].split("\n## ", 1)[0]
    text = text.split("`examples/tsa_generate.py`", 1)[0]
    return [m[1] for m in re.finditer(r"^\| `\w+` \| `(.+?)` \| .+ \|$", text, re.M)]


def _catch(fn) -> str:
    from adaptex.graphs.errors import AdaptexError

    with pytest.raises(AdaptexError) as e:
        fn()
    return str(e.value)


def _export(tmp, shape):
    import adaptex
    from tests.support.user_models import patch_classifier

    B, N = shape
    return lambda: adaptex.export(patch_classifier(), (torch.randn(B, N, 12), torch.ones(B, N, dtype=torch.bool)),
                                  tmp / "m.onnx")


class _TwoAxes(torch.nn.Module):
    def forward(self, x):
        B, T = x.shape
        return x.sum(-1)


def _layer(x):
    import adaptex.nn as ann

    return lambda: ann.BudgetedAttention(16, 4, router_hidden=8).eval()(x)


def _npz(tmp, **arrays):
    from adaptex.cli._util import read_inputs

    path = tmp / "in.npz"
    np.savez(path, **arrays)
    specs = {n: {"dtype": "int64", "shape": ["batch", "sequence"]} for n in ("input_ids", "attention_mask")}
    return lambda: read_inputs(str(path), ["input_ids", "attention_mask"], specs=specs)


def _meta(**change):
    from adaptex.exporter.metadata import validate

    meta = {"format": 2, "family": "budgetformer", "target": "onnx", "variant": "sparse", "precision": "fp32",
            "inputs": {}, "outputs": {}, "source": {}, **change}
    return lambda: validate(meta, "m.onnx")


def _jsonl(tmp, train_rows, eval_rows, long=False):
    from adaptex.graphs.data.classification import JsonlClassification
    from adaptex.graphs.data.lines import PIECE

    t, e = tmp / "t.jsonl", tmp / "e.jsonl"
    t.write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    e.write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    if long:
        d = tmp / "d.jsonl"
        d.write_text(json.dumps({"text": "a" * (PIECE + 1), "label": 0}) + "\n")
        return lambda: JsonlClassification(d, e)
    return lambda: JsonlClassification(t, e)


def _checkpoint(tmp, link=False, tokenizer=None):
    from adaptex.graphs import checkpoint
    from tests.support import zoo

    zoo.save_tiny(tmp / "real")
    ck = tmp / "ck"
    ck.mkdir()
    (ck / "config.json").write_bytes((tmp / "real" / "config.json").read_bytes())
    if link:
        os.symlink(tmp / "real" / "model.safetensors", ck / "model.safetensors")
    else:
        (ck / "model.safetensors").write_bytes((tmp / "real" / "model.safetensors").read_bytes())
        cfg = json.loads((ck / "config.json").read_text())
        cfg["tokenizer"] = tokenizer
        (ck / "config.json").write_text(json.dumps(cfg))
    return lambda: checkpoint.load("ck")


def _config():
    from adaptex.graphs.budgetformer import BudgetFormerConfig
    from tests.support import zoo

    d = {**zoo.tiny_model().cfg.to_dict(), "max_len": 10**9}
    return lambda: BudgetFormerConfig.from_dict(d, "c/config.json")


def _train():
    from adaptex.graphs.recipes import TrainOptions, bound_training

    return lambda: bound_training("budgetformer", TrainOptions(batch_size=10**8))


def _memory():
    from adaptex.graphs import memory

    return lambda: memory.parse_size("lots")


TRIGGERS = {
    "patches: the example has batch 0": lambda tmp: _export(tmp, (0, 6)),
    "patches: the example has batch 1": lambda tmp: _export(tmp, (1, 6)),
    "BudgetedAttention: x holds NaN": lambda tmp: _layer(torch.full((2, 5, 16), float("nan"))),
    "BudgetedAttention: x has dtype torch.float64": lambda tmp: _layer(torch.randn(2, 5, 16, dtype=torch.float64)),
    "BudgetedAttention: x has dtype": lambda tmp: _layer(torch.ones(2, 5, 16, dtype=torch.int64)),
    "BudgetedAttention: x has shape": lambda tmp: _layer(torch.randn(2, 5, 8)),
    "the model's forward raised": lambda tmp: (lambda: __import__("adaptex").export(
        _TwoAxes(), (torch.ones(2, 5, 1),), tmp / "m.onnx")),
    "'input_id': not an input": lambda tmp: (lambda: __import__("adaptex.api", fromlist=["_feeds"])._feeds(
        [{"input_id": [[1]]}], ["input_ids", "attention_mask"])),
    "--inputs in.npz: input_ids has shape [2, 0]": lambda tmp: _npz(
        tmp, input_ids=np.zeros((2, 0), np.int64), attention_mask=np.zeros((2, 0), np.int64)),
    "--inputs in.npz: input_ids has shape [20, 3, 4]": lambda tmp: _npz(
        tmp, input_ids=np.zeros((20, 3, 4), np.int64), attention_mask=np.zeros((20, 3, 4), np.int64)),
    "--inputs in.npz: holds a pickled": lambda tmp: _npz(
        tmp, input_ids=np.array([[1, "a"]], dtype=object), attention_mask=np.ones((1, 2), np.int64)),
    "--max-memory 'lots'": lambda tmp: _memory(),
    "--batch-size 100000000": lambda tmp: _train(),
    "c/config.json: max_len": lambda tmp: _config(),
    "e.jsonl:1: token id": lambda tmp: _jsonl(tmp, [{"ids": [1, 2, 3], "label": i % 2} for i in range(40)],
                                              [{"ids": [1, 10**12], "label": 0}]),
    "d.jsonl:1: a line longer": lambda tmp: _jsonl(tmp, [], [{"text": "x", "label": 0}], long=True),
    "m.onnx: metadata 'precision'": lambda tmp: _meta(precision="fp8"),
    "m.onnx: metadata 'max_sequence'": lambda tmp: _meta(max_sequence=-5),
    "ck: model.safetensors is a link": lambda tmp: _checkpoint(tmp, link=True),
    "ck/config.json: tokenizer kind": lambda tmp: _checkpoint(tmp, tokenizer={"kind": "sentencepiece"}),
}


def test_every_row_has_a_trigger():
    rows = _rows()
    assert len(rows) == len(TRIGGERS) and len(rows) > 10
    for row in rows:
        assert any(row.startswith(key) for key in TRIGGERS), row


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[:40])
def test_the_message_is_the_documented_one(row, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    key = next(k for k in TRIGGERS if row.startswith(k))
    got = _catch(TRIGGERS[key](tmp_path))
    pattern = ".*".join(re.escape(part) for part in row.split("..."))
    assert re.fullmatch(pattern, got.replace(str(tmp_path) + "/", "")), (row, got)
    assert "\n" not in got
