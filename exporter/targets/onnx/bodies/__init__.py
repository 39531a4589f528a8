"""ONNX function bodies of the adaptex ops (model-local functions, ONNX opset 20).

Each op becomes one custom-domain node (`adaptex.BudgetedAttention`) whose body ships in
`model.functions`; ONNX Runtime and TensorRT's parser inline it. Bodies are written node by node so
every op in them is a standard one a reader can check against the spec in docs/ops.md, with one
exception: ONNX Runtime's encoder body of ElasticAttention calls that runtime's own fused attention
kernel (com.microsoft.MultiHeadAttention), which TensorRT-bound bodies never do.

builder.py holds the node accumulator; one module per op body; schemas.py the ops' ONNX schemas.
"""
from adaptex.exporter.targets.onnx.bodies.budgeted import INPUTS, OUTPUTS, budgeted_attention_function
from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, MS_DOMAIN, ONNX_OPSET, OPSET_VERSION
from adaptex.exporter.targets.onnx.bodies.by_sample import large_batch
from adaptex.exporter.targets.onnx.bodies.conditional_attention import CA_INPUTS, conditional_attention_function
from adaptex.exporter.targets.onnx.bodies.conditional_ffn import CFFN_INPUTS, conditional_ffn_function
from adaptex.exporter.targets.onnx.bodies.elastic import (EA_INPUTS, ENCODER_SHARED, NEG, STEP_SHARED,
                                                          elastic_attention_function)
from adaptex.exporter.targets.onnx.bodies.elastic_step import elastic_step_function
from adaptex.exporter.targets.onnx.bodies.schemas import register_schema

__all__ = ["CA_INPUTS", "CFFN_INPUTS", "DOMAIN", "EA_INPUTS", "ENCODER_SHARED", "INPUTS", "MS_DOMAIN", "NEG",
           "ONNX_OPSET", "OPSET_VERSION", "OUTPUTS", "STEP_SHARED", "budgeted_attention_function",
           "conditional_attention_function", "conditional_ffn_function", "elastic_attention_function",
           "elastic_step_function", "large_batch", "register_schema"]
