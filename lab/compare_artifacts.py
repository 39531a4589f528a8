"""Two or more ONNX artifacts of the same model, timed in the same interleaved rounds: how a change to a
lowering is measured (the first artifact is the baseline, 1.000).

    python lab/compare_artifacts.py tsa-charlm old.onnx new.onnx --points 1x1x511,1x512x0
    python lab/compare_artifacts.py tsa-charlm old.onnx new.onnx --budget 5   # seconds a point

A point is BATCHxNEWxCACHED (1x1x511: a decode step after 511 cached tokens; 8x128x0: a prefill of 128
tokens at batch 8). The inputs are the ones `adaptex bench` generates for the model; a decode step's
cache is the baseline artifact's own prefill of the preceding text, fed to every artifact. Each round
runs every artifact once in a shuffled order, and the rounds fall into one block per artifact. Each
block creates the ONNX Runtime sessions afresh, in the order of the command line rotated by one place
a block: a session runs faster the later it was created in a process (four sessions of one graph
created in a row: the last at 0.92 to 0.94 of the first, a B1 decode step; docs/benchmarking.md), so
every artifact takes every place once. The ratio is the median over all rounds against the
baseline's, with [min, max] over the blocks, and the largest output difference from the baseline is
printed beside it (a change of speed that changes values is a bug). Differences of 1 to 3% need a
control: pass a byte-identical copy of the baseline too, and read the new artifact against the
baseline only where the copy's interval holds 1.000. A copy cannot show what ONNX Runtime's memory
plan (enable_mem_pattern: buffers laid out once per input shape) does to a changed graph: two graphs
of nearly the same work ran 1.034 of each other with it on and 0.986 with it off at a call of 1,024
rows (docs/benchmarking.md). --memory-plan both times every point with the plan on, then off: a
gain that holds only with it on is the buffers' layout, not the change's work.
Against the fastest dense graph, use `adaptex bench`; this script compares adaptive graphs only.
Each file runs in one ONNX Runtime session, as an app that loads it runs it: a file with run-time
dispatch is timed with its top-level Ifs, where adaptex's runner (and `adaptex bench`) would run each
graph as a session of its own (docs/benchmarking.md#one-session-per-program).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np


def max_diff(a: dict, b: dict) -> float:
    out = 0.0
    for k, v in b.items():
        x, y = np.asarray(a[k], np.float64), np.asarray(v, np.float64)
        if x.shape != y.shape:
            return float("inf")
        if x.size:
            out = max(out, float(np.max(np.abs(x - y))))
    return out


def compare(paths: list[str], threads: int, feeds: dict, budget_s: float, rng,
            memory_plan: bool = True) -> tuple[int, dict, dict]:
    """Interleaved rounds within about `budget_s`, in one block per artifact whose sessions are
    created in the order of `paths` rotated by the block's index: (rounds, path -> list of ns,
    path -> the median ns of each block)."""
    from adaptex.runtimes.bench_candidates import ort_runner as _ort_runner

    k, rounds = len(paths), None
    times = {p: [] for p in paths}
    medians = {p: [] for p in paths}
    for block in range(k):
        order = paths[block:] + paths[:block]
        fns = {}
        for p in order:  # the first run allocates; it is not timed
            fns[p] = _ort_runner(p, threads, memory_plan=memory_plan)
            fns[p](feeds)
        if rounds is None:
            t0 = time.perf_counter()
            for p in order:
                fns[p](feeds)
            one_round = max(time.perf_counter() - t0, 1e-6)
            rounds = max(5, min(2000 // k, int(budget_s / one_round / k)))
        got = {p: [] for p in paths}
        for _ in range(rounds):
            for i in rng.permutation(k):
                t = time.perf_counter_ns()
                fns[paths[i]](feeds)
                got[paths[i]].append(time.perf_counter_ns() - t)
        for p in paths:
            times[p] += got[p]
            medians[p].append(float(np.median(got[p])))
        del fns
        gc.collect()  # this block's sessions go before the next block's take their memory
    return rounds * k, times, medians


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="the shipped model name (or checkpoint) the artifacts were exported from")
    ap.add_argument("artifacts", nargs="+", help="ONNX artifacts; the first is the baseline")
    ap.add_argument("--points", default="1x1x511,1x1x127,1x32x0,1x512x0,8x128x0",
                    help="BATCHxNEWxCACHED, comma-separated (encoders: cached 0)")
    ap.add_argument("--budget", type=float, default=15.0, help="seconds of timing per point (default 15)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory-plan", choices=("on", "off", "both"), default="on",
                    help="ONNX Runtime's buffer plan per input shape (enable_mem_pattern) in the timed sessions; "
                         "both: time each point with it on, then off, the control for a layout effect (default on)")
    args = ap.parse_args(argv)
    import adaptex
    from adaptex.graphs.errors import AdaptexError
    from adaptex.runtimes.bench import Bench
    from adaptex.runtimes.bench_candidates import ort_runner as _ort_runner

    if len(args.artifacts) < 2 or len(set(args.artifacts)) != len(args.artifacts):
        print("compare_artifacts: give two or more different artifacts (the first is the baseline)", file=sys.stderr)
        return 2
    for a in args.artifacts:
        if not Path(a).is_file():
            print(f"compare_artifacts: {a}: no such artifact; export it with 'adaptex export {args.model} "
                  f"--target onnx -o {a}'", file=sys.stderr)
            return 2
    try:
        points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
        assert all(len(p) == 3 and p[0] >= 1 and p[1] >= 1 and p[2] >= 0 for p in points)
    except (ValueError, AssertionError):
        print(f"compare_artifacts: --points {args.points!r}: write BATCHxNEWxCACHED, e.g. 1x1x511,8x128x0",
              file=sys.stderr)
        return 2
    model = adaptex.load(args.model)
    base = args.artifacts[0]
    rng = np.random.default_rng(0)
    with Bench(base, model, model.adaptex_source) as bench:
        for batch, seq, past in points:
            fns = {a: _ort_runner(a, args.threads) for a in args.artifacts}
            try:
                feeds = bench.inputs(fns[base], batch=batch, seq=seq, past=past)
            except AdaptexError as e:
                print(f"compare_artifacts: B{batch} T{seq} past {past}: {e}", file=sys.stderr)
                return 2
            ref = fns[base](feeds)
            diffs = {a: max_diff(ref, fns[a](feeds)) for a in args.artifacts}
            del fns
            gc.collect()
            for plan in ("on", "off") if args.memory_plan == "both" else (args.memory_plan,):
                rounds, times, medians = compare(args.artifacts, args.threads, feeds, args.budget, rng,
                                                 memory_plan=plan == "on")
                b50 = np.median(times[base])
                cells = []
                for a in args.artifacts:
                    per_block = [m / mb for m, mb in zip(medians[a], medians[base])]
                    cells.append(f"{Path(a).name} {np.median(times[a]) / 1e6:.3f} ms {np.median(times[a]) / b50:.3f} "
                                 f"[{min(per_block):.3f}, {max(per_block):.3f}] diff {diffs[a]:.1e}")
                planned = "" if args.memory_plan == "on" else f", memory plan {plan}"
                print(f"B{batch} T{seq} past {past} ({rounds} rounds in {len(args.artifacts)} blocks, {args.threads} "
                      f"thread(s){planned}): " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
