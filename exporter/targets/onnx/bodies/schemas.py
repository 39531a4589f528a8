"""The adaptex ops' ONNX schemas, registered in this process only so onnxscript can emit the nodes."""
from __future__ import annotations

from adaptex.exporter.targets.onnx.bodies.budgeted import INPUTS
from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, OPSET_VERSION
from adaptex.exporter.targets.onnx.bodies.conditional_attention import CA_INPUTS
from adaptex.exporter.targets.onnx.bodies.conditional_ffn import CFFN_INPUTS
from adaptex.exporter.targets.onnx.bodies.elastic import EA_INPUTS, ENCODER_SHARED, STEP_SHARED


def register_schema() -> None:
    """Register the node's schema with onnx (in this process only) so onnxscript can emit it.

    Models never depend on it: the body ships as a function, which is what runtimes read."""
    from onnx import defs

    if all(defs.has(n, DOMAIN) for n in ("BudgetedAttention", "ConditionalFFN", "ConditionalAttention",
                                         "ElasticAttention")):
        return
    FP = defs.OpSchema.FormalParameter
    float_in = {"x", "w_qkv", "b_qkv", "w_o", "b_o"}
    schema = defs.OpSchema(
        "BudgetedAttention", DOMAIN, OPSET_VERSION,
        doc="Multi-head self-attention computing only the top-k heads; see docs/ops.md.",
        inputs=[FP(n, "T" if n in float_in else ("B" if n == "key_mask" else "F")) for n in INPUTS],
        outputs=[FP("y", "T"), FP("k", "I"), FP("head_mask", "B")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"),
                          ("F", ["tensor(float)"], "routing stays fp32"),
                          ("B", ["tensor(bool)"], ""), ("I", ["tensor(int64)"], "")],
        attributes=[defs.OpSchema.Attribute("num_heads", defs.OpSchema.AttrType.INT, "H")],
    )
    for new in (schema, _cffn_schema(FP), _ca_schema(FP), _ea_schema(FP)):
        if not defs.has(new.name, DOMAIN):
            defs.register_schema(new)


def _cffn_schema(FP):
    from onnx import defs

    return (defs.OpSchema(
        "ConditionalFFN", DOMAIN, OPSET_VERSION,
        doc="Pre-norm FFN residual update for the kept tokens only; see docs/ops.md.",
        inputs=[FP(n, "B" if n == "keep" else ("F" if n == "gate" else "T")) for n in CFFN_INPUTS],
        outputs=[FP("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"),
                          ("F", ["tensor(float)"], "routing stays fp32"), ("B", ["tensor(bool)"], "")],
        attributes=[defs.OpSchema.Attribute("eps", defs.OpSchema.AttrType.FLOAT, "LayerNorm epsilon")],
    ))


def _ca_schema(FP):
    from onnx import defs

    return (defs.OpSchema(
        "ConditionalAttention", DOMAIN, OPSET_VERSION,
        doc="Self-attention update for the kept tokens' queries only (every token's keys); see docs/ops.md.",
        inputs=[FP(n, "B" if n == "keep" else ("F" if n in ("gate", "bias") else "T")) for n in CA_INPUTS],
        outputs=[FP("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"),
                          ("F", ["tensor(float)"], "routing and mask stay fp32"), ("B", ["tensor(bool)"], "")],
        attributes=[defs.OpSchema.Attribute("num_heads", defs.OpSchema.AttrType.INT, "H")],
    ))


def _ea_schema(FP):
    from onnx import defs

    return (defs.OpSchema(
        "ElasticAttention", DOMAIN, OPSET_VERSION,
        doc="Every head of a layer, each full or streaming (sinks + local window); see docs/ops.md.",
        inputs=[FP(n, "B" if n in ("sa", "key_mask") else "T") for n in EA_INPUTS]
        + [FP(n, {"keys": "I"}.get(n, "F"), "a decode step's (STEP_SHARED)",
              param_option=defs.OpSchema.FormalParameterOption.Optional) for n in STEP_SHARED]
        + [FP(n, {"planes": "F", "first": "I"}.get(n, "B"), "an encoder's (ENCODER_SHARED)",
              param_option=defs.OpSchema.FormalParameterOption.Optional) for n in ENCODER_SHARED],
        outputs=[FP("o", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"), ("B", ["tensor(bool)"], ""),
                          ("I", ["tensor(int64)"], ""), ("F", ["tensor(float)"], "the padding bias stays fp32")],
        attributes=[defs.OpSchema.Attribute(n, defs.OpSchema.AttrType.INT, n) for n in ("sink", "window", "causal")],
    ))
