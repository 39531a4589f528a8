"""ONNX Runtime's profiler over a graph: kernel time by op type, the adaptive ops' apart."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from adaptex.runtimes.onnxruntime import session_options


CONTROL_FLOW = ("If", "Loop", "Scan")


def profile_onnx(path: str, feeds: dict, threads: int, workdir: Path, runs: int = 30) -> dict:
    """ONNX Runtime's profiler over `runs` runs: kernel time and kernel count per run by op type, split
    between the adaptive ops (the nodes of adaptex:: functions) and the rest of the graph, and the run's
    time outside its kernels (the profiled run less its kernels: dispatch, allocation, control flow;
    at short calls a graph of more kernels loses most of its gap there). The profiled copy names
    every function node as an op's (passes.name_op_nodes; the computation is the same), and a
    dense-dispatch branch holds its calls inlined under such names already. A fusion that names its
    node afresh (BiasGelu, FusedMatMul) loses the mark: its kernel counts with the rest."""
    import onnx
    import onnxruntime as ort

    from adaptex.exporter.targets.onnx.passes import OP_NODE, name_op_nodes

    model = onnx.load(path)
    if name_op_nodes(model):
        path = str(Path(workdir) / f"profiled-{Path(path).name}")
        onnx.save(model, path)
    so = session_options(threads)
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(workdir) / f"profile-{Path(path).stem}")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    takes = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in takes}
    warm = 3  # the first runs allocate: only the steady-state runs after them count
    for _ in range(warm + runs):
        sess.run(None, feeds)
    trace = Path(sess.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink(missing_ok=True)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[warm:]
    # per run: kernel ms by op type (control flow excluded: its time is its subgraphs' kernels, which
    # the profiler lists themselves); then the median over runs, so that a run a neighbour slowed
    # does not skew the breakdown on a shared machine
    per_run, counts = [dict() for _ in spans], [dict() for _ in spans]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name", "?")
        if op in CONTROL_FLOW:
            continue
        run = next((i for i, (a, b) in enumerate(spans) if a <= e["ts"] <= b), None)
        if run is None:
            continue  # a warm-up run
        key = f"{op} (adaptive)" if OP_NODE in e["name"] else op
        per_run[run][key] = per_run[run].get(key, 0.0) + e.get("dur", 0) / 1e3
        counts[run][key] = counts[run].get(key, 0) + 1
    keys = {k for r in per_run for k in r}
    by_op = {k: float(np.median([r.get(k, 0.0) for r in per_run])) for k in keys}
    adaptive = sum(v for k, v in by_op.items() if k.endswith("(adaptive)"))
    rest = sum(by_op.values()) - adaptive
    run_ms = float(np.median([(b - a) / 1e3 for a, b in spans])) if spans else 0.0
    return {"runs": len(per_run), "total_ms": adaptive + rest, "adaptive_ms": adaptive, "rest_ms": rest,
            "run_ms": run_ms, "outside_ms": max(run_ms - adaptive - rest, 0.0),
            "kernels": int(np.median([sum(c.values()) for c in counts])) if counts else 0,
            "by_op_ms": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            "by_op_kernels": {k: int(np.median([c.get(k, 0) for c in counts])) for k in keys}}

