"""The fp16 worst case: fp16 arithmetic throughout, the ranges an fp16 package reaches, and the audit
that refuses an fp16 package before it ships."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import adaptex
from adaptex.cli import main
from adaptex.exporter.errors import ExportError
from adaptex.runtimes import coreml_mil, fp16


def test_fp16_sums_overflow_where_fp32_accumulation_does_not():
    x = np.full((300,), 250.0, np.float16)  # the sum, 75000, is past fp16's 65504
    assert np.isinf(fp16.sum16(x, 0))
    assert coreml_mil._reduce(np.sum, x, [0], False) == np.float16(np.inf)  # fp32 sum, rounded: inf too
    # a LayerNorm over 256 channels of |x| ~ 100: its sum of squares passes 65504 in fp16, the variance
    # is inf and the normalised output collapses to 0; fp32 statistics normalise it
    h = (np.random.default_rng(0).normal(size=(2, 256)) * 100).astype(np.float16)
    coreml_mil._ACCUMULATE.append("fp16")
    try:
        worst = coreml_mil._ln(h, axes=[-1]).astype(np.float32)
    finally:
        coreml_mil._ACCUMULATE.pop()
    safe = coreml_mil._ln(h, axes=[-1]).astype(np.float32)
    assert np.abs(safe.std(-1) - 1).max() < 1e-2 and np.abs(worst - safe).max() > 0.5
    a = np.random.default_rng(1).normal(size=(4, 512)).astype(np.float16)
    b = np.random.default_rng(2).normal(size=(512, 3)).astype(np.float16)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(fp16.matmul16(a, b) - exact).max() > np.abs((a.astype(np.float32) @ b).astype(np.float16) - exact).max()
    assert fp16.matmul_bound(a, b) >= np.abs(exact).max()


class Loud(torch.nn.Module):
    """A model whose hidden activations reach ~1e5: fine in fp32, past fp16's range."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 32)
        self.attn = adaptex.nn.BudgetedAttention(32, 4, router_hidden=8)
        self.down = torch.nn.Linear(32, 2)
        with torch.no_grad():
            self.up.weight.mul_(3e4)

    def forward(self, x, mask):
        h = self.up(x)
        return self.down(self.attn(h * 1e-4, mask)) + h.mean(-1, keepdim=True)


def test_an_fp16_export_past_the_range_is_refused_with_the_layer(tmp_path):
    model = Loud().eval()
    example = (torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ExportError, match=r"--precision fp16 refused: .*past fp16's 65504.*--precision fp32"):
        adaptex.export(model, example, tmp_path / "loud.mlpackage", target="coreml", precision="fp16")
    assert not (tmp_path / "loud.mlpackage").exists() and list(tmp_path.iterdir()) == []
    meta = adaptex.export(model, example, tmp_path / "loud.mlpackage", target="coreml", precision="fp16",
                          fp16_audit=False)  # the user's call
    assert meta["precision"] == "fp16"


def test_a_default_fp16_export_that_fails_the_audit_is_written_in_fp32(tmp_path):
    """fp16 is a model of your own's default on Core ML: where its package fails the audit, export writes
    fp32 and says why, rather than refusing a precision the user did not ask for."""
    said = []
    meta = adaptex.export(Loud().eval(), (torch.randn(2, 6, 8), torch.ones(2, 6, dtype=torch.bool)),
                          tmp_path / "loud.mlpackage", target="coreml", say=said.append)
    assert meta["precision"] == "fp32" and (tmp_path / "loud.mlpackage").is_dir()
    assert list(tmp_path.iterdir()) == [tmp_path / "loud.mlpackage"]  # the refused fp16 package is gone
    assert any("failed the fp16 audit" in m and "past fp16's 65504" in m and "writing fp32" in m for m in said), said


def test_check_reports_fp16_ranges_and_the_worst_case(tiny_checkpoint, tiny_onnx, tmp_path, capsys):
    path = tmp_path / "m.mlpackage"
    assert main(["export", str(tiny_checkpoint), "--target", "coreml", "--precision", "fp16", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--samples", "12", "--fp16-accumulation", "fp16", "--ranges", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "fp16 accumulation" in r["runtime"] and r["fp16_over_limit"] == []
    ranges = r["fp16_ranges"]
    assert ranges and all(v["max_abs"] < 65504 for v in ranges.values())
    assert any(v["partial_sum_bound"] for v in ranges.values() if v["op"] in ("linear", "matmul"))
    assert main(["check", str(tiny_onnx["sparse"]), "--fp16-accumulation", "fp16"]) == 2
    assert "apply to Core ML packages" in capsys.readouterr().err


def test_normalisation_statistics_stay_fp32_in_fp16_packages(tiny_checkpoint, tmp_path):
    from coremltools.converters.mil.mil import types

    from adaptex.runtimes.coreml_mil import MilReferenceRunner

    path = tmp_path / "m.mlpackage"
    assert main(["export", str(tiny_checkpoint), "--target", "coreml", "--precision", "fp16", "-o", str(path)]) == 0
    ops = list(MilReferenceRunner(path).program.functions["main"].operations)
    norms = [op for op in ops if op.op_type == "layer_norm"]
    assert norms and {types.builtin_to_string(op.outputs[0].dtype) for op in norms} == {"fp32"}
    assert "fp16" in {types.builtin_to_string(op.outputs[0].dtype) for op in ops if op.op_type == "linear"}
