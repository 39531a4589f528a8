"""Latency of a TSA decoder artifact against its dense counterpart: prefill and decode, batch 1 and 64.

    adaptex export tsa-charlm --target onnx -o tsa.onnx
    python examples/tsa_bench.py tsa.onnx                 # the full sweep (a few minutes)
    python examples/tsa_bench.py tsa.onnx --quick         # batch 1 only

Each row is one `adaptex bench` run (interleaved timing, medians): the FLOP ratio the keep decisions
imply, the measured latency ratio, and the realisation (1 - latency ratio) / (1 - FLOP ratio).
"""
from __future__ import annotations

import argparse
import sys

from adaptex.runtimes.bench import run_bench
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
from adaptex.runtimes.source import load_source_model

SWEEP = [  # (batch, new tokens, cached tokens)
    (1, 128, 0), (1, 512, 0), (64, 128, 0), (64, 512, 0),  # prefill
    (1, 1, 127), (1, 1, 511), (64, 1, 511),  # decode steps
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="batch 1 only")
    ap.add_argument("--time-budget", type=float, default=6.0, help="seconds of timed rounds per row")
    args = ap.parse_args(argv)
    meta = OnnxRuntimeRunner(args.artifact).meta
    model, info = load_source_model(meta, None)
    rows = []
    for batch, seq, past in SWEEP:
        if args.quick and batch != 1:
            continue
        if seq + past > model.cfg.max_len:
            continue
        big = batch * seq >= 8192  # a second or more per run: 10 interleaved rounds
        r = run_bench(args.artifact, model, info, batch=batch, seq=seq, past=past, threads=args.threads,
                      warmup=2 if big else 5, runs=10 if big else None, time_budget_s=args.time_budget)
        rows.append(r)
        kind = "prefill" if not past else "decode"
        print(f"{kind:<8} B={batch:<3} T={seq:<4} past={past:<4} sparse {r['p50_ms']:9.3f} ms  dense "
              f"{r['dense_p50_ms']:9.3f} ms  FLOP {r['flop_ratio']:.3f}  latency {r['latency_ratio']:.3f}  "
              f"realisation {r['realisation'] if r['realisation'] is None else round(r['realisation'], 2)}",
              flush=True)
    print(f"\nthreads={args.threads}; keep rates per gated block at the first row: "
          f"{', '.join(f'{k:.2f}' for k in rows[0]['keep_rate_per_block'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
