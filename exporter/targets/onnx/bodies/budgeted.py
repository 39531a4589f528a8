"""adaptex.BudgetedAttention's body: top-k heads, sparse or dense."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from adaptex.graphs.ops.budgeted_attention import group_ratio
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, ONNX_OPSET, _Body, _private


def _routing(b: _Body, s: str, p: str, full_order: bool):
    """k = clamp(floor(s*H), 1, H) and the top-k order of p. fp32 throughout: a decision computed in
    lower precision could land on the other side of an integer or swap a near-tie."""
    H = b.attr_int("num_heads")  # int64 scalar
    H1 = b("Unsqueeze", H, b.const([0]))  # (1,)
    Hf = b("Cast", H, to=TensorProto.FLOAT)
    sH = b("Mul", s, Hf)  # (B,)
    kf = b("Clip", b("Floor", sH), b.const(1.0, np.float32), Hf)
    k = b("Cast", kf, to=TensorProto.INT64)  # (B,)
    K = H1 if full_order else b("ReduceMax", k, keepdims=1)  # (1,) heads to rank
    topv, order = b("TopK", p, K, axis=-1, largest=1, sorted=1, outputs=2)  # (B, K); ties -> lower index
    j = b("Range", b.const(0), b("Squeeze", K), b.const(1))  # (K,)
    valid = b("Less", b("Unsqueeze", j, b.const([0])), b("Unsqueeze", k, b.const([1])))  # (B, K)
    valid_f = b("Cast", valid, to=TensorProto.FLOAT)
    zeros = b("Mul", p, b.const(0.0, np.float32))  # (B, H)
    mask_f = b("ScatterElements", zeros, order, valid_f, axis=1)  # (B, H)
    return H1, sH, k, topv, order, valid_f, mask_f


def _head_weights(b: _Body, sH: str, p: str, mask_f: str) -> str:
    """w_h = s*H*p_h on a sample's selected heads, 0 on the others: (B, H)."""
    return b("Mul", b("Mul", b("Unsqueeze", sH, b.const([1])), p), mask_f)


def _key_bias(b: _Body, key_mask: str) -> str:
    """0 on a real key, -inf on a padded one: (B, T)."""
    return b("Where", key_mask, b.const(0.0, np.float32), b.const(-np.inf, np.float32))


def _score_scale(b: _Body, dh1: str) -> str:
    """1 / sqrt(dh) from the (1,) head width: (1,)."""
    return b("Reciprocal", b("Sqrt", b("Cast", dh1, to=TensorProto.FLOAT)))


def _attend(b: _Body, q: str, kk: str, v: str, key_mask: str) -> str:
    """Scaled dot-product attention over (B, K, T, dh) with padded keys ignored."""
    dh = b("Cast", b("Shape", q, start=-1), to=TensorProto.FLOAT)  # (1,)
    q = b("Mul", q, b("Reciprocal", b("Sqrt", dh)))
    scores = b("MatMul", q, b("Transpose", kk, perm=[0, 1, 3, 2]))  # (B, K, T, T)
    bias = _key_bias(b, key_mask)  # (B, T)
    bias = b("Unsqueeze", bias, b.const([1, 2]))  # (B, 1, 1, T)
    attn = b("Softmax", b("Add", scores, bias), axis=-1)
    return b("MatMul", attn, v)  # (B, K, T, dh)


def _split3(b: _Body, qkv: str):
    parts = b("Split", qkv, axis=0, num_outputs=3, outputs=3)  # each (1, B, K, T, dh)
    return [b("Squeeze", t, b.const([0])) for t in parts]


INPUTS = ["x", "key_mask", "s", "p", "w_qkv", "b_qkv", "w_o", "b_o"]
OUTPUTS = ["y", "k", "head_mask"]


def budgeted_attention_function(variant: str, grouped_heads: int | None = None,
                                policy: OrtPolicy = DEFAULT) -> onnx.FunctionProto:
    """The body of adaptex.BudgetedAttention for `variant` ("sparse" or "dense").

    sparse: TopK with the batch's largest k as K, the selected heads' weights gathered per sample,
    attention on K heads for every sample (heads past a sample's own k weighted by zero). With
    `grouped_heads` = H (ONNX Runtime; the body then serves calls with H heads only and ships as the
    function overload `heads{H}`), If branches choose one of three bodies by the batch's decisions
    (graphs/ops/budgeted_attention.py, onnx_body, states the rule):
    - active heads: every sample through each head some sample selected, the A heads' weights
      gathered once, their projections one batched MatMul over the batch's B x T rows, (A, B, T, T)
      scores, one output projection summing the heads (unselected pairs weighted by zero), for a
      batch of more than one sample where that wastes at most policy.active_heads_waste_rows token rows;
    - by head: a batch whose k differ (mean k < GROUP_BELOW x the largest), for each of the H heads
      the samples that selected it gathered and run through that head's own weights, so the batch
      computes sum_b k_b head-samples rather than B x max_b k_b, and every projection reads a
      constant weight slice (ONNX Runtime pre-packs those; the per-sample gathered weights above run
      at about half the rate);
    - per sample (above), otherwise."""
    b = _Body("ba_", policy)
    x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o = INPUTS
    H1, sH, k, topv, order, valid_f, mask_f = _routing(b, s, p, full_order=(variant == "dense"))
    d1 = b("Shape", w_o, start=0, end=1)  # (1,) = [d]
    c3, c1, cm1, c0 = b.const([3]), b.const([1]), b.const([-1]), b.const([0])
    if variant == "sparse":
        dh1 = b("Div", d1, H1)  # (1,) = [dh]
        # Head-major weights (folded to constants in ONNX Runtime, outside any If): each head's Q, K
        # and V come out of one MatMul already in attention layout (no transposes of activations).
        w_h = b("Transpose", w_qkv, perm=[1, 0])  # (d, 3d)
        w_h = b("Reshape", w_h, b("Concat", d1, c3, H1, dh1, axis=0))  # (d, 3, H, dh)
        w_h = b("Transpose", w_h, perm=[2, 0, 1, 3])  # (H, d, 3, dh)
        w_h = b("Reshape", w_h, b("Concat", H1, d1, cm1, axis=0))  # (H, d, 3*dh)
        b_h = b("Transpose", b("Reshape", b_qkv, b("Concat", c3, H1, dh1, axis=0)), perm=[1, 0, 2])  # (H, 3, dh)
        b_h = b("Reshape", b_h, b("Concat", H1, c1, cm1, axis=0))  # (H, 1, 3*dh)
        wo_h = b("Reshape", b("Transpose", w_o, perm=[1, 0]), b("Concat", H1, cm1, d1, axis=0))  # (H, dh, d)

        def per_sample() -> str:  # the selected heads' weights gathered per sample, K = max_b k_b heads each
            wg = b("Gather", w_h, order, axis=0)  # (B, K, d, 3*dh)
            bg = b("Gather", b_h, order, axis=0)  # (B, K, 1, 3*dh)
            qkv = b("Add", b("MatMul", b("Unsqueeze", x, b.const([1])), wg), bg)  # (B, K, T, 3*dh)
            weights = b("Mul", b("Mul", topv, b("Unsqueeze", sH, b.const([1]))), valid_f)  # (B, K)
            q, kk, v = b("Split", qkv, axis=-1, num_outputs=3, outputs=3)  # (B, K, T, dh) each
            o = b("Mul", _attend(b, q, kk, v, key_mask), b("Unsqueeze", weights, b.const([2, 3])))
            o = b("Reshape", b("Transpose", o, perm=[0, 2, 1, 3]), b.const([0, 0, -1]))  # (B, T, K*dh)
            wo = b("Reshape", b("Gather", wo_h, order, axis=0), b("Concat", c0, cm1, d1, axis=0))  # (B, K*dh, d)
            return b("Add", b("MatMul", o, wo), b_o)  # (B, T, d)

        if grouped_heads is None:
            y = per_sample()
        else:
            def by_head() -> str:  # each head on the samples that selected it: sum_b k_b head-samples
                wts = _head_weights(b, sH, p, mask_f)  # (B, H)
                chosen = b("Greater", mask_f, b.const(0.0, np.float32))  # (B, H)
                scale = _score_scale(b, dh1)  # (1,)
                bias = _key_bias(b, key_mask)  # (B, T)
                bias = b("Unsqueeze", bias, b.const([1]))  # (B, 1, T)
                y = b("Add", b("Mul", x, b.const(0.0, np.float32)), b_o)  # (B, T, d)
                for h in range(grouped_heads):  # an empty group runs its nodes on zero rows
                    hc = b.const(h)
                    rows = b("Squeeze", b("NonZero", b("Gather", chosen, hc, axis=1)), b.const([0]))  # (n,)
                    qkv = b("Add", b("MatMul", b("Gather", x, rows, axis=0), b("Gather", w_h, hc, axis=0)),
                            b("Gather", b_h, hc, axis=0))  # (n, T, 3*dh): a constant weight slice
                    q, kk, v = b("Split", qkv, axis=-1, num_outputs=3, outputs=3)  # (n, T, dh) each
                    scores = b("MatMul", b("Mul", q, scale), b("Transpose", kk, perm=[0, 2, 1]))  # (n, T, T)
                    attn = b("Softmax", b("Add", scores, b("Gather", bias, rows, axis=0)), axis=-1)
                    w = b("Unsqueeze", b("Gather", b("Gather", wts, hc, axis=1), rows, axis=0), b.const([1, 2]))
                    u = b("MatMul", b("Mul", b("MatMul", attn, v), w), b("Gather", wo_h, hc, axis=0))  # (n, T, d)
                    # one scatter a head, whose indices never repeat: ONNX Runtime 1.32's ScatterND with
                    # reduction="add" races on repeated indices at 2 threads or more (docs/benchmarking.md)
                    y = b("ScatterND", y, b("Unsqueeze", rows, b.const([1])), u, reduction="add")
                return y

            def by_active_heads(active: str) -> str:  # each sample on every head some sample selected: B x A pairs
                wts = _head_weights(b, sH, p, mask_f)  # (B, H), 0 unselected
                heads = b("Squeeze", b("NonZero", active), b.const([0]))  # (A,)
                rows = b("Reshape", x, b("Concat", c1, cm1, d1, axis=0))  # (1, B*T, d)
                qkv = b("Add", b("MatMul", rows, b("Gather", w_h, heads, axis=0)),
                        b("Gather", b_h, heads, axis=0))  # (A, B*T, 3*dh): each head over every row
                qkv = b("Reshape", qkv, b("Concat", c0, b("Shape", x, start=0, end=2), cm1, axis=0))  # (A, B, T, 3*dh)
                q, kk, v = b("Split", qkv, axis=-1, num_outputs=3, outputs=3)  # (A, B, T, dh) each
                scale = _score_scale(b, dh1)  # (1,)
                scores = b("MatMul", b("Mul", q, scale), b("Transpose", kk, perm=[0, 1, 3, 2]))  # (A, B, T, T)
                bias = _key_bias(b, key_mask)  # (B, T)
                attn = b("Softmax", b("Add", scores, b("Unsqueeze", bias, b.const([1]))), axis=-1)
                w = b("Unsqueeze", b("Transpose", b("Gather", wts, heads, axis=1), perm=[1, 0]), b.const([2, 3]))
                o = b("Transpose", b("Mul", b("MatMul", attn, v), w), perm=[1, 2, 0, 3])  # (B, T, A, dh)
                o = b("Reshape", o, b("Concat", c0, c0, cm1, axis=0))  # (B, T, A*dh)
                wo = b("Reshape", b("Gather", wo_h, heads, axis=0), b("Concat", cm1, d1, axis=0))  # (A*dh, d)
                return b("Add", b("MatMul", o, wo), b_o)  # (B, T, d): the heads summed by the product

            def choose() -> str:  # a batch of more than one sample: one of the three bodies
                # by head where sum_b k_b < GROUP_BELOW * B * max_b k_b, in integers (num/den = GROUP_BELOW)
                num, den = group_ratio()
                padded = b("Mul", B0, b("ReduceMax", k, keepdims=0))  # () B * max k
                used = b("ReduceSum", k, keepdims=0)  # () sum k
                group = b("Less", b("Mul", used, b.const(den)), b("Mul", padded, b.const(num)))
                # the active heads where (B x A - sum_b k_b) x T <= policy.active_heads_waste_rows
                active = b("Greater", b("ReduceMax", mask_f, c0, keepdims=0), b.const(0.0, np.float32))  # (H,)
                n_active = b("ReduceSum", b("Cast", active, to=TensorProto.INT64), keepdims=0)  # () A
                waste = b("Mul", b("Sub", b("Mul", B0, n_active), used),
                          b("Squeeze", b("Shape", x, start=1, end=2), c0))  # () token rows of unselected pairs
                return b.if_(b("LessOrEqual", waste, b.const(b.policy.active_heads_waste_rows)), lambda: by_active_heads(active),
                             lambda: b.if_(group, by_head, per_sample))
            # one sample runs its own k heads (per_sample) without computing the others' conditions
            B0 = b("Squeeze", b("Shape", x, start=0, end=1), c0)  # () B
            y = b.if_(b("Greater", B0, b.const(1)), choose, per_sample)
    else:
        # Static shapes: every head projected and attended, unselected heads weighted by zero.
        qkv = b("Add", b("MatMul", x, b("Transpose", w_qkv, perm=[1, 0])), b_qkv)  # (B, T, 3d)
        qkv = b("Reshape", qkv, b("Concat", c0, c0, c3, H1, cm1, axis=0))  # (B, T, 3, H, dh)
        qkv = b("Transpose", qkv, perm=[2, 0, 3, 1, 4])  # (3, B, H, T, dh)
        weights = _head_weights(b, sH, p, mask_f)  # (B, H)
        q, kk, v = _split3(b, qkv)
        o = b("Mul", _attend(b, q, kk, v, key_mask), b("Unsqueeze", weights, b.const([2, 3])))  # (B, H, T, dh)
        o = b("Reshape", b("Transpose", o, perm=[0, 2, 1, 3]), b.const([0, 0, -1]))  # (B, T, H*dh)
        y = b("Add", b("MatMul", o, b("Transpose", w_o, perm=[1, 0])), b_o)  # (B, T, d)
    # bind the declared outputs
    b.nodes.append(helper.make_node("Identity", [y], ["y"]))
    b.nodes.append(helper.make_node("Identity", [k], ["k"]))
    b.nodes.append(helper.make_node("Cast", [mask_f], ["head_mask"], to=TensorProto.BOOL))
    f = _private(helper.make_function(
        DOMAIN, "BudgetedAttention", INPUTS, OUTPUTS, b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["num_heads"],
        doc_string=f"adaptex::budgeted_attention, {variant} lowering"
                   f"{f', grouped by head for {grouped_heads} heads' if grouped_heads else ''} (see docs/ops.md)",
    ))
    if grouped_heads is not None:
        f.overload = f"heads{grouped_heads}"
    return f
