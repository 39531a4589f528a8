"""What masked keys cost ONNX Runtime's fused attention kernel (com.microsoft.MultiHeadAttention),
the finding that took Elastic Attention's streaming (SA) pairs out of it
(exporter/targets/onnx/bodies/, block_local). Block-local streaming attention as the kernel
would run it: N sequences (pair x block) of Bq queries against K keys (the sinks, then the block's
run), each query seeing a band of them, the band given as the kernel's `attention_bias`. Timed in
interleaved rounds, 1 thread:

- unmasked: no bias (every key seen: the kernel's own speed on these shapes);
- NEG: the band's other keys at -1e30, as a mask is written (exact);
- -80: at -80, which stays fast only while a row's scores lie within a few units of each other
  (--spreads scales the queries, and so the scores' spread).

    python lab/fused_mask_cost.py                     # 6 pairs x 16 blocks of (32, 4 + 64): T = 512
    python lab/fused_mask_cost.py --shapes 96x32x68x32 --spreads 1,4 --rounds 300

A shape is SEQUENCESxQUERIESxKEYSxHEAD_DIM; the first 4 keys are sinks, seen by every query.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
import onnxruntime as ort
from if_branch_cost import interleaved_medians, parse_shapes, timings  # beside this script
from onnx import TensorProto, helper

SINKS = 4
NEG = -1e30


def mha_model(bias: np.ndarray | None) -> bytes:
    """The kernel over inputs q, k, v (N, L, dh), with `bias` as its attention_bias (a constant)."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "k", "v", "o")]
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"] + (["", "", "bias"] if bias is not None else []),
                            ["o"], domain="com.microsoft", num_heads=1, mask_filter_value=NEG)
    inits = [onnx.numpy_helper.from_array(bias, "bias")] if bias is not None else []
    graph = helper.make_graph([node], "mha", io[:3], io[3:], initializer=inits)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return model.SerializeToString()


def band(queries: int, keys: int, masked: float) -> np.ndarray:
    """(1, 1, Bq, K): 0 on the sinks and on the keys within half a run of each query, else `masked`."""
    half = (keys - SINKS - queries) // 2
    r = np.arange(queries)[:, None] + half
    c = np.arange(keys - SINKS)[None, :]
    run = np.where(np.abs(r - c) <= half, 0.0, masked)
    return np.concatenate([np.zeros((queries, SINKS)), run], axis=1).astype(np.float32)[None, None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="96x32x68x32")
    ap.add_argument("--spreads", default="1,4")
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes, 4)
    try:
        spreads = [float(s) for s in args.spreads.split(",")]
    except ValueError:
        spreads = []
    if shapes is None or any(s[2] < s[1] + SINKS for s in shapes) or not spreads or min(spreads) <= 0:
        print(f"fused_mask_cost: --shapes {args.shapes!r} --spreads {args.spreads!r}: write "
              f"SEQUENCESxQUERIESxKEYSxHEAD_DIM with KEYS >= QUERIES + {SINKS}, e.g. 96x32x68x32, and spreads > 0",
              file=sys.stderr)
        return 2
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    rng = np.random.default_rng(0)
    for n, bq, nk, dh in shapes:
        k, v = (rng.standard_normal((n, nk, dh)).astype(np.float32) for _ in range(2))
        graphs = {"unmasked": mha_model(None), "NEG": mha_model(band(bq, nk, NEG)),
                  "-80": mha_model(band(bq, nk, -80.0))}
        for spread in spreads:
            q = (spread * rng.standard_normal((n, bq, dh))).astype(np.float32)
            feeds = {"q": q, "k": k, "v": v}
            med = interleaved_medians(graphs, so, feeds, args.rounds, rng)
            print(f"(N={n}, Bq={bq}, K={nk}, dh={dh}, spread {spread:g}) {args.rounds} rounds: "
                  + timings(med)
                  + f"; NEG / unmasked {med['NEG'] / med['unmasked']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
