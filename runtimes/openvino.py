"""OpenVINO runner (CPU device): an IR (.xml) or an ONNX file, thread count settable.

An ONNX file is read with its adaptex functions inlined first (OpenVINO's ONNX frontend does not
expand a custom domain's model-local functions), so an ONNX Runtime artifact runs here too, as a
user who inlines it would run it. Every call is one inference request, whole: no programs, no chunks
(an IR is one graph). Inference precision is the one the artifact's metadata states: f32, or bf16
with the routing layers in f32 (the IR marks them; exporter/targets/openvino).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.base import IOSpec, Runner, check_threads, limits_of


def read_meta(path: Path) -> dict:
    from adaptex.exporter.targets.openvino import read_meta as _read

    return _read(path)


def _inlined_onnx(path: Path) -> bytes:
    """The ONNX file's model with its model-local functions inlined, serialized."""
    import onnx
    import onnx.inliner

    try:
        proto = onnx.load(str(path))
    except Exception as e:
        raise AdaptexError(f"{path}: not a readable ONNX model ({str(e).splitlines()[0]})") from None
    return onnx.inliner.inline_local_functions(proto).SerializeToString() if proto.functions \
        else proto.SerializeToString()



def inference_precision(meta: dict) -> str:
    """OpenVINO's inference precision hint for an artifact's stated precision."""
    return "bf16" if meta.get("precision") == "bf16" else "f32"

class OpenVINORunner(Runner):
    name = "openvino"

    def __init__(self, path: str | Path, threads: int | None = None):
        check_threads(threads)
        self.path = Path(path)
        self.meta = read_meta(self.path)
        super().__init__(limits_of(self.meta))
        self.threads = threads
        self.compiled = self.request = None

    def _activate(self):
        try:
            import openvino as ov
        except ImportError as e:
            raise AdaptexError(f"--runtime openvino needs the openvino package ({e}); pip install openvino") from None
        core = ov.Core()
        config = {"INFERENCE_PRECISION_HINT": inference_precision(self.meta)}
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = self.threads
        try:
            if self.path.suffix == ".onnx":
                model = core.read_model(_inlined_onnx(self.path), b"")
            else:
                model = core.read_model(str(self.path))
            self.compiled = core.compile_model(model, "CPU", config)
        except AdaptexError:
            raise
        except Exception as e:
            raise AdaptexError(f"{self.path}: OpenVINO cannot load it ({str(e).strip().splitlines()[-1]})") from None
        self.request = self.compiled.create_infer_request()
        self._names = [o.get_any_name() for o in self.compiled.outputs]

    def _deactivate(self):
        self.compiled = self.request = None

    def input_metadata(self) -> dict[str, IOSpec]:
        return {n: IOSpec(n, s["dtype"], tuple(s["shape"])) for n, s in self.meta["inputs"].items()}

    def output_names(self) -> list[str]:
        self.activate()
        return list(self._names)

    def _infer(self, feeds):
        return dict(zip(self._names, self.run_raw(feeds)))

    def run_raw(self, feeds, names: list[str] | None = None):
        """Run without validation (timing loops): the outputs in `names`' order (default: the model's)."""
        result = self.request.infer({k: np.ascontiguousarray(v) for k, v in feeds.items()})
        by_name = {o.get_any_name(): result[o] for o in self.compiled.outputs}
        return [np.array(by_name[n], copy=True) for n in (names or self._names)]
