"""The graphs bench times beside an artifact, and how each runs: ONNX Runtime sessions (the runner's
programs for the artifact), Core ML predictors, TensorRT engines; a graph's size and peak memory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.chunks import run_in_chunks, sample_chunks
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner, session_options
from adaptex.runtimes.timing import Timing


def peak_rss(path: str, inputs: str, threads: int, compute_units: str = "all",
              chunks: tuple[str, int] | None = None) -> float | None:
    """chunks=(rows input, rows): the worker runs the call in chunks of samples, as bench timed it."""
    extra = [chunks[0], str(chunks[1])] if chunks else []
    r = subprocess.run([sys.executable, "-m", "adaptex.runtimes._memworker", path, inputs, str(threads), compute_units,
                        *extra], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def size_mb(path: str) -> float:
    p = Path(path)
    if p.is_dir():  # an .mlpackage is a directory
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20
    return p.stat().st_size / 2**20


def ort_runner(path: str, threads: int, programs: bool = False, chunks: tuple[str, int] | None = None,
                memory_plan: bool = True):
    """A callable from feeds to outputs by name: one session of the file, or with programs=True the
    adaptex runner's way (runtimes.onnxruntime.Programs: a session per program of a dispatching
    artifact). chunks=(rows input, rows): a call of more rows runs in chunks of whole samples
    (runtimes/chunks.py), whichever the graph, as the runner runs the artifact. memory_plan: see
    session_options (one session of the file only)."""
    import onnxruntime as ort

    if programs:
        if not memory_plan:
            raise ValueError("ort_runner: memory_plan=False is for one session of the file, not the runner's programs")
        runner = OnnxRuntimeRunner(path, threads, chunk_rows=chunks[1] if chunks else None).activate()
        names, takes = runner.output_names(), set(runner.input_metadata())
        return lambda feeds: dict(zip(names, runner.run_raw({k: v for k, v in feeds.items() if k in takes})))
    sess = ort.InferenceSession(path, session_options(threads, memory_plan), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    takes = {i.name for i in sess.get_inputs()}  # a dense graph takes no decisions (head_modes)

    def run(feeds: dict) -> dict:
        mine = {k: v for k, v in feeds.items() if k in takes}
        split = sample_chunks(mine, *chunks) if chunks else None
        return dict(zip(names, run_in_chunks(lambda f: sess.run(None, f), mine, split)))
    return run


def coreml_graphs(model, contract, meta: dict, artifact: str, tmp, say, compute_units: str):
    """The stock coremltools conversions of the dense and naive models beside a Core ML package:
    (timings, callables by (name, None), runtime description)."""
    import coremltools as ct

    from adaptex.exporter.counterparts import coreml_counterparts
    from adaptex.runtimes import coreml

    if not coreml.available():
        raise AdaptexError("Core ML latency needs the Core ML runtime (macOS); on this machine 'adaptex check' "
                           "verifies the package by MIL reference evaluation, and 'adaptex bench' times .onnx "
                           "artifacts")
    say(f"converting the dense counterpart and the naive export with stock coremltools "
        f"({meta.get('precision')}) ...")
    counterparts = coreml_counterparts(model, contract, tmp, meta.get("precision", "fp16"),
                                       meta.get("min_target", "iOS17"))
    out = [Timing(name, path, how=f"stock coremltools conversion of the {name} model", dense=name != "naive",
                  reason=reason) for name, (path, reason) in counterparts.items()]
    adaptive = coreml.CoreMLRunner(artifact, compute_units)
    adaptive.activate()
    fns = {("adaptive", None): adaptive.infer}
    for t in out:
        if t.path:
            fns[(t.name, None)] = coreml.load_predictor(t.path, compute_units)
    return out, fns, f"Core ML runtime ({compute_units}), coremltools {ct.__version__}"


def tensorrt_graphs(model, contract, meta: dict, info: dict, artifact: str, tmp, say):
    """A dense engine built from the same checkpoint with the same profile and precision, and the
    stock export's engine where TensorRT builds one, timed by CUDA events: (timings, callables by
    (name, None), device clocks by name, runtime description)."""
    import tensorrt as trt

    from adaptex.exporter.counterparts import onnx_counterparts
    from adaptex.exporter.metadata import source_of
    from adaptex.exporter.targets import tensorrt
    from adaptex.exporter.targets.tensorrt.engine import build_engine
    from adaptex.runtimes.tensorrt import TensorRTRunner

    prof, precision = meta["tensorrt"]["profile"], meta.get("precision", "fp32")
    say(f"building the dense counterpart engine ({precision}) ...")
    data, dmeta = tensorrt.bound_onnx(model, contract, source_of(model, info), variant="dense")
    dmeta["tensorrt"]["profile"] = prof
    build_engine(data, dmeta, tmp / "dense.plan", precision=precision, timing_cache=None, say=say)
    out = [Timing("dense", str(tmp / "dense.plan"), how="the dense model's engine, same profile and precision")]
    naive, reason = onnx_counterparts(model, contract, tmp)["naive"]
    how = "TensorRT's engine of the stock export of the masked inference path"
    if naive:
        try:
            build_engine(Path(naive).read_bytes(), dmeta, tmp / "naive.plan", precision=precision,
                         timing_cache=None, say=say, pin=False)
            out.append(Timing("naive", str(tmp / "naive.plan"), how=how, dense=False))
        except Exception as e:
            out.append(Timing("naive", None, how=how, dense=False,
                              reason=f"TensorRT did not build the stock export: {str(e).splitlines()[0][:160]}"))
    else:
        out.append(Timing("naive", None, how=how, dense=False, reason=reason))
    fns, clocks = {}, {}
    for t in [Timing("adaptive", artifact)] + out:
        if t.path:
            r = TensorRTRunner(t.path).activate()
            fns[(t.name, None)], clocks[t.name] = r.run_raw, (lambda r=r: r.last_ms)
    return out, fns, clocks, f"TensorRT {trt.__version__} ({precision}, CUDA-event timing)"
