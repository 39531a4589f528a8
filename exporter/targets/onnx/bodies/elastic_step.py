"""adaptex.ElasticAttention's decode-step body (ONNX Runtime): one causal query per pair after a cache."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, ONNX_OPSET, _Body, _private
from adaptex.exporter.targets.onnx.bodies.elastic import EA_INPUTS, STEP_SHARED


# A decode step's mixed layer (some pairs FA, some SA) attends every pair over every key, the SA
# pairs' keys outside their sinks and window masked, while its cache holds at most this many floats
# (B*H*S*dh); past it, the pairs are gathered by mode and each reads only its own keys. Measured on
# elastic-charlm (docs/benchmarking.md#decode-steps): masking ran 0.92 of gathering after 511 cached
# tokens at B1 (65,536 floats); with the step's shared positions computed once (2026-12-04), 0.965
# after 2047 (2^18 floats), 0.971 at B2 after 2047 and 0.986 at B8 after 511 (2^19), about even at
# 2^21 (B8 after 2047 1.00, B16 after 1023 1.02) and 2^22 (B64 after 511 1.00).
MIXED_STEP_MASKED_UP_TO = 1 << 20


# A decode step whose cache holds at most this many times sink + window keys runs the near-cache step
# program (export: dispatch.merge_decode_step with near_keys): every layer attends every key, an SA
# pair's keys outside its sinks and window masked, with no If and no count of its modes. Measured on
# elastic-charlm (sink + window = 68; docs/benchmarking.md#decode-steps), against the step program,
# both as sessions of their own: 0.93 at B1, B8 and 0.96 at B64 after 127 cached tokens; after 255,
# 0.99 at B1 but 1.07 at B8 and 1.15 at B64, where every key costs more than the Ifs (at B64 after
# 127 too once the runner read the programs' weights directly: NEAR_STEP_KEYS_CELLS).
NEAR_STEP_KEYS = 2
# ... while its batch x keys is at most this many times sink + window: at larger batches the masked
# keys' Softmax and the scaled score MatMul cost more than the step program's gathers and Ifs.
# Measured (2026-12-05, ninth session, elastic-charlm, `examples/compare_artifacts.py` with real
# routing, the near program's time 1.000): the step program 0.950 at B64 after 127 cached tokens
# (8,192 cells), 0.959 at B32 after 127 (4,096), 0.965 at B64 after 100 (6,464); 1.051 at B64
# after 63 (4,096), 1.046 at B16 after 127 (2,048) and 1.063 at B8. 64 x 68 = 4,352 cells keeps
# the near program to B64 after 67 and B32 after 135: B32 after 127 stays with it (4,096 cells, as
# many as B64 after 63, where the near program wins), so a cells bound alone cannot take both.
# An artifact exported without the softmax floor has no such bound: on a CPU whose Softmax takes
# masked scores at full speed the near program wins at every batch (2026-12-06, nineteenth session, an
# AMD EPYC with AVX-512, elastic-charlm, `examples/compare_artifacts.py`, the file with the bound at
# 1.000, a copy of it within [0.979, 1.017]): 0.924 at B64 after 127, 0.941 at B64 after 100, 0.913
# at B64 after 135, 0.894 at B128 after 127, 0.832 at B256 after 100.
NEAR_STEP_KEYS_CELLS = 64
# A step whose batch x keys (the attention mask's cells) is at most this many times sink + window runs
# the near-cache program too, whatever its cache (elastic-charlm: 408, B1 after up to 407 cached
# tokens, B2 after 203): there the step program's Ifs and mode counts cost more than the keys a
# masked SA pair reads in vain. Measured (2026-12-05, elastic-charlm, the two programs as the runner
# makes them, in the same rounds, one FA layer and five SA as its routers choose, the step program's
# time 1.000): 0.953 at B1 after 191 cached tokens, 0.988 after 255, 1.005 after 319, 1.028 after
# 383, 1.049 after 447, 1.097 after 511; 0.953 at B2 after 159, 0.975 and 0.982 after 191. (8,
# measured before the runner read the programs' weights directly: 0.927 after 255, 1.00 after 511
# and 767, and at B2 0.950 after 255, 1.03 after 511.)
NEAR_STEP_CELLS = 6
# ... or this many, in an artifact exported without the softmax floor (--softmax-floor off: for a CPU
# whose Softmax takes masked scores at full speed). Part of what the near program's masked keys cost
# above is Softmax's exp on them through subnormal floats (docs/benchmarking.md#decode-steps); where
# that is free, the near program wins over more keys.
# Measured (2026-12-06, nineteenth session, an AMD EPYC with AVX-512, elastic-charlm exported with the
# floor off, `examples/compare_artifacts.py`, the file with the step program at 1.000, a copy of it
# within [0.949, 1.041]): the near program 0.938 and 0.950 at B1 after 511 cached tokens (512 cells),
# 0.978 after 767, 0.991 after 1023; 0.920 at B2 after 255, 0.950 after 383, 0.985 after 511; 0.913
# at B4 after 191; 1.072 at B8 after 511 (4,096 cells). 12 x 68 = 816 cells keeps the wins.
NEAR_STEP_CELLS_UNFLOORED = 12


def elastic_step_function(head_dim: int | None = None, near: bool = False) -> onnx.FunctionProto:
    """adaptex.ElasticAttention for a call the exporter traced as a decode step (ONNX Runtime): one
    causal query per pair (T = 1) after a non-empty cache (docs/ops.md). A layer whose pairs are
    all FA attends every key; all SA, only the sinks and the window of the cache (a Gather of those
    positions, L <= sink + window); a mix, see MIXED_STEP_MASKED_UP_TO. The inputs after EA_INPUTS
    (STEP_SHARED) come from the graph, once for every layer: computed in the body, they ran once per
    layer, since ONNX Runtime's common-subexpression elimination does not run inside the decode-step
    If branch (exporter/targets/onnx/dispatch.py). It serves the decode-step program only: the general
    body takes every other call (exporter/targets/onnx/dispatch.py). head_dim: the calls' dh where
    tracing fixed it, so the score scale is a constant (else read from q's shape: four kernels a
    layer). near: the body of the near-cache step program (NEAR_STEP_KEYS): every pair over every
    key, masked."""
    b = _Body("eas_")
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
        small = b("LessOrEqual", b("Size", k), b.const(MIXED_STEP_MASKED_UP_TO))
        return b.if_(small, masked, by_pairs)

    if near:
        out = masked()
    else:  # every pair SA first: the common case where the routers were trained for a high SA share (one If)
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
