"""Ordinary PyTorch and Hugging Face layers around adaptex ones (tests/support/user_zoo.py), on every
target: ONNX, Core ML fp32 and fp16 (the MIL evaluator), TensorRT-bound ONNX. Each passes `check` on
padded rows, batches 1 to 3 and lengths 1 to the maximum; half-precision weights are refused,
naming the layer and the reason."""
from __future__ import annotations

import onnx
import pytest
import torch

import adaptex
from adaptex.exporter.errors import UnsupportedLowering
from adaptex.exporter.targets.tensorrt import rules
from tests.support import user_zoo

TARGETS = {"onnx": ("onnx", {}, ".onnx"), "coreml-fp32": ("coreml", {"precision": "fp32"}, ".mlpackage"),
           "coreml-fp16": ("coreml", {"precision": "fp16", "fp16_audit": False}, ".fp16.mlpackage"),
           "tensorrt-onnx": ("tensorrt", {"onnx_only": True}, ".trt.onnx")}
# four exports and checks each (about 40 s of one core a model): the mask sweep runs in `make test`,
# the others in `make test-slow`
SLOW = {"issue-classifier", "conv-encoder", "seq2seq", "patch-vit", "bert", "gpt2"}


def _cases() -> list:
    return [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [], id=name) for name in user_zoo.ZOO]


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.mark.parametrize("name", _cases())
def test_a_user_model_exports_and_checks_on_every_target(name, zoo_root):
    """One model, its four artifacts (one export each), each checked on the padded, varied inputs."""
    model, example, inputs, options = user_zoo.build(name, zoo_root)
    results = {}
    for target_id, (target, target_options, suffix) in TARGETS.items():
        path = zoo_root / f"{name}{suffix}"
        adaptex.export(model, example, path, target=target, validate=False, **target_options, **options)
        report = adaptex.check(path, model, inputs=inputs)
        results[target_id] = report
        assert report.passed, f"{name} on {target_id}:\n{report.format()}"
        assert report.unexcused_flips == 0
        if target == "tensorrt":
            assert rules.lint(onnx.load(str(path))) == []
    fp32 = results["coreml-fp32"]
    assert fp32.max_abs_err <= 1e-4, fp32.format()  # fp32 Core ML is as close as ONNX, not within fp16's slack
    lengths = {a.shape[-1] for item in inputs for a in item if a.ndim == 2 and a.dtype.kind in "bi"}
    if lengths:
        assert {1, user_zoo.MAX_LEN} <= lengths  # lengths 1 and the maximum are among the checked inputs


def test_the_mask_sweep_names_every_mask_kind(zoo_root):
    model, example, inputs, _ = user_zoo.build("mask-sweep", zoo_root)
    meta = adaptex.export(model, example, zoo_root / "sweep-names.onnx")
    for name in ("sdpa_bool", "sdpa_float_inf", "sdpa_additive", "sdpa_causal", "sdpa_causal_padded",
                 "masked_fill_softmax", "mha_key_padding", "mha_float_masks", "mha_sequence_first", "factories",
                 "mean_pool", "max_pool_fill", "max_pool_where", "zero_fill"):
        assert name in meta["outputs"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("target", ["onnx", "coreml", "tensorrt"])
def test_half_precision_weights_are_refused_naming_the_layer(zoo_root, tmp_path, dtype, target):
    model, example, _, _ = user_zoo.build("conv-encoder", zoo_root)
    model = model.to(dtype)
    example = (example[0].to(dtype), example[1])
    path = tmp_path / ("m.mlpackage" if target == "coreml" else "m.onnx")
    with pytest.raises(UnsupportedLowering) as e:
        adaptex.export(model, example, path, target=target, **({"onnx_only": True} if target == "tensorrt" else {}))
    msg = str(e.value)
    assert "Conv1d 'stem'" in msg and "stem.weight" in msg and str(dtype).replace("torch.", "") in msg
    assert "model.float()" in msg and "precision='fp16'" in msg and "\n" not in msg
    assert not path.exists()
