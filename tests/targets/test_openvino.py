"""The OpenVINO target and runtime: the If-output copy that keeps a file right in OpenVINO's CPU
plugin (its cause, docs/openvino.md#the-if-output-buffer), export to IR and parity in OpenVINO for
every family and variant, the ONNX Runtime artifacts run in OpenVINO, a user's model, bf16 with its
routing kept in f32, and the refusals. OpenVINO is a pip package (make test installs it): nothing here skips."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import adaptex
from adaptex.cli import main
from adaptex.exporter.targets.onnx.portable import if_outputs_copied
from adaptex.exporter.targets.openvino import read_meta
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
from adaptex.runtimes.openvino import OpenVINORunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# calls that grow: each larger than every call before it but the last two (OpenVINO's If-output bug
# shows on the first call larger than all before)
GROWING = [(1, 8), (1, 32), (2, 20), (1, 60), (3, 40), (1, 8)]


def _if_residual_ffn(d: int = 16) -> onnx.ModelProto:
    """The smallest graph that shows the cause: an If whose output a residual Add reads, the sum
    read by two MatMuls and again by the Add after them (a Transformer block's shape)."""
    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n)
         for n, s in (("w1", (d, 4 * d)), ("w2", (4 * d, d)))]

    def branch(name, op):
        return helper.make_graph([helper.make_node(op, ["x", "x"], [f"{name}_y"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, None)])

    nodes = [helper.make_node("If", ["c"], ["i"], then_branch=branch("t", "Add"), else_branch=branch("e", "Mul")),
             helper.make_node("Add", ["r", "i"], ["h"]), helper.make_node("MatMul", ["h", "w1"], ["m1"]),
             helper.make_node("MatMul", ["m1", "w2"], ["m2"]), helper.make_node("Add", ["h", "m2"], ["y"])]
    inputs = [helper.make_tensor_value_info("c", TensorProto.BOOL, [])] + [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "sequence", d]) for n in ("x", "r")]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], w)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m.ir_version = 10
    return m


def _openvino_errors(proto: onnx.ModelProto) -> list[float]:
    """Max |OpenVINO - numpy| of the graph above on GROWING calls, in one compiled model."""
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(proto.SerializeToString(), b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})
    request, rng = compiled.create_infer_request(), np.random.default_rng(1)
    w1, w2 = (numpy_helper.to_array(t) for t in proto.graph.initializer)
    errors = []
    for B, T in GROWING:
        x, r = (rng.standard_normal((B, T, w2.shape[1])).astype(np.float32) for _ in range(2))
        h = r + x * x  # the else branch
        want = h + (h @ w1) @ w2
        got = request.infer({"c": np.array(False), "x": x, "r": r})[compiled.output(0)]
        errors.append(float(np.nan_to_num(np.abs(got - want), nan=np.inf).max()))
    return errors


def test_an_if_output_read_through_a_copy_stays_right_in_openvino():
    """The cause: without the copy, OpenVINO 2026.4.1 reads memory of the previous call's size on
    the first larger call (garbage, NaN); with portable.if_outputs_copied every call is right."""
    proto = _if_residual_ffn()
    assert if_outputs_copied(proto) == 1
    assert any(n.op_type == "Expand" for n in proto.graph.node)
    assert max(_openvino_errors(proto)) < 1e-4


def test_the_copy_leaves_a_graph_output_alone():
    """An If output that only leaves the graph (a program at an artifact's top) keeps its name."""
    proto = _if_residual_ffn()
    proto.graph.output[0].name = "i"
    del proto.graph.node[1:]
    assert if_outputs_copied(proto) == 0 and proto.graph.node[0].output[0] == "i"


def _agree(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        if a[name].dtype.kind in "biu":
            assert np.array_equal(a[name], b[name]), name
        else:
            np.testing.assert_allclose(a[name], b[name], atol=1e-4, rtol=1e-3, err_msg=name)


@pytest.mark.parametrize("family", ["bf", pytest.param("el", marks=pytest.mark.slow)])
def test_an_onnxruntime_artifact_computes_the_same_in_openvino_on_growing_calls(artifacts, family):
    """The ONNX Runtime file (its If-chosen bodies, passes and contrib ops), inlined by the runner,
    computes what ONNX Runtime does on calls that grow; BudgetFormer's file read garbage at the
    first larger call before its If outputs were copied."""
    path = artifacts(family)
    ov_runner, ort_runner = OpenVINORunner(path, threads=1), OnnxRuntimeRunner(path, threads=1)
    rng = np.random.default_rng(0)
    vocab = ov_runner.meta["config"]["vocab_size"]
    for B, T in GROWING:
        feeds = {"input_ids": rng.integers(3, vocab, (B, T)).astype(np.int64),
                 "attention_mask": np.ones((B, T), np.int64)}
        _agree(ov_runner.infer(feeds), ort_runner.infer(feeds))


@pytest.mark.parametrize("variant", ["sparse", pytest.param("dense", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["bf"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("tsa", "el", "eldec")])
def test_openvino_ir_of_every_family_passes_parity(artifacts, family, variant):
    path = artifacts(family, "openvino", variant)
    assert path.with_suffix(".bin").is_file()
    report = adaptex.check(path, samples=4, threads=1)
    assert report.passed, report.format()
    assert "on openvino" in report.format()


@pytest.mark.slow
def test_an_onnxruntime_decoder_artifact_passes_parity_in_openvino_or_is_refused_at_load(artifacts):
    """The elastic decoder's file runs right; the TSA file's dispatch If (branch outputs of unknown
    rank) is refused by OpenVINO's CPU plugin when it compiles: a one-line error, never a wrong answer."""
    report = adaptex.check(artifacts("eldec"), samples=4, threads=1, runtime="openvino")
    assert report.passed, report.format()
    from adaptex.graphs.errors import AdaptexError

    with pytest.raises(AdaptexError, match="OpenVINO cannot load it .*If operation with dynamic rank"):
        adaptex.check(artifacts("tsa"), samples=4, threads=1, runtime="openvino")


@pytest.mark.parametrize("name", ["budgetformer-graded", "tsa-charlm", "elastic-minilm", "elastic-charlm",
                                  "charlm-dense"])
def test_every_shipped_model_exports_and_checks_in_openvino(tmp_path, name, capsys):
    ir = tmp_path / f"{name}.xml"
    assert main(["export", name, "--target", "openvino", "--no-validate", "-o", str(ir)]) == 0
    assert main(["check", str(ir), "--samples", "16", "--quiet", "--threads", "1"]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_a_users_model_exports_and_checks_in_openvino(tmp_path):
    """The README's own model (adaptex.nn.BudgetedAttention in a module of the user's)."""
    import torch

    from tests.support.user_models import ReadmeTiny as Tiny

    torch.manual_seed(0)
    model = Tiny().eval()
    example = (torch.randn(2, 10, 16), torch.ones(2, 10, dtype=torch.bool))
    meta = adaptex.export(model, example, tmp_path / "tiny.xml", target="openvino")
    assert meta["target"] == "openvino"
    inputs = [(torch.randn(b, t, 16), torch.ones(b, t, dtype=torch.bool)) for b, t in [(1, 5), (4, 30), (2, 60)] * 3]
    report = adaptex.check(tmp_path / "tiny.xml", model, inputs=inputs)
    assert report.passed, report.format()


def _precision_by_layer(xml) -> dict[str, set[str]]:
    """What the CPU plugin runs each compiled MatMul or FullyConnected at: {"routing": {...}, "rest": {...}}."""
    from adaptex.exporter.targets.tensorrt.plan import ROUTE_MARK

    runner = OpenVINORunner(xml, threads=1)
    runner.activate()
    seen = {"routing": set(), "rest": set()}
    for n in runner.compiled.get_runtime_model().get_ops():
        rt = n.get_rt_info()
        if rt["layerType"].astype(str) in ("MatMul", "FullyConnected"):
            names = rt["originalLayersNames"].astype(str)
            seen["routing" if ROUTE_MARK in names else "rest"].add(rt["runtimePrecision"].astype(str))
    return seen


def test_a_bf16_ir_runs_its_routing_in_f32_and_passes_check(tmp_path, capsys):
    """The cause of bf16's right decisions: the routing layers' `precise` mark. Without it the CPU
    plugin runs the routers' MatMuls in bf16 under the hint; with it, in f32, while the rest runs in
    bf16. Then check passes at bf16's tolerance with >= 99% decision agreement."""
    ir = tmp_path / "bf16.xml"
    assert main(["export", "budgetformer-graded", "--target", "openvino", "--precision", "bf16", "-o", str(ir)]) == 0
    assert read_meta(ir)["precision"] == "bf16"
    kept = _precision_by_layer(ir)
    assert kept["routing"] == {"f32"} and "bf16" in kept["rest"], kept
    assert main(["check", str(ir), "--samples", "24", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "bf16 tolerance" in out
    bare = tmp_path / "bare.xml"  # the same IR without the marks
    bare.write_text(ir.read_text().replace('<attribute name="precise" version="0" />', ""))
    (tmp_path / "bare.bin").write_bytes(ir.with_suffix(".bin").read_bytes())
    assert "bf16" in _precision_by_layer(bare)["routing"]


def test_refusals_are_one_line(tmp_path, capsys, artifacts):
    assert main(["export", "budgetformer-graded", "--target", "openvino", "--precision", "bf16",
                 "-o", str(tmp_path / "m.onnx")]) != 0
    assert "a bf16 OpenVINO artifact is IR (.xml)" in capsys.readouterr().err
    assert main(["export", "budgetformer-graded", "--target", "openvino", "--precision", "fp16",
                 "-o", str(tmp_path / "m.xml")]) != 0
    assert "precision 'fp16' is not supported for the openvino target; use fp32 or bf16" in \
        capsys.readouterr().err
    assert main(["export", "budgetformer-graded", "--target", "openvino", "-o", str(tmp_path / "m.bin")]) != 0
    assert "must end in .xml or .onnx" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert main(["check", str(artifacts("bf", "tensorrt")), "--runtime", "openvino", "--one-session"]) != 0
    assert "ONNX Runtime only" in capsys.readouterr().err
