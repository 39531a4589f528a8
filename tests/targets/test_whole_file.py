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


def switch_points(meta: dict, max_len: int) -> list[tuple[str, dict, dict]]:
    """(what switches, the call just inside, the call just past) for each dispatch threshold the
    metadata states: (batch, length, prefill) of each call."""
    points = []
    short = meta.get("short_call") or {}
    for key in ("max_keys", "masked_keys"):  # a prefill's key count
        n = short.get(key)
        if n and n + 1 <= max_len:
            points.append((f"short_call.{key} = {n}", dict(batch=1, length=n, prefill=n),
                           dict(batch=1, length=n + 1, prefill=n + 1)))
    step = meta.get("decode_step") or {}
    n, cells, capped = step.get("near_keys"), step.get("near_cells") or 0, step.get("near_keys_cells")
    if n and n + 1 <= max_len:  # a decode step's key count (the cache and the new token), at a batch
        b = cells // (n + 1) + 1  # past the batch x keys cells that take the near program at any key count
        if not capped or b * n <= capped:
            points.append((f"decode_step.near_keys = {n} (batch {b})", dict(batch=b, length=n, prefill=n - 1),
                           dict(batch=b, length=n + 1, prefill=n)))
    if cells and cells + 1 <= max_len:
        points.append((f"decode_step.near_cells = {cells}", dict(batch=1, length=cells, prefill=cells - 1),
                       dict(batch=1, length=cells + 1, prefill=cells)))
    dense = meta.get("dispatch") or {}
    rows = dense.get("dense_rows")
    if rows:  # a call's token rows (batch x new tokens), at the prompt and at a decode step
        points.append((f"dispatch.dense_rows = {rows} (prompt)", dict(batch=2, length=rows // 2, prefill=rows // 2),
                       dict(batch=2, length=rows // 2 + 1, prefill=rows // 2 + 1)))
        if dense.get("step_graph"):
            points.append((f"dispatch.dense_rows = {rows} (step)", dict(batch=rows, length=3, prefill=2),
                           dict(batch=rows + 1, length=3, prefill=2)))
    return points


def _taken(path, item: dict) -> tuple:
    """The program the runner takes for the item's last call (a decode step where it has one)."""
    runner = OnnxRuntimeRunner(path, threads=1, chunk_rows=None).activate()
    ids = item["input_ids"]
    T, P = ids.shape[1], item["prefill"]
    feeds = {n: a for n, a in _feeds(runner, ids.shape[0], 1 if T > P else P, T - 1 if T > P else 0).items()}
    return runner.programs.taken(feeds)


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
