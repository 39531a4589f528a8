"""What ONNX Runtime's If costs when a whole graph runs as its branch: one artifact's graph timed as it
is, as the branch of an If reading the weights from the main graph, and as the branch of an If that
reads them through the fold nodes `--dense-rows` writes (a Reshape pair per weight, which constant
folding turns into initializers of the branch at load). Interleaved rounds; the outputs are checked
against the plain graph's.

    python lab/if_branch_cost.py build/tsa-dense.onnx --points 1x1x127,1x1x511,8x1x511

A point is BATCHxNEWxCACHED as in compare_artifacts.py. The inputs are random (ids, a full mask, a
random cache, random head modes), which is enough to time a graph, not to judge its outputs. Both
branches of each If are the same graph, so the condition does not matter.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper


def _branch(graph: onnx.GraphProto, tag: str, local: bool) -> onnx.GraphProto:
    """`graph` as an If branch (dispatch.branch, the one --dense-rows writes): its reads of the main
    graph's initializers left as they are, or (local) taken through a Reshape pair each."""
    from adaptex.exporter.targets.onnx.dispatch import branch

    return branch(graph, tag, list(graph.output), None, "adaptex", local_weights=local)


def wrapped(src: onnx.ModelProto, local: bool) -> onnx.ModelProto:
    g = src.graph
    first = g.input[0].name
    nodes = [helper.make_node("Shape", [first], ["cost.shape"], start=0, end=1),
             helper.make_node("ReduceProd", ["cost.shape"], ["cost.rows"], keepdims=0),
             helper.make_node("LessOrEqual", ["cost.rows", "cost.limit"], ["cost.small"]),
             helper.make_node("If", ["cost.small"], [o.name for o in g.output],
                              then_branch=_branch(g, "a", local), else_branch=_branch(g, "b", local))]
    limit = numpy_helper.from_array(np.array(1 << 30, dtype=np.int64), "cost.limit")
    graph = helper.make_graph(nodes, g.name, list(g.input), list(g.output), initializer=list(g.initializer) + [limit])
    model = helper.make_model(graph, opset_imports=list(src.opset_import), ir_version=src.ir_version)
    model.functions.extend(src.functions)
    return model


def parse_shapes(text: str, dims: int) -> list[tuple[int, ...]] | None:
    """The cost scripts' --shapes: comma-separated AxBx... of `dims` whole numbers >= 1 each, as
    tuples; None where malformed (the script then prints its one-line usage)."""
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        return None
    return shapes if all(len(s) == dims and min(s) >= 1 for s in shapes) else None


def one_thread() -> ort.SessionOptions:
    """The cost scripts' session options: one intra-op and one inter-op thread."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    return so


def timings(medians: dict) -> str:
    """'name 1.234 ms; ...' for interleaved_medians' seconds."""
    return "; ".join(f"{k} {v * 1e3:.3f} ms" for k, v in medians.items())


def interleaved_medians(models: dict, so, feeds: dict, rounds: int, rng) -> dict:
    """Each graph (a path or a serialized model) run once a round in a shuffled order; the median
    seconds of each. The rounds fall into one block per graph, each sessions created afresh in
    the order of `models` rotated by one place a block: a session runs faster the later it was
    created in a process (compare_artifacts.py), so every graph takes every place once. `so`: the
    session options, or a dict of them by graph."""
    names = list(models)
    times = {k: [] for k in names}
    for block in range(len(names)):
        sessions = {k: ort.InferenceSession(models[k], so[k] if isinstance(so, dict) else so,
                                            providers=["CPUExecutionProvider"])
                    for k in names[block:] + names[:block]}
        for s in sessions.values():
            s.run(None, feeds)  # the first run allocates; it is not timed
        for _ in range(max(1, rounds // len(names))):
            for k in rng.permutation(names):
                t0 = time.perf_counter()
                sessions[k].run(None, feeds)
                times[k].append(time.perf_counter() - t0)
        del sessions
        gc.collect()
    return {k: float(np.median(v)) for k, v in times.items()}


def feeds(sess: ort.InferenceSession, batch: int, new: int, past: int, rng) -> dict:
    out = {}
    for i in sess.get_inputs():
        if i.type == "tensor(int64)" and i.name == "input_ids":
            out[i.name] = rng.integers(1, 30, (batch, new)).astype(np.int64)
        elif i.type == "tensor(int64)":  # an attention mask over the cache and the new tokens
            out[i.name] = np.ones((batch, past + new), np.int64)
        elif i.type == "tensor(bool)":
            out[i.name] = rng.random([d if isinstance(d, int) else batch for d in i.shape]) < 0.5
        else:  # a cache: (batch, heads, past, head_dim)
            shape = [d if isinstance(d, int) else (batch if j == 0 else past) for j, d in enumerate(i.shape)]
            out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--points", default="1x1x127,1x1x511")
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    try:
        points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
        if any(len(p) != 3 or min(p[:2]) < 1 or p[2] < 0 for p in points):
            raise ValueError
    except ValueError:
        print(f"if_branch_cost: --points {args.points!r}: write BATCHxNEWxCACHED, e.g. 1x1x127,8x1x511",
              file=sys.stderr)
        return 2
    if not Path(args.artifact).is_file():
        print(f"if_branch_cost: {args.artifact}: no such file; export one first (adaptex export MODEL --target "
              "onnx -o ART.onnx)", file=sys.stderr)
        return 2
    src = onnx.load(args.artifact)
    tmp = Path(tempfile.mkdtemp())
    paths = {"plain": args.artifact}
    for name, local in (("If, weights from the main graph", False), ("If, weights folded into the branch", True)):
        paths[name] = str(tmp / f"{len(paths)}.onnx")
        onnx.save(wrapped(src, local), paths[name])
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    rng = np.random.default_rng(0)
    for batch, new, past in points:
        sessions = {k: ort.InferenceSession(p, so, providers=["CPUExecutionProvider"]) for k, p in paths.items()}
        f = feeds(sessions["plain"], batch, new, past, rng)
        want = sessions["plain"].run(None, f)
        for name, s in sessions.items():
            got = s.run(None, f)
            diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) if np.size(a) else 0.0
                       for a, b in zip(got, want))
            if diff > 1e-4:
                raise SystemExit(f"{name}: outputs differ from the plain graph's by {diff:.1e}")
        del sessions, s
        gc.collect()
        med = interleaved_medians(paths, so, f, args.rounds, rng)
        print(f"B{batch} T{new} past {past} ({args.rounds} rounds, 1 thread): " + "; ".join(
            f"{k} {v * 1e3:.3f} ms ({(v - med['plain']) * 1e6:+.0f} us)" for k, v in med.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
