"""The softmax floor's default is what runs faster on the CPU at hand: adaptex.export times a causal
Softmax plain and floored (runtimes/cpu.py, floor_probe) when --softmax-floor is not given, and the
metadata, which `adaptex inspect` prints, says which was chosen and why."""
from __future__ import annotations

import adaptex
from adaptex.exporter.metadata import format_metadata, read_onnx_metadata
from adaptex.graphs import checkpoint


def test_the_floor_is_measured_at_export_unless_given(family_checkpoints, tmp_path):
    model, info = checkpoint.load(family_checkpoints / "bf")
    meta = adaptex.export(model, None, tmp_path / "auto.onnx")
    assert isinstance(meta["softmax_floor"], bool)
    assert meta["softmax_floor_why"].startswith("measured at export on ") and "ms floored" in meta["softmax_floor_why"]
    shown = format_metadata(read_onnx_metadata(tmp_path / "auto.onnx"))
    assert f"softmax_floor: {'on' if meta['softmax_floor'] else 'off'} (measured at export on " in shown
    given = adaptex.export(model, None, tmp_path / "off.onnx", softmax_floor="off")
    assert given["softmax_floor"] is False and given["softmax_floor_why"] == "--softmax-floor off given"
