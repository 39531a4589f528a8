"""What running attention a sample at a time saves ONNX Runtime: softmax(q k^T + bias) v over a
batch, as a stock export writes it, against the same graph after adaptex's `attention_by_sample`
pass with its Loop forced on (the If still decides; its threshold is set to 0 here), so each
sample's scores, bias and probabilities stay in cache between the kernels. Interleaved rounds,
1 thread. This is how the pass's threshold (OrtPolicy.by_sample_from, graphs/ops/policy.py)
was chosen.

    python lab/by_sample_cost.py                         # the shapes the threshold was chosen on
    python lab/by_sample_cost.py --shapes 8x4x512x32 --rounds 60

A shape is BATCHxHEADSxTOKENSxHEAD_DIM (self-attention with a causal bias per sample). The outputs
of the two graphs are checked against each other.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import onnxruntime as ort
from if_branch_cost import interleaved_medians, one_thread, parse_shapes, timings  # beside this script
from onnx import TensorProto, helper

from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.onnx.passes_by_sample import attention_by_sample
from adaptex.graphs.ops.policy import OrtPolicy


def attention_model(batch: int, heads: int, tokens: int, dh: int, by_sample: bool) -> bytes:
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Add", ["s", "bias"], ["sb"]),
             helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, heads, tokens, dh]) for n in "qkv"]
    io.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [batch, 1, tokens, tokens]))
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, heads, tokens, dh])]
    model = helper.make_model(helper.make_graph(nodes, "attention", io, out),
                              opset_imports=[helper.make_opsetid("", fx.ONNX_OPSET)])
    if by_sample:
        assert attention_by_sample(model, OrtPolicy(by_sample_from=0)) == 1
    return model.SerializeToString()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x4x512x32,64x4x512x32,64x4x128x32,16x4x256x32,8x4x256x32,2x4x512x32,"
                                        "8x4x128x32,64x4x64x32")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes, 4)
    if shapes is None:
        print(f"by_sample_cost: --shapes {args.shapes!r}: write BATCHxHEADSxTOKENSxHEAD_DIM, e.g. 8x4x512x32",
              file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    for b, h, t, dh in shapes:
        models = {"batched": attention_model(b, h, t, dh, False), "by sample": attention_model(b, h, t, dh, True)}
        feeds = {n: rng.standard_normal((b, h, t, dh)).astype(np.float32) for n in "qkv"}
        feeds["bias"] = np.broadcast_to(np.triu(np.full((t, t), -np.inf, np.float32), 1), (b, 1, t, t)).copy()
        batched, looped = (ort.InferenceSession(m, one_thread(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
                           for m in models.values())
        if not np.allclose(batched, looped, rtol=1e-5, atol=1e-6):
            raise SystemExit("the two graphs disagree")
        med = interleaved_medians(models, one_thread(), feeds, args.rounds, rng)
        print(f"(B={b}, H={h}, T={t}, dh={dh}; {b * h * t * t} scores) {args.rounds} rounds: "
              + timings(med)
              + f"; ratio {med['by sample'] / med['batched']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
