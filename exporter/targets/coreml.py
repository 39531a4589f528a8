"""Core ML target (mlprogram). Its lowerings are declared here; the conversion lands with issue #3.

Every cell is registered explicitly so the op x target matrix has no empty cell: until the MIL
translation exists each one raises UnsupportedLowering with the reason below.
"""
from exporter.registry import unsupported

_WHY = ("the Core ML lowering is not implemented yet (issue #3); MIL topk takes only a constant k, "
        "so dynamic k needs argsort + slice_by_index + gather. Export --target onnx meanwhile")

for _variant in ("sparse", "dense"):
    unsupported("adaptex::budgeted_attention", target="coreml", variant=_variant, reason=_WHY)
