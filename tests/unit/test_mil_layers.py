"""The MIL evaluator on ordinary PyTorch layers (runtimes/coreml_mil_layers.py): each layer converted by
coremltools as a user's model is, its saved program evaluated op by op and compared with PyTorch;
the numpy evaluators against coremltools' own value inference where it has one; the fallback to that
inference; and an op nothing can evaluate, listed in the check report."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes import coreml_mil, coreml_mil_layers
from tests.unit.test_mil_eval import _program

ct = pytest.importorskip("coremltools")
from coremltools.converters.mil import Builder as mb  # noqa: E402

X2 = torch.randn(2, 4, 9, 11, generator=torch.Generator().manual_seed(0))
X1 = torch.randn(2, 4, 13, generator=torch.Generator().manual_seed(1))

# name: (module, input, MIL ops its program must contain)
LAYERS = {
    "conv2d": (nn.Conv2d(4, 6, 3, stride=2, padding=1), X2, {"conv"}),
    "conv2d-grouped-dilated": (nn.Conv2d(4, 8, (3, 2), stride=(1, 2), padding=(2, 0), dilation=(2, 1), groups=2), X2,
                               {"conv"}),
    "conv2d-same-depthwise": (nn.Conv2d(4, 4, 3, padding="same", groups=4), X2, {"conv"}),
    "conv1d": (nn.Conv1d(4, 6, 5, stride=2, padding=2), X1, {"conv"}),
    "conv-transpose2d": (nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), X2, {"conv_transpose"}),
    "conv-transpose2d-grouped": (nn.ConvTranspose2d(4, 4, (2, 3), stride=(2, 1), groups=2, dilation=(1, 2)), X2,
                                 {"conv_transpose"}),
    "conv-transpose1d": (nn.ConvTranspose1d(4, 3, 4, stride=2, padding=1), X1, {"conv_transpose"}),
    "max-pool": (nn.MaxPool2d(3, stride=2, padding=1), X2, {"max_pool"}),
    "max-pool-ceil": (nn.MaxPool2d(2, stride=2, ceil_mode=True), X2, {"max_pool"}),
    "max-pool1d": (nn.MaxPool1d(3, 2), X1, {"max_pool"}),
    "avg-pool": (nn.AvgPool2d(3, stride=2, padding=1), X2, {"avg_pool"}),
    "avg-pool-exclusive-ceil": (nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False, ceil_mode=True), X2,
                                {"avg_pool"}),
    "batch-norm": (nn.BatchNorm2d(4), X2, {"batch_norm"}),
    "instance-norm": (nn.InstanceNorm2d(4, affine=True), X2, {"instance_norm"}),
    "group-norm": (nn.GroupNorm(2, 4), X2, set()),
    "local-response-norm": (nn.LocalResponseNorm(3), X2, {"avg_pool", "pad"}),
    "upsample-nearest": (nn.Upsample(scale_factor=2, mode="nearest"), X2, {"upsample_nearest_neighbor"}),
    "upsample-bilinear": (nn.Upsample(scale_factor=2, mode="bilinear"), X2, {"upsample_bilinear"}),
    "upsample-bilinear-corners": (nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), X2,
                                  {"upsample_bilinear"}),
    "pixel-shuffle": (nn.Sequential(nn.Conv2d(4, 16, 1), nn.PixelShuffle(2)), X2, {"pixel_shuffle"}),
    "activations": (nn.Sequential(nn.ELU(), nn.ReLU6(), nn.Hardsigmoid(), nn.Hardswish(), nn.Softsign(), nn.PReLU(4),
                                  nn.Mish(), nn.SELU(), nn.Hardtanh(), nn.Softplus(beta=2), nn.Tanhshrink()), X2,
                    {"elu", "sigmoid_hard", "softplus_parametric", "thresholded_relu"}),
}


def _converted(module: nn.Module, x: torch.Tensor, tmp_path, precision):
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    torch.manual_seed(0)
    module = module.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, (x,)).run_decompositions({})
        ml = ct.convert(ep, convert_to="mlprogram", compute_precision=precision,
                        minimum_deployment_target=ct.target.iOS17)
    ml.save(str(tmp_path / "m.mlpackage"))
    return coreml_mil.load_program(tmp_path / "m.mlpackage")[1]


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_converted_layer_evaluates_as_pytorch_computes_it(name, tmp_path):
    module, x, wanted = LAYERS[name]
    prog = _converted(module, x, tmp_path, ct.precision.FLOAT32)
    seen: set[str] = set()
    out = coreml_mil.run(prog, {next(iter(prog.functions["main"].inputs)): x.numpy()},
                         on_op=lambda op, _: seen.add(op.op_type))
    got = next(iter(out.values()))
    with torch.no_grad():
        want = module(x).numpy()
    assert wanted <= seen, (name, sorted(seen))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["conv2d", "avg-pool", "upsample-bilinear"])
def test_an_fp16_program_of_a_layer_stays_within_fp16_tolerance(name, tmp_path):
    module, x, _ = LAYERS[name]
    prog = _converted(module, x, tmp_path, ct.precision.FLOAT16)
    for accumulate in ("fp32", "fp16"):
        got = next(iter(coreml_mil.run(prog, {next(iter(prog.functions["main"].inputs)): x.numpy()},
                                       accumulate=accumulate).values()))
        with torch.no_grad():
            np.testing.assert_allclose(got.astype(np.float32), module(x).numpy(), atol=1e-2, rtol=1e-2)


A = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)
# numpy evaluators of ops coremltools also infers: the two must agree
INFERRED = {
    "relu6": dict(x=A * 5), "elu": dict(x=A, alpha=np.float32(0.7)), "sigmoid_hard": dict(x=A, alpha=np.float32(0.3),
                                                                                          beta=np.float32(0.4)),
    "softsign": dict(x=A), "prelu": dict(x=A[None], alpha=np.array([0.1, 0.2], np.float32)),
    "reduce_argmin": dict(x=A, axis=1, keep_dims=True), "reduce_log_sum_exp": dict(x=A, axes=[-1]),
}


@pytest.mark.parametrize("op", list(INFERRED))
def test_a_numpy_evaluator_matches_coremltools_value_inference(op):
    prog, outs, feeds = _program(op, INFERRED[op])
    assert outs[0].val is not None
    got = coreml_mil.run(prog, feeds)[outs[0].name]
    np.testing.assert_allclose(got, outs[0].val, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op, inputs, want", [
    ("pad", dict(x=A, pad=np.array([0, 0, 1, 2, 0, 1], np.int32), mode="reflect"),
     lambda x, **_: np.pad(x, [(0, 0), (1, 2), (0, 1)], mode="reflect")),
    ("clamped_relu", dict(x=A, alpha=np.float32(0.1), beta=np.float32(0.5)),
     lambda x, **_: np.minimum(np.where(x >= 0, x, 0.1 * x), 0.5)),
    ("topk", dict(x=A, k=2, axis=-1), lambda x, **_: -np.sort(-x, -1)[..., :2]),
])
def test_an_op_without_a_numpy_evaluator_falls_back_to_coremltools(op, inputs, want):
    """The first input fed at run time: coremltools' inference runs during the evaluation, not at build."""
    prog, _, feeds = _program(op, inputs, runtime=next(iter(inputs)))
    assert op not in coreml_mil.EVAL and op not in coreml_mil_layers.EVAL
    got = next(iter(coreml_mil.run(prog, feeds).values()))
    np.testing.assert_allclose(got, want(**inputs), rtol=1e-6, atol=1e-6)


def _lstm_program():
    H = 3

    @mb.program(input_specs=[mb.TensorSpec(shape=(5, 2, 4))])
    def prog(x):
        out = mb.lstm(x=x, initial_h=np.zeros((2, H), np.float32), initial_c=np.zeros((2, H), np.float32),
                      weight_ih=np.ones((4 * H, 4), np.float32), weight_hh=np.ones((4 * H, H), np.float32))
        return out[0]
    return prog


def test_an_op_nothing_evaluates_is_named_not_crashed_on():
    prog = _lstm_program()
    assert coreml_mil.unevaluable(prog) == ["lstm (1 op)"]
    with pytest.raises(AdaptexError, match="op 'lstm' .* no numpy evaluator, and coremltools infers no value"):
        coreml_mil.run(prog, {"x": np.zeros((5, 2, 4), np.float32)})


def test_the_check_report_lists_what_it_cannot_evaluate(tmp_path):
    """A package holding an op that nothing evaluates: the report says which, and fails (nothing checked)."""
    import adaptex
    from adaptex.runtimes import parity
    from adaptex.runtimes.torch_ref import TorchRunner
    from adaptex.runtimes.source import contract_of
    from tests.unit.test_user_io import Tiny

    model = Tiny().eval()
    example = (torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.bool))
    adaptex.export(model, example, tmp_path / "t.mlpackage", target="coreml", precision="fp32")
    runner = coreml_mil.MilReferenceRunner(tmp_path / "t.mlpackage")
    runner.program = _lstm_program()  # as if the package held an LSTM
    reference = TorchRunner(model, contract=contract_of(runner.meta, model, example))
    report = parity.check(runner, reference, inputs=[example], precision="fp32", artifact_name="t.mlpackage")
    assert not report.passed and report.samples == 0
    assert any("no evaluator for lstm (1 op)" in f and "macOS" in f for f in report.failures)
    assert "no evaluator for lstm" in report.format()
