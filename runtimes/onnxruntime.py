"""ONNX Runtime runner (CPU execution provider), thread count settable."""
from __future__ import annotations

from pathlib import Path

from adaptex.exporter.metadata import read_onnx_metadata
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.base import IOSpec, Runner, check_threads, limits_of

_ORT_TYPES = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(bool)": "bool",
              "tensor(float16)": "float16", "tensor(int32)": "int32"}


def session_options(threads: int | None):
    import onnxruntime as ort

    check_threads(threads)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return so


class OnnxRuntimeRunner(Runner):
    name = "onnxruntime"

    def __init__(self, path: str | Path, threads: int | None = None, require_metadata: bool = True):
        check_threads(threads)
        self.path = Path(path)
        self.meta = read_onnx_metadata(self.path) if require_metadata else {}
        super().__init__(limits_of(self.meta))
        self.threads = threads
        self.session = None

    def _activate(self):
        import onnxruntime as ort

        try:
            self.session = ort.InferenceSession(str(self.path), session_options(self.threads),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:
            raise AdaptexError(f"{self.path}: ONNX Runtime cannot load it ({str(e).splitlines()[0]})") from None

    def _deactivate(self):
        self.session = None

    def input_metadata(self) -> dict[str, IOSpec]:
        if self.meta:
            return {n: IOSpec(n, s["dtype"], tuple(s["shape"])) for n, s in self.meta["inputs"].items()}
        self.activate()
        return {i.name: IOSpec(i.name, _ORT_TYPES.get(i.type, i.type), tuple(i.shape))
                for i in self.session.get_inputs()}

    def output_names(self) -> list[str]:
        self.activate()
        return [o.name for o in self.session.get_outputs()]

    def _infer(self, feeds):
        names = self.output_names()
        return dict(zip(names, self.session.run(names, feeds)))

    def run_raw(self, feeds):
        """Run without validation (for timing loops, after one validated call)."""
        return self.session.run(None, feeds)
