"""The lab's measuring scripts (lab/, not part of the package) run as their docstrings say: each
prints its figures, and refuses malformed input with one line and exit 2."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "lab"


# developers' measuring tools (lab/), not the product: make test-slow keeps them running
pytestmark = pytest.mark.slow

def test_compare_artifacts_times_artifacts_of_one_model_side_by_side(tiny_tsa_chars, tmp_path):
    """The script that measures a change to a lowering: every artifact in the same rounds, against the
    first, with the largest output difference; a malformed point is one line and exit 2."""
    import shutil

    ck, onnx_path = tiny_tsa_chars
    other = tmp_path / "other.onnx"
    shutil.copy(onnx_path, other)
    script = str(LAB / "compare_artifacts.py")
    r = subprocess.run([sys.executable, script, str(ck), str(onnx_path), str(other), "--points", "1x1x5,2x4x0",
                        "--budget", "0.2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["B1 T1 past 5", "B2 T4 past 0"], r.stdout
    for line in lines:
        base, copy = line.split(": ", 1)[1].split("; ")
        assert base.startswith(f"{onnx_path.name} ") and " 1.000 [1.000, 1.000] diff 0.0e+00" in base, line
        assert copy.startswith("other.onnx ") and copy.endswith("diff 0.0e+00"), line  # same graph, same values
    bad = subprocess.run([sys.executable, script, str(ck), str(onnx_path), str(other), "--points", "1x1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "BATCHxNEWxCACHED" in bad.stderr
    both = subprocess.run([sys.executable, script, str(ck), str(onnx_path), str(other), "--points", "2x4x0",
                           "--budget", "0.2", "--memory-plan", "both"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert both.returncode == 0, both.stderr[-3000:]
    lines = both.stdout.strip().splitlines()  # the same point with the plan on, then off: a row each
    assert [line.split(": ")[0].split(", ")[-1] for line in lines] == ["memory plan on)", "memory plan off)"], lines
    assert all(" 1.000 [1.000, 1.000] diff 0.0e+00" in line.split("; ")[0] for line in lines), lines


def test_timed_sessions_take_the_memory_plan_on_or_off():
    """The control compare_artifacts --memory-plan off times with: ONNX Runtime's plan per input
    shape switched off in the session, and refused where the runner's programs would ignore it."""
    from adaptex.runtimes.bench_candidates import ort_runner as _ort_runner
    from adaptex.runtimes.onnxruntime import session_options

    assert session_options(1).enable_mem_pattern and not session_options(1, memory_plan=False).enable_mem_pattern
    with pytest.raises(ValueError, match="one session of the file"):
        _ort_runner("unused.onnx", 1, programs=True, memory_plan=False)


def test_if_branch_cost_times_a_graph_as_it_is_and_as_an_ifs_branch(tiny_tsa_chars):
    """The script behind the If-cost figures: three graphs per point, the plain one at +0 us, the
    wrapped ones' outputs checked against it; a malformed point is one line and exit 2."""
    _, onnx_path = tiny_tsa_chars
    script = str(LAB / "if_branch_cost.py")
    r = subprocess.run([sys.executable, script, str(onnx_path), "--points", "1x1x5,2x3x0", "--rounds", "5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["B1 T1 past 5", "B2 T3 past 0"], r.stdout
    for line in lines:
        parts = line.split(": ", 1)[1].split("; ")
        assert len(parts) == 3 and parts[0].startswith("plain ") and parts[0].endswith("(+0 us)"), line
        assert "weights from the main graph" in parts[1] and "weights folded into the branch" in parts[2], line
    bad = subprocess.run([sys.executable, script, str(onnx_path), "--points", "1x1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "BATCHxNEWxCACHED" in bad.stderr


def _one_line_and_a_refusal(name: str, good: list[str], bad: list[str], hint: str) -> str:
    """Run lab/<name> with `good` arguments: its one line of output. With `bad`: exit 2 and one
    line of error naming `hint` (the format it wants)."""
    script = str(LAB / name)
    r = subprocess.run([sys.executable, script, *good], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line, = r.stdout.strip().splitlines()
    refused = subprocess.run([sys.executable, script, *bad], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1 and hint in refused.stderr
    return line


def test_score_scale_cost_times_both_kernels_and_refuses_a_bad_shape():
    line = _one_line_and_a_refusal("score_scale_cost.py", ["--shapes", "2x2x1x16x8", "--rounds", "3"],
                                   ["--shapes", "2x2x1"], "BATCHxHEADS")
    assert line.startswith("(B=2, H=2, T=1, S=16, dh=8) 3 rounds: alpha 1 ") and "alpha 0.3536 " in line, line
    assert float(line.rsplit("ratio ", 1)[1]) > 0, line


def test_qkv_layout_cost_times_both_layouts_and_refuses_a_bad_shape():
    line = _one_line_and_a_refusal("qkv_layout_cost.py", ["--shapes", "2x16x32x4", "--rounds", "4"],
                                   ["--shapes", "2x16x30x4"], "BATCHxTOKENSxWIDTHxHEADS")
    assert line.startswith("(B=2, T=16, D=32, H=4) 4 rounds: traced ") and "; head-major " in line, line
    assert float(line.rsplit("ratio ", 1)[1]) > 0, line


def test_by_sample_cost_times_both_graphs_and_refuses_a_bad_shape():
    line = _one_line_and_a_refusal("by_sample_cost.py", ["--shapes", "2x2x16x8", "--rounds", "4"],
                                   ["--shapes", "2x2x16"], "BATCHxHEADS")
    assert line.startswith("(B=2, H=2, T=16, dh=8; 1024 scores) 4 rounds: batched ") and "by sample " in line, line
    assert float(line.rsplit("ratio ", 1)[1]) > 0, line


def test_softmax_floor_cost_times_the_three_graphs_and_refuses_a_bad_shape():
    line = _one_line_and_a_refusal("softmax_floor_cost.py", ["--shapes", "1x2x16", "--rounds", "6"],
                                   ["--shapes", "1x2"], "BATCHxHEADSxT")
    assert line.startswith("(B=1, H=2, T=16, causal; ") and " logical cores) 6 rounds: plain " in line, line
    assert "plain, subnormals flushed " in line, line
    assert float(line.rsplit("floored / plain ", 1)[1]) > 0, line


def test_fused_mask_cost_times_the_kernel_three_ways_and_refuses_a_bad_shape():
    line = _one_line_and_a_refusal("fused_mask_cost.py", ["--shapes", "4x4x16x8", "--spreads", "2", "--rounds", "6"],
                                   ["--shapes", "4x4x6x8"], "SEQUENCESxQUERIESxKEYSxHEAD_DIM")
    assert line.startswith("(N=4, Bq=4, K=16, dh=8, spread 2) 6 rounds: unmasked ") and "; NEG " in line \
        and "; -80 " in line, line
    assert float(line.rsplit("NEG / unmasked ", 1)[1]) > 0, line


def _attention_model(T: int = 6, d: int = 8, heads: int = 2):
    """x (1, T, d) through one com.microsoft.Attention of `heads` heads, with an attention_mask input."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    node = helper.make_node("Attention", ["x", "w", "b"], ["y"], domain="com.microsoft", num_heads=heads)
    graph = helper.make_graph(
        [node], "att", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, T, d]),
                        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, T])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal((d, 3 * d)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(3 * d).astype(np.float32), "b")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_attention_bias_cost_biases_each_head_and_refuses_bad_input(artifacts):
    """The script's graphs: a zero bias leaves the kernel's output as it was, streaming heads change
    it (their far keys hidden), and the routed graph runs with a router in front of the layer. Bad
    points and a decoder's artifact get one line and exit 2."""
    import numpy as np
    import onnxruntime as ort

    sys.path.insert(0, str(LAB))
    try:
        from attention_bias_cost import with_bias
    finally:
        sys.path.remove(str(LAB))
    src = _attention_model()
    x = np.random.default_rng(1).standard_normal((1, 6, 8)).astype(np.float32)
    feeds = {"x": x, "attention_mask": np.ones((1, 6), np.int64)}

    def run(model):
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    want = run(src)
    assert np.array_equal(run(with_bias(src, sink=1, window=2, streaming=np.zeros(2, bool))), want)
    streamed = run(with_bias(src, sink=1, window=2, streaming=np.array([True, False])))
    assert np.abs(streamed[..., :4] - want[..., :4]).max() > 1e-3  # head 0 hides keys
    assert np.array_equal(streamed[..., 4:], want[..., 4:])  # head 1 attends every key as before
    routed = with_bias(src, sink=1, window=2, routers=4)
    assert sum(n.op_type == "ArgMax" for n in routed.graph.node) == 1 and run(routed).shape == want.shape
    script = str(LAB / "attention_bias_cost.py")
    bad = subprocess.run([sys.executable, script, "missing.onnx", "--points", "1x32x0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "BATCHxTOKENS" in bad.stderr
    decoder = subprocess.run([sys.executable, script, str(artifacts("eldec")), "--points", "1x8"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert decoder.returncode == 2 and len(decoder.stderr.strip().splitlines()) == 1, decoder.stderr
    assert "not an elastic encoder's artifact" in decoder.stderr
