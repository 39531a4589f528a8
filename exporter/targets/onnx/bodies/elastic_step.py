"""adaptex.ElasticAttention's decode-step body (ONNX Runtime): one causal query per pair after a cache."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, ONNX_OPSET, _Body, _private
from adaptex.exporter.targets.onnx.bodies.elastic import EA_INPUTS, STEP_SHARED
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy


def elastic_step_function(head_dim: int | None = None, policy: OrtPolicy = DEFAULT) -> onnx.FunctionProto:
    """adaptex.ElasticAttention for a call the exporter traced as a decode step (ONNX Runtime): one
    causal query per pair (T = 1) after a non-empty cache (docs/ops.md). A layer whose pairs are
    all FA attends every key; all SA, only the sinks and the window of the cache (a Gather of those
    positions, L <= sink + window); a mix, every pair over every key with an SA pair's far keys masked while the cache holds at
    most policy.mixed_step_masked_up_to floats, else each mode's pairs over their own keys. The inputs after EA_INPUTS
    (STEP_SHARED) come from the graph, once for every layer: computed in the body, they ran once per
    layer, since ONNX Runtime's common-subexpression elimination does not run inside the decode-step
    If branch (exporter/targets/onnx/dispatch.py). It serves the decode-step program only: the general
    body takes every other call (exporter/targets/onnx/dispatch.py). head_dim: the calls' dh where
    tracing fixed it, so the score scale is a constant (else read from q's shape: four kernels a
    layer)."""
    b = _Body("eas_", policy)
    q, k, v, sa, _ = EA_INPUTS
    keys, bias, bias_sa, bias_far = STEP_SHARED
    zero = b.const(0.0, np.float32)
    if head_dim:
        scale = b.const(1.0 / np.sqrt(head_dim), np.float32)
    else:
        scale = b("Reciprocal", b("Sqrt", b("Cast", b("Shape", q, start=3, end=4), to=TensorProto.FLOAT)))
    qs = b("Mul", q, scale)  # (B, H, 1, dh)

    def attend(qx: str, kx: str, vx: str, bx: str, perm=(0, 1, 3, 2)) -> str:
        scores = b("Add", b("MatMul", qx, b("Transpose", kx, perm=list(perm))), bx)
        return b("MatMul", b("Softmax", scores, axis=-1), vx)

    def every_sa() -> str:
        return attend(qs, b("Gather", k, keys, axis=2), b("Gather", v, keys, axis=2), bias_sa)

    def masked() -> str:  # every pair over every key, an SA pair's keys outside sinks and window hidden
        return attend(qs, k, v, b("Where", b("Unsqueeze", sa, b.const([2, 3])), bias_far, bias))  # (B, H, 1, S)

    def by_pairs() -> str:  # FA pairs over every key, SA pairs over their sinks and window
        cm1 = b.const([-1])
        H = b("Shape", q, start=1, end=2)
        dh1 = b("Shape", q, start=3, end=4)
        qf = b("Reshape", qs, b("Concat", cm1, b.const([1]), dh1, axis=0))  # (BH, 1, dh)
        modes = b("Reshape", sa, cm1)  # (BH,)
        out = b("Mul", qf, zero)
        for pick, kk, vv, bb in ((b("Not", modes), k, v, bias), (modes, None, None, bias_sa)):
            if kk is None:
                kk, vv = b("Gather", k, keys, axis=2), b("Gather", v, keys, axis=2)
            idx = b("Transpose", b("NonZero", pick), perm=[1, 0])  # (N, 1)
            rows = b("Squeeze", idx, b.const([1]))
            L1 = b("Shape", kk, start=2, end=3)
            kx, vx = (b("Gather", b("Reshape", t, b("Concat", cm1, L1, dh1, axis=0)), rows, axis=0) for t in (kk, vv))
            bx = b("Gather", b("Squeeze", bb, b.const([1])), b("Div", rows, H), axis=0)  # (N, 1, L): the pair's sample's
            out = b("ScatterND", out, idx, attend(b("Gather", qf, rows, axis=0), kx, vx, bx, perm=(0, 2, 1)))
        return b("Reshape", out, b("Shape", q))

    def mixed() -> str:
        small = b("LessOrEqual", b("Size", k), b.const(policy.mixed_step_masked_up_to))
        return b.if_(small, masked, by_pairs)

    # every pair SA first: the common case where the routers were trained for a high SA share (one If)
    n_sa = b("ReduceSum", b("Cast", sa, to=TensorProto.INT64), keepdims=0)
    out = b.if_(b("Equal", n_sa, b("Size", sa)), every_sa,
                lambda: b.if_(b("Equal", n_sa, b.const(0)), lambda: attend(qs, k, v, bias), mixed))
    b.nodes.append(helper.make_node("Identity", [out], ["o"]))
    return _private(helper.make_function(
        DOMAIN, "ElasticAttention", EA_INPUTS + STEP_SHARED, ["o"], b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["sink", "window", "causal"],
        doc_string="adaptex::elastic_attention, sparse lowering of a decode step (see docs/ops.md)",
    ))
