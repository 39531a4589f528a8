"""The CPU under a benchmark: what it is, and whether adaptex's softmax floor pays on it.

ONNX Runtime's Softmax (MLAS) takes a masked score (-1e30) through subnormal floats on some CPUs,
where x86 arithmetic on them is slow, and not on others: a causal (1, 4, 512, 512) Softmax took
2.35 ms plain and 0.90 ms with the floor on this project's machine of 2026-12-05, 0.22 ms plain and
0.42 ms floored on an AMD EPYC with AVX-512 on 2026-12-06 (lab/softmax_floor_cost.py). So the
ONNX artifacts carry the floor by default (exporter/targets/onnx/passes.py, softmax_floor) and
`--softmax-floor off` leaves it out; `adaptex bench` runs `floor_probe` to say which this CPU wants.
"""
from __future__ import annotations

import os
import platform
import time

import numpy as np

PROBE_SHAPE = (1, 4, 256, 256)  # batch, heads, queries, keys: a causal mask over a mid-length prompt


def describe() -> str:
    """'AMD EPYC (x86_64; AVX-512), 2 logical cores': the model name Linux reports and the widest
    vector extension among AVX-512, AVX2 and AVX (which MLAS kernels ONNX Runtime picks)."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or "unknown CPU"
    isa = next((label for flag, label in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"))
                if flag in flags), None)
    arch = platform.machine() + (f"; {isa}" if isa else "")
    return f"{name} ({arch}), {os.cpu_count() or 1} logical cores"


def softmax_model(floored: bool):
    """A last-axis Softmax over (B, H, T, S) float32 scores, with passes.softmax_floor's rewrite
    (the artifacts' own) where `floored`."""
    from onnx import TensorProto, helper

    from adaptex.exporter.targets.onnx.passes import softmax_floor

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "H", "T", "S"]) for n in ("x", "p")]
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["p"], axis=-1)], "softmax", io[:1], io[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    if floored:
        softmax_floor(model)
    return model


def causal_scores(shape=PROBE_SHAPE, seed: int = 0) -> np.ndarray:
    """Scores of `shape` (B, H, T, T) with every key after its query masked at -1e30, as the
    artifacts' causal bias leaves them."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    x[..., np.triu(np.ones(shape[-2:], bool), 1)] = -1e30
    return x


def floor_probe(threads: int = 1, rounds: int = 60) -> dict:
    """The causal Softmax of PROBE_SHAPE plain and floored on this CPU, interleaved: median ms of
    each and whether the floor pays here (it runs faster than the plain one)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = max(1, threads or 1), 1
    so.log_severity_level = 3
    sessions = {k: ort.InferenceSession(softmax_model(k == "floored").SerializeToString(), so,
                                        providers=["CPUExecutionProvider"]) for k in ("plain", "floored")}
    feeds = {"x": causal_scores()}
    times = {k: [] for k in sessions}
    for s in sessions.values():
        s.run(None, feeds)
    for i in range(rounds):
        for k in (("plain", "floored") if i % 2 else ("floored", "plain")):
            t0 = time.perf_counter()
            sessions[k].run(None, feeds)
            times[k].append((time.perf_counter() - t0) * 1e3)
    plain, floored = (float(np.median(times[k])) for k in ("plain", "floored"))
    return {"shape": list(PROBE_SHAPE), "plain_ms": plain, "floored_ms": floored, "pays": floored < plain}
