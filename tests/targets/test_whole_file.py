"""The file as users run it: an artifact with programs, loaded as one plain ONNX Runtime session of
the whole file (its top-level Ifs choosing the graph), passes parity against the eager model on
calls either side of each point where a program switches. The points are read from the artifact's
metadata (the shapes at which its dispatch conditions change), never chosen by hand, so a switch
moved in the file or the metadata is checked where it now is; each pair of calls is shown to take
different programs."""
from __future__ import annotations

import numpy as np
import pytest

from adaptex.exporter.metadata import read_onnx_metadata
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
from adaptex.runtimes.parity import check
from adaptex.runtimes.torch_ref import TorchRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _call(vocab: int, batch: int, length: int, prefill: int, seed: int = 0) -> dict:
    """One parity item: a prefill of `prefill` tokens, then a decode step per further token."""
    ids = np.random.default_rng(seed).integers(3, vocab, size=(batch, length)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "prefill": prefill}


def _leaves(guard: dict) -> list[dict]:
    """The comparisons of a stored guard."""
    parts = guard.get("all") or guard.get("any")
    return [leaf for g in parts for leaf in _leaves(g)] if parts else [guard]


def switch_points(meta: dict, max_len: int) -> list[tuple[str, dict, dict]]:
    """(what switches, the call just inside, the call just past) for each bound the stored guards
    state on a prefill's key count or a call's token rows: (batch, length, prefill) of each call."""
    points = []
    for program in meta.get("programs") or []:
        leaves = _leaves(program["guard"]) if program["guard"] else []
        step = any(c["op"] == "==" and c["axes"] == [["input_ids", 1]] for c in leaves)
        for c in (c for c in leaves if c["op"] == "<="):
            n, what = c["value"], f"{program['name']}: {c['axes']} <= {c['value']}"
            if c["axes"] == [["attention_mask", 1]] and n + 1 <= max_len:  # a prefill's key count
                points.append((what, dict(batch=1, length=n, prefill=n), dict(batch=1, length=n + 1, prefill=n + 1)))
            elif c["axes"] == [["input_ids", 0], ["input_ids", 1]] and step:  # a decode step's rows
                points.append((f"{what} (step)", dict(batch=n, length=3, prefill=2), dict(batch=n + 1, length=3, prefill=2)))
            elif c["axes"] == [["input_ids", 0], ["input_ids", 1]]:  # a prompt's rows
                points.append((f"{what} (prompt)", dict(batch=2, length=n // 2, prefill=n // 2),
                               dict(batch=2, length=n // 2 + 1, prefill=n // 2 + 1)))
    return points


def _taken(path, item: dict) -> str:
    """The program the runner takes for the item's last call (a decode step where it has one)."""
    runner = OnnxRuntimeRunner(path, threads=1, chunk_rows=None).activate()
    ids = item["input_ids"]
    T, P = ids.shape[1], item["prefill"]
    feeds = {n: a for n, a in _feeds(runner, ids.shape[0], 1 if T > P else P, T - 1 if T > P else 0).items()}
    return runner.programs.chosen(feeds)


def _feeds(runner, batch: int, new: int, past: int) -> dict:
    """Zero feeds of the artifact's inputs for a call of `new` tokens after `past` cached ones."""
    out = {}
    for name, spec in runner.input_metadata().items():
        if name == "input_ids":
            out[name] = np.zeros((batch, new), np.int64)
        elif name == "attention_mask":
            out[name] = np.ones((batch, new + past), np.int64)
        elif name.startswith("past"):
            out[name] = np.zeros((batch, spec.shape[1], past, spec.shape[3]), np.float32)
        elif name.startswith("head_modes."):
            out[name] = np.zeros((batch, spec.shape[1]), bool)
    return out


@pytest.mark.parametrize("family, options", [("eldec", {}), ("tsa", {"dense_rows": "8"})],
                         ids=["elastic decoder", "tsa --dense-rows 8"])
def test_the_whole_file_in_one_session_passes_parity_either_side_of_each_switch(artifacts, family, options):
    path = artifacts(family, **options)
    model = artifacts.model(family)
    meta = read_onnx_metadata(path)
    points = switch_points(meta, model.cfg.max_len)
    assert points, f"{path.name}: no dispatch threshold in its metadata"
    whole, eager = OnnxRuntimeRunner(path, threads=1, programs=False), TorchRunner(model)
    assert whole.programs is None and whole.name == "onnxruntime (one session)"
    for what, inside, past in points:
        items = [_call(model.cfg.vocab_size, **inside), _call(model.cfg.vocab_size, **past, seed=1)]
        assert _taken(path, items[0]) != _taken(path, items[1]), f"{what}: both calls take one program"
        report = check(whole, eager, inputs=items)
        assert report.passed, f"{what}:\n{report.format()}"
