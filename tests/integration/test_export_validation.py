"""Export checks what it wrote: the artifact runs against the eager model on the example inputs and on
variations derived from them (batch, lengths, padded tails of every input that reaches an adaptex
layer's key mask) before it takes its name; a mismatch fails the export with the report and keeps the
artifact as NAME.failed.SUFFIX. The divergence is planted by swapping a Core ML lowering for one that
ignores the key mask: right on the (unpadded) example, wrong on padded rows; for OpenVINO IR (two
files), by shifting a bias."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

import adaptex
import adaptex.nn as ann
from adaptex.cli import main
from adaptex.exporter import registry
from adaptex.exporter.targets.coreml import mil_ops
from adaptex.runtimes.validation import derived_inputs, failed_name

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.attn = ann.BudgetedAttention(16, num_heads=4, router_hidden=8)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, features, mask):
        x = self.embed(features)
        m = mask.to(x.dtype)[..., None]
        return self.head(((x + self.attn(x, mask)) * m).sum(1) / m.sum(1))


def classifier():
    """The model and an unpadded example (batch 2, length 8): what `adaptex export MODULE:FUNCTION` takes."""
    torch.manual_seed(0)
    model = Classifier().eval()
    with torch.no_grad():
        model.attn.qkv.weight.mul_(4)  # attention sharp enough that a padded key shows in the output
    return model, (torch.randn(2, 8, 6), torch.ones(2, 8, dtype=torch.bool))


def _mask_ignored(ctx, node):
    """A wrong Core ML lowering: budgeted attention with every key taken as real."""
    right = partial(mil_ops.budgeted_attention_mil, variant="sparse")

    def emit(context, node):
        from coremltools.converters.mil import Builder as mb

        mask = context[node.inputs[1]]
        context.add(mb.fill_like(ref_tensor=mask, value=1.0), torch_name=node.inputs[1], override=True)
        right(context, node)
        context.add(mask, torch_name=node.inputs[1], override=True)
    return emit


PLANTED = registry.Lowering("adaptex::budgeted_attention", "coreml", "sparse", _mask_ignored)


def test_derived_inputs_vary_batch_and_length_and_pad_the_mask(tmp_path):
    """On a TensorRT-bound ONNX, which validation runs in ONNX Runtime."""
    model, example = classifier()
    said = []
    meta = adaptex.export(model, example, tmp_path / "m.trt.onnx", target="tensorrt", onnx_only=True, say=said.append)
    assert any(s.startswith("validated:") for s in said), said
    assert meta["inputs"]["mask"].get("mask") is True and "mask" not in meta["inputs"]["features"]
    feeds = derived_inputs(meta, example)
    shapes = {f["features"].shape[:2] for f in feeds}
    assert {(2, 8), (1, 8), (3, 8), (2, 1), (2, 4), (2, 16)} <= shapes
    padded = [f for f in feeds if not f["mask"].all()]
    assert padded and all(f["mask"][:, 0].all() and f["mask"][0].all() for f in padded)  # row 0 whole, 1 real token
    assert all(f["mask"].dtype == np.bool_ for f in feeds)


def test_a_wrong_coreml_package_fails_export_with_the_report(tmp_path, capsys):
    """By default; the package already at the name stays; --no-validate writes the wrong one."""
    out = tmp_path / "m.mlpackage"
    spec = f"{__name__}:classifier"
    assert main(["export", spec, "--target", "coreml", "--precision", "fp32", "-o", str(out)]) == 0  # right
    program = next(out.rglob("model.mlmodel"))
    before = program.read_bytes()
    capsys.readouterr()
    with registry.override(PLANTED):
        rc = main(["export", spec, "--target", "coreml", "--precision", "fp32", "-o", str(out)])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    assert "parity:" in captured.out and "FAIL" in captured.out and "FAILED" in captured.out
    assert "does not compute what the eager model does" in captured.err and "--no-validate" in captured.err
    assert failed_name(out).is_dir()  # kept, under a name no app loads by mistake
    assert program.read_bytes() == before  # the right package stays at the name; the wrong one's program differs
    assert next(failed_name(out).rglob("model.mlmodel")).read_bytes() != before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    padded = (np.random.default_rng(0).normal(size=(2, 8, 6)).astype(np.float32),
              np.array([[1] * 8, [1] * 3 + [0] * 5], bool))
    assert not adaptex.check(failed_name(out), classifier()[0], inputs=[padded]).passed  # kept: the wrong one
    with registry.override(PLANTED):  # --no-validate writes it, unchecked
        assert main(["export", spec, "--target", "coreml", "--precision", "fp32", "-o", str(out), "--no-validate"]) == 0
    assert next(out.rglob("model.mlmodel")).read_bytes() != before


def test_an_openvino_ir_that_computes_otherwise_is_kept_as_failed_with_its_weights(tmp_path, monkeypatch):
    """An IR is two files: validated together, kept as NAME.failed.xml with NAME.failed.bin on a
    mismatch, and an IR already at the name (both files) stays as it was."""
    from onnx import numpy_helper

    from adaptex.exporter.targets import openvino as ov_target
    from adaptex.runtimes.validation import ValidationFailed

    model, example = classifier()
    out = tmp_path / "m.xml"
    adaptex.export(model, example, out, target="openvino")  # validated in OpenVINO, then named
    before = out.read_bytes(), out.with_suffix(".bin").read_bytes()
    right = ov_target.inlined_onnx

    def shifted(*args, **kwargs):  # the classifier's head bias off by 1: wrong on every input
        proto, meta = right(*args, **kwargs)
        bias = next(i for i in proto.graph.initializer if i.name.endswith("head.bias"))
        bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + 1, bias.name))
        return proto, meta

    monkeypatch.setattr(ov_target, "inlined_onnx", shifted)
    with pytest.raises(ValidationFailed) as e:
        adaptex.export(model, example, out, target="openvino")
    assert (out.read_bytes(), out.with_suffix(".bin").read_bytes()) == before
    failed = failed_name(out)
    assert e.value.failed_path == failed and failed.with_suffix(".bin").is_file()
    assert not adaptex.check(failed, model, inputs=[example]).passed  # it loads: its weights came along
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin", "m.failed.bin", "m.failed.xml", "m.xml"]


def test_an_ir_is_never_written_over_weights_adaptex_did_not_write(tmp_path):
    model, example = classifier()
    (tmp_path / "m.bin").write_bytes(b"someone's weights")
    from adaptex.graphs.errors import AdaptexError

    with pytest.raises(AdaptexError, match="m.bin"):
        adaptex.export(model, example, tmp_path / "m.xml", target="openvino")
    assert (tmp_path / "m.bin").read_bytes() == b"someone's weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]
