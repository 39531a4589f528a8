"""ONNX Runtime runner (CPU execution provider), thread count settable."""
from __future__ import annotations

from pathlib import Path

from exporter.artifact import read_onnx_metadata
from graphs.errors import AdaptexError
from runtimes.base import IOSpec, ModelLimits, Runner

_ORT_TYPES = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(bool)": "bool",
              "tensor(float16)": "float16", "tensor(int32)": "int32"}


def session_options(threads: int | None):
    import onnxruntime as ort

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
        self.path = Path(path)
        self.meta = read_onnx_metadata(self.path) if require_metadata else {}
        cfg = self.meta.get("config", {})
        limits = ModelLimits(cfg["max_len"], cfg["vocab_size"]) if cfg else None
        super().__init__(limits)
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


def open_artifact(path: str | Path, threads: int | None = None, compute_units: str | None = None) -> Runner:
    """The runner for an artifact, by its kind. A Core ML package runs on the Core ML runtime on macOS,
    and is checked by MIL reference evaluation elsewhere (or when compute_units is None off macOS)."""
    path = Path(path)
    if path.suffix == ".onnx":
        return OnnxRuntimeRunner(path, threads)
    if path.suffix == ".mlpackage":
        if not path.exists():
            raise AdaptexError(f"{path}: no such artifact; export one with 'adaptex export --target coreml -o {path}'")
        from runtimes import coreml

        if coreml.available():
            return coreml.CoreMLRunner(path, compute_units or "all")
        if compute_units:
            raise AdaptexError(f"--compute-units {compute_units} needs the Core ML runtime (macOS); without it "
                               "'adaptex check' evaluates the package's program in numpy")
        from runtimes.coreml_mil import MilReferenceRunner

        return MilReferenceRunner(path)
    if path.suffix in (".plan", ".engine"):
        from runtimes.tensorrt import TensorRTRunner

        return TensorRTRunner(path)
    raise AdaptexError(f"{path}: unknown artifact kind {path.suffix or '(no suffix)'!r}; "
                       "adaptex runs .onnx, .mlpackage and TensorRT .plan/.engine artifacts")
