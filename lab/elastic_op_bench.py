"""The elastic_attention op alone in ONNX Runtime, against full attention, at long sequence lengths.

    python lab/elastic_op_bench.py [--sa 0.6] [--seq 512 2048 4096] [--heads 12] [--head-dim 32]

MiniLM's learned positions stop at 512 tokens, so `adaptex bench` on an elastic MiniLM can only sweep
up to there; this script times one layer's attention (the part Elastic Attention changes) beyond it:
the sparse ElasticAttention body with a given fraction of SA heads against the same body with every
head full (FA), and the dense body (band masks over the full score matrix). 1 thread, medians of
interleaved runs; the attention FLOP ratio is printed next to the latency ratio.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from adaptex.exporter.targets.onnx import bodies as fx  # noqa: E402


def session(variant: str, sink: int, window: int) -> ort.InferenceSession:
    vi = lambda n, t: helper.make_tensor_value_info(n, t, None)  # noqa: E731
    node = helper.make_node("ElasticAttention", fx.EA_INPUTS, ["o"], domain=fx.DOMAIN, sink=sink, window=window, causal=0)
    ins = [vi(n, TensorProto.BOOL if n in ("sa", "key_mask") else TensorProto.FLOAT) for n in fx.EA_INPUTS]
    m = helper.make_model(helper.make_graph([node], "elastic", ins, [vi("o", TensorProto.FLOAT)]),
                          opset_imports=[helper.make_opsetid("", fx.ONNX_OPSET), helper.make_opsetid(fx.DOMAIN, 1)],
                          functions=[fx.elastic_attention_function(variant, causal_known=False)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sa", type=float, default=0.6, help="fraction of SA heads (e.g. the learned sparsity)")
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    sparse, dense = session("sparse", a.sink, a.window), session("dense", a.sink, a.window)
    H, dh = a.heads, a.head_dim
    n_sa = round(a.sa * H)
    print(f"one layer, {H} heads of {dh}, sink {a.sink}, window {a.window}: {n_sa}/{H} SA heads "
          f"({100 * n_sa / H:.0f}%), 1 thread, median of {a.runs} interleaved runs")
    print(f"{'T':>6} {'elastic ms':>11} {'full ms':>9} {'dense-band ms':>14} {'ratio':>7} {'FLOP ratio':>11}")
    rng = np.random.default_rng(0)
    for T in a.seq:
        q = rng.standard_normal((1, H, T, dh), dtype=np.float32)
        base = {"q": q, "k": q.copy(), "v": q.copy(), "key_mask": np.ones((1, T), bool)}
        sa = np.zeros((1, H), bool)
        sa[0, :n_sa] = True
        runs = {"elastic": (sparse, {**base, "sa": sa}), "full": (sparse, {**base, "sa": np.zeros((1, H), bool)}),
                "dense": (dense, {**base, "sa": sa})}
        times = {k: [] for k in runs}
        for name, (s, f) in runs.items():
            s.run(None, f)
        for _ in range(a.runs):
            for name, (s, f) in runs.items():
                t0 = time.perf_counter()
                s.run(None, f)
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        ctx = min(T, a.sink + a.window + 1)
        flop = ((H - n_sa) * T + n_sa * ctx) / (H * T)
        print(f"{T:6d} {med['elastic']:11.2f} {med['full']:9.2f} {med['dense']:14.2f} "
              f"{med['elastic'] / med['full']:7.3f} {flop:11.3f}")


if __name__ == "__main__":
    main()
