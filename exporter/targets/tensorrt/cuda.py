"""cuda-python, found lazily: the device count (0 without cuda-python, a driver or a GPU) and error
checks for its (error, *values) results."""
from __future__ import annotations

from adaptex.graphs.errors import AdaptexError


def cudart():
    try:
        from cuda.bindings import runtime  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart as runtime  # older cuda-python
        except ImportError:
            return None
    return runtime


def device_count() -> int:
    """CUDA devices visible through cuda-python (0 without cuda-python, a driver or a GPU)."""
    rt = cudart()
    if rt is None:
        return 0
    try:
        err, n = rt.cudaGetDeviceCount()
    except Exception:
        return 0
    return int(n) if err == rt.cudaError_t.cudaSuccess else 0


def check(result):
    """cuda-python calls return (error, *values): raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    rt = cudart()
    if err != rt.cudaError_t.cudaSuccess:
        raise AdaptexError(f"CUDA call failed: {rt.cudaGetErrorString(err)[1].decode()}")
    return values[0] if len(values) == 1 else values
