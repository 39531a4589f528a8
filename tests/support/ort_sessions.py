"""ONNX Runtime sessions as the program tests open them: one intra-op thread, profiling on request."""
from __future__ import annotations

import onnxruntime as ort


def session(path, profile_dir=None) -> ort.InferenceSession:
    """A CPU session of the whole file; with profile_dir, ONNX Runtime's profiler writes there."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if profile_dir is not None:
        so.enable_profiling, so.profile_file_prefix = True, str(profile_dir / "p")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
