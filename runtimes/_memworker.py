"""Peak resident memory of one ONNX Runtime session or Core ML model, in a process of its own.

Run as `python -m runtimes._memworker MODEL.onnx|MODEL.mlpackage INPUTS.npz THREADS [COMPUTE_UNITS
[ROWS_INPUT ROWS]]` (ROWS: an ONNX call of more token rows runs in chunks of whole samples, as
adaptex's runner runs it: runtimes/chunks.py); prints one JSON line. For ONNX it imports only numpy
and onnxruntime, so the figure is the session's and not torch's; for Core ML (macOS) it imports
coremltools, whose import is reported as import_rss_mb.
"""
import json
import sys

import numpy as np

from adaptex.runtimes.chunks import run_in_chunks, sample_chunks


def proc_mb(path: str, field: str) -> float | None:
    """One figure of Linux's procfs in MB (it writes kB): `field` of /proc/self/status (VmRSS, VmHWM)
    or of /proc/meminfo (MemAvailable). None where there is no such file or field (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _hwm_mb() -> float:
    """Peak resident set of this process image. getrusage's ru_maxrss would be wrong here: Linux
    carries it across exec, so a child started by a large parent reports the parent's peak."""
    mb = proc_mb("/proc/self/status", "VmHWM")
    if mb is None:
        raise RuntimeError("no VmHWM in /proc/self/status: peak memory needs Linux's procfs")
    return mb


def _coreml(path: str, inputs: str, units: str) -> None:
    import coremltools as ct

    from adaptex.runtimes.coreml import COMPUTE_UNITS

    base = _hwm_mb()
    m = ct.models.MLModel(path, compute_units=getattr(ct.ComputeUnit, COMPUTE_UNITS[units]))
    feeds = {k: v.astype(np.int32) for k, v in np.load(inputs).items()}
    for _ in range(3):
        m.predict(feeds)
    print(json.dumps({"peak_rss_mb": _hwm_mb(), "import_rss_mb": base}))


def main() -> None:
    path, inputs, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if path.rstrip("/").endswith(".mlpackage"):
        return _coreml(path, inputs, sys.argv[4] if len(sys.argv) > 4 else "all")
    import onnxruntime as ort

    base = _hwm_mb()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    takes = {i.name for i in sess.get_inputs()}  # a dense counterpart has no head_modes inputs
    feeds = {k: v for k, v in np.load(inputs).items() if k in takes}
    chunks = sample_chunks(feeds, sys.argv[5], int(sys.argv[6])) if len(sys.argv) > 6 else None
    for _ in range(3):
        run_in_chunks(lambda f: sess.run(None, f), feeds, chunks)
    print(json.dumps({"peak_rss_mb": _hwm_mb(), "import_rss_mb": base}))


if __name__ == "__main__":
    main()
