"""What the attention-score scale costs ONNX Runtime: q @ k^T as the one FusedMatMul kernel its
optimizer makes of MatMul + Transpose (+ Mul by a constant), with alpha = 1 (the scale folded into the
query weights, as adaptex's decoders do) against alpha = 1/sqrt(dh) (the scale on the scores, as a
stock export of `(q @ k.transpose(-1, -2)) / sqrt(dh)` becomes). Interleaved rounds, 1 thread.

    python lab/score_scale_cost.py                       # decode steps and a prefill of tsa-charlm's shapes
    python lab/score_scale_cost.py --shapes 64x4x1x512x32 --rounds 500

A shape is BATCHxHEADSxQUERIESxKEYSxHEAD_DIM. The outputs of the two are checked against each other
(the scaled one times sqrt(dh)).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import onnxruntime as ort
from if_branch_cost import interleaved_medians, one_thread, parse_shapes, timings  # beside this script
from onnx import helper


def scores_model(alpha: float) -> bytes:
    node = helper.make_node("FusedMatMul", ["q", "k"], ["s"], domain="com.microsoft", transB=1, alpha=alpha)
    graph = helper.make_graph([node], "scores", [helper.make_tensor_value_info(n, 1, None) for n in ("q", "k")],
                              [helper.make_tensor_value_info("s", 1, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4x1x512x32,64x4x1x512x32,1x4x512x512x32")
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes, 5)
    if shapes is None:
        print(f"score_scale_cost: --shapes {args.shapes!r}: write BATCHxHEADSxQUERIESxKEYSxHEAD_DIM, e.g. "
              "64x4x1x512x32", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    for b, h, t, s, dh in shapes:
        scale = 1.0 / float(np.sqrt(dh))
        models = {"alpha 1": scores_model(1.0), f"alpha {scale:.4f}": scores_model(scale)}
        feeds = {"q": rng.standard_normal((b, h, t, dh)).astype(np.float32),
                 "k": rng.standard_normal((b, h, s, dh)).astype(np.float32)}
        plain, scaled = (ort.InferenceSession(m, one_thread(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
                         for m in models.values())
        if not np.allclose(plain * scale, scaled, rtol=1e-4, atol=1e-4):
            raise SystemExit("the two kernels disagree")
        med = interleaved_medians(models, one_thread(), feeds, args.rounds, rng)
        first, second = med.values()
        print(f"(B={b}, H={h}, T={t}, S={s}, dh={dh}) {args.rounds} rounds: "
              + timings(med) + f"; ratio {second / first:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
