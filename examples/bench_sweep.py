"""Latency of the shipped BudgetFormer's sparse and dense ONNX artifacts over batch and length.

Prints one table (medians and ratios from one run; the machine is shared, so compare within a run):

    python examples/bench_sweep.py [--threads 1] [--seqs 32,128,256] [--batches 1,8]
"""
import argparse
import tempfile
from pathlib import Path

import adaptex
from adaptex.runtimes.bench import run_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seqs", default="32,128,256")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=None)
    args = ap.parse_args()
    model = adaptex.load(args.model)
    info = model.adaptex_source
    seqs = [min(int(s), model.cfg.max_len) for s in args.seqs.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{'variant':<7} {'batch':>5} {'seq':>4} {'p50 ms':>8} {'dense ms':>9} {'naive ms':>9} "
          f"{'FLOP r':>7} {'lat r':>6} {'realis.':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("sparse", "dense"):
            path = Path(tmp) / f"{variant}.onnx"
            adaptex.export(model, None, path, variant=variant)
            for batch in batches:
                for seq in seqs:
                    r = run_bench(path, model, info, batch=batch, seq=seq, threads=args.threads, runs=args.runs,
                                  time_budget_s=4.0)
                    fmt = lambda x, spec: format(x, spec) if x is not None else "n/a".rjust(len(format(0.0, spec)))
                    print(f"{variant:<7} {batch:>5} {seq:>4} {r['p50_ms']:8.3f} {r['dense_p50_ms']:9.3f} "
                          f"{fmt(r['naive_p50_ms'], '9.3f')} {r['flop_ratio']:7.3f} {r['latency_ratio']:6.3f} "
                          f"{fmt(r['realisation'], '8.3f')}", flush=True)


if __name__ == "__main__":
    main()
