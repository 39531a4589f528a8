"""The kept-rows dispatch ConditionalFFN and ConditionalAttention share: every row masked, or the kept
rows gathered."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from adaptex.exporter.targets.onnx.bodies.builder import _Body


def _dispatch(b: _Body, keep: str, every, unchanged: str, some, prepare, share: float) -> str:
    """Run-time dispatch on the keep mask (ONNX Runtime): a call where some sample keeps at least
    `share` of its tokens (every token kept included: a decode step's kept block) runs `every()`
    (every row, the update masked: where gathering the kept rows costs more than computing the
    rest), one If deep; none kept returns `unchanged` (a decode step's skipped block) and a smaller
    mix runs `some()` (the gathered rows), both two Ifs deep. Each If a call passes through costs
    ONNX Runtime about 13 us at tsa-charlm's B1, T = 128, so the common prefill path goes through two
    (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts).

    ONNX Runtime (1.32, CPU) pre-packs a MatMul's constant weights when they are initializers of the
    graph the MatMul is in or of its parent, not of a graph further out (measured: ten 32x128x128
    MatMuls, 107 us one If deep, 129 us two deep, the same as with the weights fed as inputs). So
    `prepare()` runs in the branch that holds the mixed case and makes there the copies of the
    weights that `some()` reads (transposes of initializers, which fold to initializers of that
    branch at load): its MatMuls stay pre-packed, and a decode step keeps its single If.

    The condition is the largest of the samples' kept shares, reduced from the float mask: the
    fewest kernels a step runs before its If."""
    largest = b("ReduceMax", b("ReduceMean", b("Cast", keep, to=TensorProto.FLOAT), b.const([1]), keepdims=0),
                keepdims=0)

    def mixed() -> str:
        prepare()
        return some()

    def not_most() -> str:
        return b.if_(b("Equal", largest, b.const(0.0, np.float32)), lambda: unchanged, mixed)
    return b.if_(b("GreaterOrEqual", largest, b.const(share, np.float32)), every, not_most)


def _masked_gate(b: _Body, gate: str, keep: str) -> str:
    """keep * gate, (B, T), as one Where: the same values as Mul by the cast mask, one kernel fewer.
    A layer's attention and FFN bodies both make it; in a main graph ONNX Runtime merges the two, in
    the dense-dispatch branch the export does (passes.shared_subexpressions), and drops it there
    where the gate is already masked by the same keep, as TSA's router makes it (passes.masks_once)."""
    return b("Where", keep, gate, b.const(0.0, np.float32))


def _as_x(b: _Body, y: str, x: str) -> str:
    """y (the (B*T, d) rows, or already (B, T, d)) in x's shape. After a dispatch If, not inside its
    branch: an ONNX Runtime If copies a branch output that is a view of another value (a Reshape),
    where it hands a computed one (the ScatterND) out as it is. In a toy chain of ten Ifs over
    (1, T, 128), 8.8 us an If at T = 512 against 0.6
    (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts)."""
    return b("Reshape", y, b("Shape", x))
