"""TensorRT target. Its lowerings are declared here; engine building lands with issue #6.

TensorRT cannot run on these machines (its wheels are download stubs), so until the
TensorRT-bound ONNX and its static checker exist, each cell raises UnsupportedLowering.
"""
from exporter.registry import unsupported

_WHY = ("the TensorRT lowering is not implemented yet (issue #6); TensorRT 10 parses the same "
        "ONNX function (TopK with a runtime int32 K). Export --target onnx meanwhile")

_WHY_FFN = ("the TensorRT lowering is not implemented yet (issue #6); TensorRT 10 parses NonZero only "
            "with an output allocator for its data-dependent shape. Export --target onnx meanwhile")

for _variant in ("sparse", "dense"):
    unsupported("adaptex::budgeted_attention", target="tensorrt", variant=_variant, reason=_WHY)
    unsupported("adaptex::conditional_ffn", target="tensorrt", variant=_variant, reason=_WHY_FFN)
