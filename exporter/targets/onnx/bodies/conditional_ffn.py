"""adaptex.ConditionalFFN's body: the pre-norm FFN update for the kept tokens only."""
from __future__ import annotations

import onnx
from onnx import helper

from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, ONNX_OPSET, _Body, _name_output, _private
from adaptex.exporter.targets.onnx.bodies.kept import _as_x, _masked_gate


CFFN_INPUTS = ["x", "keep", "gate", "ln_w", "ln_b", "w1", "b1", "w2", "b2"]


def conditional_ffn_function(variant: str) -> onnx.FunctionProto:
    """The body of adaptex.ConditionalFFN: y = x + keep * gate * FFN(LayerNorm(x)).

    sparse: NonZero over the flattened keep mask, Gather of the kept tokens, LayerNormalization and
    two MatMuls on them only (none where no token is kept: the kernels run on zero rows), ScatterND
    (no reduction) of the updated rows back. dense: every token transformed, the update multiplied
    by keep * gate (static shapes). Every target takes the same sparse body: an If on the keep mask
    (nothing where none is kept, every row as it is where all are) cost ONNX Runtime more than it
    saved (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts)."""
    b = _Body("cf_")
    x, keep, gate, ln_w, ln_b, w1, b1, w2, b2 = CFFN_INPUTS
    # (in, out) weights: they fold to initializers at load, and MatMul + Add is the pattern ONNX
    # Runtime's fusions know (MatMul+Add, bias+Gelu)
    W = {"w1": b("Transpose", w1, perm=[1, 0]), "w2": b("Transpose", w2, perm=[1, 0])}

    def ffn(h_in: str) -> str:  # (..., d) -> (..., d)
        node = helper.make_node("LayerNormalization", [h_in, ln_w, ln_b], [f"cf_ln_{b.n + 1}"], axis=-1)
        # epsilon is the function's attribute `eps`, resolved at the call site
        node.attribute.append(onnx.AttributeProto(name="epsilon", ref_attr_name="eps", type=onnx.AttributeProto.FLOAT))
        b.n += 1
        b.nodes.append(node)
        u = b("Gelu", b("Add", b("MatMul", node.output[0], W["w1"]), b1))  # (..., f)
        return b("Add", b("MatMul", u, W["w2"]), b2)  # (..., d)

    def some() -> str:  # the kept rows only, as the (B*T, d) rows
        flat = b("Reshape", x, b("Concat", b.const([-1]), b("Shape", ln_w), axis=0))  # (B*T, d); folds at load
        gate_flat, kflat = b("Reshape", gate, b.const([-1])), b("Reshape", keep, b.const([-1]))
        # the kept rows as (1, K, d), not (K, d): on a 2-D input ONNX Runtime fuses MatMul + bias Add
        # into a Gemm, which leaves the Gelu unfused and runs slower than MatMul + BiasGelu, the
        # kernels the dense graph's FFN gets (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts)
        idx = b("NonZero", kflat)  # (1, K) int64: kept token rows
        xs = b("Gather", flat, idx, axis=0)  # (1, K, d)
        g = b("Unsqueeze", b("Gather", gate_flat, idx, axis=0), b.const([2]))  # (1, K, 1)
        new = b("Add", xs, b("Mul", ffn(xs), g))  # (1, K, d)
        return b("ScatterND", flat, b("Unsqueeze", idx, b.const([2])), new)  # (B*T, d); indices (1, K, 1)

    if variant == "dense":  # on x as it is: no reshape to rows, LayerNorm and MatMuls take (B, T, d)
        y = b("Add", x, b("Mul", ffn(x), b("Unsqueeze", _masked_gate(b, gate, keep), b.const([2]))))  # (B, T, d)
    else:
        y = _as_x(b, some(), x)
    _name_output(b, y, "y")
    return _private(helper.make_function(
        DOMAIN, "ConditionalFFN", CFFN_INPUTS, ["y"], b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["eps"],
        doc_string=f"adaptex::conditional_ffn, {variant} lowering (see docs/ops.md)",
    ))
