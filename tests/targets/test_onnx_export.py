"""The ONNX target: custom-domain nodes with model-local bodies, checker-clean, parity in ORT."""
import subprocess
import sys

import numpy as np
import onnx
import pytest

from adaptex.exporter.metadata import read_onnx_metadata
from adaptex.graphs import checkpoint
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
from adaptex.runtimes.parity import check
from adaptex.runtimes.torch_ref import TorchRunner
from tests.support import planted


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_artifact_structure(tiny_onnx, variant):
    model = onnx.load(str(tiny_onnx[variant]))
    nodes = [n for n in model.graph.node if n.domain == "adaptex"]
    assert [n.op_type for n in nodes] == ["BudgetedAttention"] * 2
    assert {(f.domain, f.name) for f in model.functions} == {("adaptex", "BudgetedAttention")}
    assert any(o.domain == "adaptex" and o.version == 1 for o in model.opset_import)
    names = [o.name for o in model.graph.output]
    assert names[0] == "logits" and "decisions.layer1.head_mask" in names and "decisions.layer0.k" in names
    dims = [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence"]
    # If branches included; passes.softmax_floor's nodes (a ReduceMax a Softmax) aside
    ops = {n.op_type for _, n in planted.walk(model.functions[0].node) if ".floor." not in n.name}
    if variant == "sparse":
        assert {"TopK", "Gather", "ReduceMax"} <= ops  # runtime K from the batch's budgets
        # ONNX Runtime's body groups a mixed batch by head: specialised to the calls' head count,
        # it is the overload those calls name
        assert model.functions[0].overload == "heads4" and {n.overload for n in nodes} == {"heads4"}
        assert {"If", "ScatterND"} <= ops
    else:
        assert "ReduceMax" not in ops and "Gather" not in ops  # static shapes: K = H


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_checker_passes_in_a_fresh_process(tiny_onnx, variant):
    """The full checker must pass without adaptex's in-process schema registration: a user's
    process has only the model-local function to go by."""
    code = ("import onnx,sys; m=onnx.load(sys.argv[1]); onnx.checker.check_model(m, full_check=True); "
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_onnx[variant])], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_metadata_records_what_a_user_needs(tiny_onnx, tiny_checkpoint):
    meta = read_onnx_metadata(tiny_onnx["sparse"])
    _, info = checkpoint.load(tiny_checkpoint)
    assert meta["family"] == "budgetformer" and meta["variant"] == "sparse" and meta["precision"] == "fp32"
    assert meta["source"]["sha256"] == info["sha256"]
    assert meta["opset"] == {"adaptex": 1, "onnx": 20}
    assert meta["budget_range"] == [0.25, 0.375]
    assert meta["inputs"]["input_ids"]["shape"] == ["batch", "sequence"]
    assert meta["outputs"]["decisions.layer0.k"]["dtype"] == "int64"


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_parity_in_onnxruntime_across_varied_inputs(tiny_onnx, tiny_checkpoint, variant):
    model, _ = checkpoint.load(tiny_checkpoint)
    report = check(OnnxRuntimeRunner(tiny_onnx[variant]), TorchRunner(model), samples=120, task="graded")
    assert report.passed, report.format()
    assert report.unexcused_flips == 0 and report.max_abs_err <= 1e-4
    assert report.decisions_vary
    seen = report.decisions["decisions.layer0.k"].values_seen
    assert len(seen) >= 2, seen


def test_k_is_not_baked_into_the_graph(tiny_onnx, tiny_checkpoint):
    """Two inputs with different budgets give different k from the same artifact, both right."""
    model, _ = checkpoint.load(tiny_checkpoint)
    runner, ref = OnnxRuntimeRunner(tiny_onnx["sparse"]), TorchRunner(model)
    rng = np.random.default_rng(0)
    ks = set()
    for _ in range(40):
        T = int(rng.integers(1, 64))
        feeds = {"input_ids": rng.integers(1, 64, size=(1, T)).astype(np.int64),
                 "attention_mask": np.ones((1, T), dtype=np.int64)}
        got, want = runner.infer(feeds), ref.infer(feeds)
        assert got["decisions.layer0.k"].tolist() == want["decisions.layer0.k"].tolist()
        np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4, rtol=1e-3)
        ks.add(int(got["decisions.layer0.k"][0]))
    assert len(ks) >= 2
