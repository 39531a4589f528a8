"""What a masked score costs ONNX Runtime's Softmax, and what adaptex's softmax floor gives back
(exporter/targets/onnx/passes.py, softmax_floor): causal attention probabilities over (B, H, T, T)
scores, the keys after each query at NEG (-1e30), timed three ways in interleaved rounds, 1 thread:

- plain: Softmax(x), as every stock export runs it;
- floored: Softmax(Max(x, ReduceMax(x) - 80)), the pass's rewrite;
- plain on a session with `session.set_denormal_as_zero`: the plain graph with subnormal floats
  flushed to zero, which shows where the time goes (an option of the app's session, not the file).
  It runs in a process of its own: in a process whose thread had run other sessions first, the
  flag was seen to change nothing.

    python lab/softmax_floor_cost.py                    # tsa-charlm's heads at T = 32, 128 and 512
    python lab/softmax_floor_cost.py --shapes 8x4x128 --rounds 500

A shape is BATCHxHEADSxT. The floored probabilities are checked against the plain ones (a masked
key weighs at most e^-80 where it weighed 0). Each line names the CPU: whether the floor pays depends
on it (runtimes/cpu.py; `adaptex bench` runs the same comparison at one shape).
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import onnxruntime as ort
from if_branch_cost import interleaved_medians, parse_shapes, timings  # beside this script

from adaptex.runtimes.cpu import causal_scores, describe, softmax_model


def options(flush: bool = False) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    if flush:
        so.add_session_config_entry("session.set_denormal_as_zero", "1")
    return so


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x4x32,1x4x128,1x4x512")
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes, 3)
    if shapes is None:
        print(f"softmax_floor_cost: --shapes {args.shapes!r}: write BATCHxHEADSxT, e.g. 1x4x128", file=sys.stderr)
        return 2
    models = {k: softmax_model(k == "floored").SerializeToString() for k in ("plain", "floored")}
    rng = np.random.default_rng(0)
    feeds = []
    for b, h, t in shapes:
        feeds.append({"x": causal_scores((b, h, t, t))})
        want, got = (ort.InferenceSession(m, options(), providers=["CPUExecutionProvider"]).run(None, feeds[-1])[0]
                     for m in models.values())
        if not np.allclose(want, got, rtol=1e-6, atol=1e-30):
            raise SystemExit("the floored Softmax disagrees with the plain one")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        flushed = pool.submit(flushed_medians, models["plain"], feeds, args.rounds).result()
    for (b, h, t), f, flush in zip(shapes, feeds, flushed):
        med = interleaved_medians(models, options(), f, args.rounds, rng)
        print(f"(B={b}, H={h}, T={t}, causal; {describe()}) {args.rounds} rounds: "
              + timings(med)
              + f"; plain, subnormals flushed {flush * 1e3:.3f} ms; floored / plain {med['floored'] / med['plain']:.2f}")
    return 0


def flushed_medians(model: bytes, feeds: list[dict], rounds: int) -> list[float]:
    """Median seconds of `model` on each of `feeds`, on a session with subnormals flushed to zero
    (run in a fresh process: see the module docstring)."""
    sess = ort.InferenceSession(model, options(flush=True), providers=["CPUExecutionProvider"])
    out = []
    for f in feeds:
        sess.run(None, f)
        times = []
        for _ in range(max(1, rounds // 2)):
            t0 = time.perf_counter()
            sess.run(None, f)
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
