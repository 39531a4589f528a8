"""Quantized Core ML packages: a converted ML program's weights stored in 8 bits, or palettized to 4
or 6 bits, through coremltools.optimize.coreml, the routers' weights left float unless asked.

- int8: linear_quantize_weights, symmetric, one scale per output channel (the weight's first axis),
  written as constexpr_affine_dequantize (iOS16/17) or constexpr_blockwise_shift_scale (iOS18);
- palettize4 / palettize6: palettize_weights, k-means, a lookup table of 16 / 64 values per tensor
  (iOS16/17), or per GROUP output channels (iOS18, macOS15), written as constexpr_lut_to_dense.

Core ML expands the weights when it loads the package; the ops compute at the package's precision
(fp16 or fp32) as before. So the saving is size on disk and in the app bundle, not arithmetic.

What stays float: vectors and tensors of fewer than MIN_ELEMENTS values (biases, norms, the op bodies'
per-head vectors: under 1 KB each), and every weight a routing op reads (an op whose name or result
carries the route_ prefix, precision.py) unless `routers`: a router's score near its boundary flips
under weight noise, and a flip changes the work and the output (docs/quantization.md).
"""
from __future__ import annotations

import numpy as np

from adaptex.exporter.errors import ExportError
from adaptex.exporter.quantize import Scheme
from adaptex.exporter.quantize import scheme_option as _scheme_option

SCHEMES = ("int8", "palettize4", "palettize6")
MIN_ELEMENTS = 256
# iOS18 / macOS15 packages take a lookup table per group of output channels (iOS18's
# constexpr_lut_to_dense); older targets one table per tensor
GROUPED_TARGETS = ("iOS18", "macOS15")
GROUP = 16
ROUTE = "route_"
_COMPRESSED = ("constexpr_affine_dequantize", "constexpr_blockwise_shift_scale", "constexpr_lut_to_dense")


def scheme_option(value, routers=None) -> Scheme | None:
    return _scheme_option(value, routers, "coreml", SCHEMES)


def _float_consts(program) -> list:
    return [op for op in program.functions["main"].operations if op.op_type == "const"
            and isinstance(op.outputs[0].val, np.ndarray) and op.outputs[0].val.dtype.kind == "f"]


def _read_by_routing(const) -> bool:
    return any(c.name.startswith(ROUTE) or any(v.name.startswith(ROUTE) for v in c.outputs)
               for c in const.outputs[0].child_ops)


def quantize(mlmodel, scheme: Scheme, min_target: str):
    """(the compressed MLModel, the metadata's "quantize" record)."""
    import coremltools.optimize.coreml as cto

    from adaptex.exporter.targets.coreml.convert import quiet_progress

    consts = _float_consts(mlmodel._mil_program)
    routers = sorted(op.name for op in consts if _read_by_routing(op))
    small = [op.name for op in consts if op.outputs[0].val.ndim < 2 or op.outputs[0].val.size < MIN_ELEMENTS]
    left = {name: None for name in small + ([] if scheme.routers else routers)}
    if scheme.name == "int8":
        op_config = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                                weight_threshold=MIN_ELEMENTS)
        compress, how = cto.linear_quantize_weights, "int8 symmetric, one scale per output channel"
    elif min_target in GROUPED_TARGETS:
        op_config = cto.OpPalettizerConfig(mode="kmeans", nbits=scheme.bits, granularity="per_grouped_channel",
                                           group_size=GROUP, weight_threshold=MIN_ELEMENTS)
        compress = cto.palettize_weights
        how = f"{scheme.bits}-bit k-means lookup table of {2 ** scheme.bits} values per {GROUP} output channels"
    else:
        op_config = cto.OpPalettizerConfig(mode="kmeans", nbits=scheme.bits, granularity="per_tensor",
                                           weight_threshold=MIN_ELEMENTS)
        compress = cto.palettize_weights
        how = f"{scheme.bits}-bit k-means lookup table of {2 ** scheme.bits} values per tensor"
    with quiet_progress():
        out = compress(mlmodel, cto.OptimizationConfig(global_config=op_config, op_name_configs=left))
    ops = out._mil_program.functions["main"].operations
    compressed = [op for op in ops if op.op_type in _COMPRESSED]
    if not compressed:
        raise ExportError(f"--quantize {scheme.name}: this model has no weight of {MIN_ELEMENTS} values or more "
                          "outside its routers to quantize")
    leaked = [op.name for op in compressed if _read_by_routing(op)]
    if leaked and not scheme.routers:  # a router weight must never be compressed silently
        raise ExportError(f"--quantize {scheme.name}: coremltools compressed weights a router reads ({leaked[:3]}); "
                          "this is a bug in adaptex, please report it")
    return out, {
        "scheme": scheme.name, "bits": scheme.bits, "weights": how,
        "activations": "float, at the package's precision (Core ML expands the weights when it loads the package)",
        "kernels": sorted({op.op_type for op in compressed}),
        "routers": "quantized" if scheme.routers else "fp32",
        "quantized": {"tensors": len(compressed),
                      "values": int(sum(np.prod(op.outputs[0].shape) for op in compressed))},
        "fp32_routers": [] if scheme.routers else routers,
        "fp32_other_tensors": len(small),
    }
