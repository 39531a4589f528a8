"""Running TensorRT engines (TensorRT 10 Python API + cuda-python), for parity and latency.

The engine is deserialised once; each call sets the input shapes, copies the inputs to the device,
runs `execute_async_v3` on a private stream between two CUDA events (the device time of the last
call is `last_ms`), and copies the outputs back. Outputs whose shape is only known at run time
(-1 in the context's shape after the inputs are set) get an IOutputAllocator, as TensorRT requires
for data-dependent shapes. The engine's metadata comes from `<plan>.json`, written beside it.

Written against TensorRT 10's documented API and cuda-python's `cuda.bindings.runtime`; it has not
run on these machines, which have neither a GPU nor TensorRT (docs/tensorrt.md).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from adaptex.exporter.targets.tensorrt.cuda import check as _check
from adaptex.exporter.targets.tensorrt.cuda import cudart as _cudart
from adaptex.exporter.targets.tensorrt.cuda import device_count as cuda_device_count
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.base import IOSpec, Runner, limits_of


def read_plan_meta(path: str | Path) -> dict:
    from adaptex.exporter.targets.tensorrt import read_plan_meta as read

    return read(path)


class TensorRTRunner(Runner):
    name = "tensorrt"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = read_plan_meta(self.path)
        super().__init__(limits_of(self.meta))
        self.last_ms: float | None = None

    def input_metadata(self) -> dict[str, IOSpec]:
        return {n: IOSpec(n, s["dtype"], tuple(s["shape"])) for n, s in self.meta["inputs"].items()}

    def _activate(self):
        try:
            import tensorrt as trt
        except Exception:
            raise AdaptexError("running a TensorRT engine needs the tensorrt package and an NVIDIA GPU; "
                               "check the TensorRT-bound ONNX in ONNX Runtime instead (adaptex check model.onnx)") from None
        if cuda_device_count() < 1:
            raise AdaptexError("running a TensorRT engine needs a CUDA device and none is visible "
                               "(install cuda-python, check the driver)")
        self.trt = trt
        self.cudart = _cudart()
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise AdaptexError(f"{self.path}: TensorRT could not deserialise the engine (built by another "
                               f"TensorRT version than {trt.__version__}?); rebuild it on this machine")
        self.context = self.engine.create_execution_context()
        self.stream = _check(self.cudart.cudaStreamCreate())
        self.events = (_check(self.cudart.cudaEventCreate()), _check(self.cudart.cudaEventCreate()))
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def _deactivate(self):
        for ev in getattr(self, "events", ()):
            self.cudart.cudaEventDestroy(ev)
        if getattr(self, "stream", None) is not None:
            self.cudart.cudaStreamDestroy(self.stream)
        self.context = self.engine = None

    def output_names(self) -> list[str]:
        self.activate()
        return list(self.outputs)

    def profile_bounds(self, name: str) -> str:
        """'min [..], opt [..], max [..]' of an input in profile 0, for error messages."""
        try:
            lo, mid, hi = self.engine.get_tensor_profile_shape(name, 0)
            return f"min {list(lo)}, opt {list(mid)}, max {list(hi)}"
        except Exception:
            return str((self.meta.get("tensorrt") or {}).get("profile", "(unknown)"))

    def _infer(self, feeds):
        trt, cudart, ctx = self.trt, self.cudart, self.context
        owned, dynamic = [], {}
        try:
            for name, a in feeds.items():
                a = np.ascontiguousarray(a)
                if not ctx.set_input_shape(name, tuple(a.shape)):
                    raise AdaptexError(f"{name}: shape {list(a.shape)} is outside the engine's optimization profile "
                                       f"{self.profile_bounds(name)}; rebuild with wider --min/--max-shapes")
                ptr = _check(cudart.cudaMalloc(max(a.nbytes, 1)))
                owned.append(ptr)
                if a.nbytes:
                    _check(cudart.cudaMemcpyAsync(ptr, a.ctypes.data, a.nbytes,
                                                  cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))
                if not ctx.set_tensor_address(name, ptr):
                    raise AdaptexError(f"{name}: TensorRT refused its device address (the engine has no such "
                                       "input, or a misaligned buffer); rebuild the engine")
            static = {}
            for name in self.outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
                if any(d < 0 for d in shape):  # a data-dependent shape: TensorRT sizes it during the run
                    alloc = _OutputAllocator(trt, cudart)
                    ctx.set_output_allocator(name, alloc)
                    dynamic[name] = (alloc, dtype)
                else:
                    ptr = _check(cudart.cudaMalloc(max(int(np.prod(shape)) * dtype.itemsize, 1)))
                    owned.append(ptr)
                    if not ctx.set_tensor_address(name, ptr):
                        raise AdaptexError(f"{name}: TensorRT refused the output's device address; rebuild the engine")
                    static[name] = (ptr, shape, dtype)
            _check(cudart.cudaEventRecord(self.events[0], self.stream))
            if not ctx.execute_async_v3(self.stream):
                raise AdaptexError("TensorRT's execute_async_v3 failed (its log says why)")
            _check(cudart.cudaEventRecord(self.events[1], self.stream))
            _check(cudart.cudaStreamSynchronize(self.stream))  # data-dependent shapes are known from here
            self.last_ms = float(_check(cudart.cudaEventElapsedTime(*self.events)))
            out = {name: self._fetch(ptr, shape, dtype) for name, (ptr, shape, dtype) in static.items()}
            out.update({name: self._fetch(alloc.ptr, alloc.shape, dtype) for name, (alloc, dtype) in dynamic.items()})
            return out
        finally:
            for ptr in owned:
                cudart.cudaFree(ptr)
            for alloc, _ in dynamic.values():
                alloc.free()

    def _fetch(self, ptr, shape, dtype) -> np.ndarray:
        host = np.empty(shape, dtype)
        if host.nbytes:
            _check(self.cudart.cudaMemcpy(host.ctypes.data, ptr, host.nbytes,
                                          self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return host

    def run_raw(self, feeds):
        return self._infer(feeds)


class _OutputAllocator:
    """An IOutputAllocator for one data-dependent output: grows a device buffer on request and keeps
    the shape TensorRT reports. Built lazily as a subclass of trt.IOutputAllocator."""

    def __new__(cls, trt, cudart):
        class Allocator(trt.IOutputAllocator):
            def __init__(self):
                trt.IOutputAllocator.__init__(self)
                self.ptr, self.size, self.shape = None, 0, None

            def reallocate_output_async(self, tensor_name, memory, size, alignment, stream):
                if size > self.size:
                    self.free()
                    self.ptr = _check(cudart.cudaMalloc(max(size, 1)))
                    self.size = size
                return self.ptr

            def reallocate_output(self, tensor_name, memory, size, alignment):  # TensorRT < 10.x fallback
                return self.reallocate_output_async(tensor_name, memory, size, alignment, None)

            def notify_shape(self, tensor_name, shape):
                self.shape = tuple(shape)

            def free(self):
                if self.ptr is not None:
                    cudart.cudaFree(self.ptr)
                    self.ptr, self.size = None, 0

        return Allocator()
