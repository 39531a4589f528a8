"""What putting Q, K and V in head layout costs ONNX Runtime: the traced way, each projection a MatMul
of (B, T, D) by (D, D), a Reshape to (B, T, H, dh) and a Transpose to (B, H, T, dh), against one
batched MatMul a projection of (B, 1, T, D) by weights stored as (H, D, dh), which gives (B, H, T, dh)
directly. Interleaved rounds, 1 thread; the outputs of the two are checked against each other.

    python lab/qkv_layout_cost.py                          # elastic-minilm's width and heads
    python lab/qkv_layout_cost.py --shapes 1x512x384x12 --rounds 500

A shape is BATCHxTOKENSxWIDTHxHEADS (the width a multiple of the heads).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import onnxruntime as ort
from if_branch_cost import interleaved_medians, one_thread, parse_shapes, timings  # beside this script
from onnx import TensorProto, helper, numpy_helper


def projections(weights: list[np.ndarray], heads: int, head_major: bool) -> bytes:
    """Three projections of x into (B, H, T, dh): traced (MatMul, Reshape, Transpose) or head-major
    (one MatMul against (H, D, dh) weights)."""
    width = weights[0].shape[0]
    dh = width // heads
    nodes, inits = [], []
    if head_major:
        nodes.append(helper.make_node("Unsqueeze", ["x", "axis1"], ["x4"]))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    else:
        inits.append(numpy_helper.from_array(np.array([0, 0, heads, dh], np.int64), "split_heads"))
    for i, w in enumerate(weights):
        if head_major:
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.reshape(width, heads, dh).transpose(1, 0, 2)),
                                                 f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x4", f"w{i}"], [f"o{i}"]))
        else:
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"p{i}"]),
                      helper.make_node("Reshape", [f"p{i}", "split_heads"], [f"r{i}"]),
                      helper.make_node("Transpose", [f"r{i}"], [f"o{i}"], perm=[0, 2, 1, 3])]
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info(f"o{i}", TensorProto.FLOAT, None) for i in range(3)],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32x384x12,1x128x384x12,1x512x384x12,8x32x384x12,8x512x384x12")
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes, 4)
    if shapes is None or any(d % h for _, _, d, h in shapes):
        print(f"qkv_layout_cost: --shapes {args.shapes!r}: write BATCHxTOKENSxWIDTHxHEADS, the width a multiple "
              "of the heads, e.g. 1x512x384x12", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    for b, t, d, h in shapes:
        weights = [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for _ in range(3)]
        models = {"traced": projections(weights, h, False), "head-major": projections(weights, h, True)}
        feeds = {"x": rng.standard_normal((b, t, d)).astype(np.float32)}
        traced, major = (ort.InferenceSession(m, one_thread(), providers=["CPUExecutionProvider"]).run(None, feeds)
                         for m in models.values())
        if not all(np.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(traced, major)):
            raise SystemExit("the two layouts disagree")
        med = interleaved_medians(models, one_thread(), feeds, args.rounds, rng)
        print(f"(B={b}, T={t}, D={d}, H={h}) {args.rounds} rounds: " + timings(med)
              + f"; ratio {med['head-major'] / med['traced']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
