"""adaptex.ConditionalAttention's body: the kept tokens' queries over every token's keys."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.exporter.targets.onnx.bodies.budgeted import _score_scale
from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, ONNX_OPSET, _Body, _name_output, _private
from adaptex.exporter.targets.onnx.bodies.by_sample import _attention, _by_sample
from adaptex.exporter.targets.onnx.bodies.kept import _as_x, _dispatch, _masked_gate


CA_INPUTS = ["x", "hn", "keep", "gate", "k", "v", "bias", "wq", "bq", "wo", "bo"]


def conditional_attention_function(variant: str, partition: str = "topk", dispatch: bool = False,
                                   by_sample: bool = True, policy: OrtPolicy = DEFAULT) -> onnx.FunctionProto:
    """The body of adaptex.ConditionalAttention: y = x + keep * gate * Attn(q(hn) over k, v + bias).

    sparse: per batch row the kept positions first, n = max(1, the batch's largest kept count) of
    them: `partition` "topk" takes a TopK over the keep mask with K = n (ONNX Runtime), "cumsum" a
    stable partition from CumSum slots scattered into a permutation and sliced to n (TensorRT,
    whose TopK wants K bounded over an axis of known size). Gather of those rows of hn, bias, gate
    and x; Q projection, scores, Softmax, AV and output projection on them only; ScatterND (no
    reduction; the rows are distinct) of the updated rows back. Rows past a sample's own count are
    not kept: their gate is zero and they are written back unchanged. n >= 1 keeps every tensor
    non-empty (a decode step whose token skips attends one ungated row). dense: every query row
    attended, the update multiplied by keep * gate (static shapes). dispatch (ONNX Runtime): If
    nodes on the keep mask pick nothing, every row, or the gathered rows at run time, and a mix
    whose largest kept count is at least policy.dense_query_share of T every row, masked (see _dispatch);
    a large batch attends a sample at a time, each sample its own kept rows (_by_sample), unless
    by_sample is False (the body of a program whose calls never reach that threshold: the If and
    its size check cost a B1 call at T = 128 about 5%, docs/benchmarking.md#large-calls)."""
    if partition not in ("topk", "cumsum"):
        raise ValueError(f"unknown partition {partition!r}")
    by_sample = dispatch and by_sample  # the by-sample If: ONNX Runtime's bodies only
    b = _Body("ca_", policy)
    x, hn, keep, gate, k, v, bias, wq, bq, wo, bo = CA_INPUTS
    c0, c1, cm1, one = b.const([0]), b.const([1]), b.const([-1]), b.const(1)
    # sizes from the weights (initializers), so these chains fold to constants at load
    H1 = b("Unsqueeze", b.attr_int("num_heads"), c0)  # (1,)
    d1 = b("Shape", wq, start=0, end=1)  # (1,)
    dh1 = b("Div", d1, H1)
    scale = _score_scale(b, dh1)
    # the score scale folded into the query weights: no Mul over the (B, H, n, S) scores
    bq_s = b("Mul", bq, scale)
    W = {}  # the (in, out) projection weights the MatMuls read (made again one If deeper by `projections`)

    def projections() -> None:
        W["q"] = b("Mul", b("Transpose", wq, perm=[1, 0]), scale)  # (d, d)
        W["o"] = b("Transpose", wo, perm=[1, 0])
    projections()
    head_split = b("Concat", c0, c0, H1, dh1, axis=0)  # [0, 0, H, dh]
    head_merge = b("Concat", c0, c0, d1, axis=0)  # [0, 0, d]

    def attend(hq: str, bias_rows, bias_of, counts: str | None = None, n1: str | None = None) -> str:
        """(B, n, d) query rows -> (B, n, d) updates. bias_rows() makes the (B, 1, n, S) bias, and
        bias_of(i1, j1, c) sample i's (1, 1, c, S) bias rows, for a large call run a sample at a time
        (_by_sample; counts (B,): each sample's own rows, n1 (1,) the batch's largest, or None: n)."""
        q = b("Add", b("MatMul", hq, W["q"]), bq_s)  # (B, n, d)
        q = b("Transpose", b("Reshape", q, head_split), perm=[0, 2, 1, 3])  # (B, H, n, dh)
        o = _by_sample(b, q, k, v, lambda: _attention(b, q, k, v, bias_rows()),
                       lambda qi, ki, vi, i1, j1, c: _attention(b, qi, ki, vi, bias_of(i1, j1, c)), counts, n1) \
            if by_sample else _attention(b, q, k, v, bias_rows())  # (B, H, n, dh)
        o = b("Transpose", o, perm=[0, 2, 1, 3])  # (B, n, H, dh)
        return b("Add", b("MatMul", b("Reshape", o, head_merge), W["o"]), bo)  # (B, n, d)

    def some() -> str:  # the kept query rows only, as the (B*T, d) rows
        T = b("Squeeze", b("Shape", x, start=1, end=2), c0)  # scalar
        ki = b("Cast", keep, to=TensorProto.INT64)  # (B, T)
        cnt = b("ReduceSum", ki, c1, keepdims=1)  # (B, 1): each sample's kept count
        n = b("Max", b("ReduceMax", cnt, keepdims=0), one)  # scalar: max(1, the largest kept count)
        n1 = b("Unsqueeze", n, c0)  # (1,)
        if partition == "topk":
            _, order = b("TopK", b("Cast", keep, to=TensorProto.FLOAT), n1, axis=1, largest=1, sorted=1,
                         outputs=2)  # (B, n): kept positions first
        else:
            # kept token t goes to slot (kept before t), skipped token t to (count + skipped before t).
            # The running counts are float32 (exact below 2^24): TensorRT before 10.8 takes CumSum on
            # floating-point tensors only.
            kf = b("Cast", keep, to=TensorProto.FLOAT)
            run_kept = b("Cast", b("CumSum", kf, one), to=TensorProto.INT64)
            run_skip = b("Cast", b("CumSum", b("Sub", b.const(1.0, np.float32), kf), one), to=TensorProto.INT64)
            slot_kept = b("Sub", run_kept, one)
            slot_skip = b("Add", cnt, b("Sub", run_skip, one))
            slot = b("Where", keep, slot_kept, slot_skip)  # (B, T): a permutation of 0..T-1 per row
            pos = b("Add", b("Mul", ki, b.const(0)), b("Range", b.const(0), T, one))  # (B, T)
            perm = b("ScatterElements", pos, slot, pos, axis=1)  # (B, T): perm[b, slot] = t
            order = b("Slice", perm, c0, n1, c1)  # (B, n): kept positions first
        B = b("Squeeze", b("Shape", x, start=0, end=1), c0)
        base = b("Range", b.const(0), b("Mul", B, T), T)  # (B,): the first flat row of each sample
        rows = b("Add", order, b("Unsqueeze", base, c1))  # (B, n) rows of the flat (B*T, .) tensors
        rows_d = b("Concat", cm1, d1, axis=0)  # [-1, d]
        flat = b("Reshape", x, rows_d)  # (B*T, d)
        hq = b("Gather", b("Reshape", hn, rows_d), rows, axis=0)  # (B, n, d)
        bias_flat = b("Reshape", bias, b("Concat", cm1, b("Shape", bias, start=3, end=4), axis=0))  # (B*T, S)

        def sample_bias(i1: str, j1: str, c: str) -> str:  # sample i's own c rows of the bias: (1, 1, c, S)
            own = b("Slice", rows, b("Concat", i1, c0, axis=0), b("Concat", j1, c, axis=0), b.const([0, 1]))  # (1, c)
            return b("Unsqueeze", b("Gather", bias_flat, own, axis=0), c1)
        upd = attend(hq, lambda: b("Unsqueeze", b("Gather", bias_flat, rows, axis=0), c1), sample_bias,
                     b("Reshape", cnt, cm1) if by_sample else None, n1)  # (B, n, d)
        gs = b("Unsqueeze", b("Gather", b("Reshape", _masked_gate(b, gate, keep), cm1), rows, axis=0), b.const([2]))  # (B, n, 1)
        new = b("Add", b("Gather", flat, rows, axis=0), b("Mul", upd, gs))  # (B, n, d)
        return b("ScatterND", flat, b("Unsqueeze", rows, b.const([2])), new)  # (B*T, d); indices (B, n, 1)

    def every() -> str:  # every query row, the update masked
        upd = attend(hn, lambda: bias, lambda i1, j1, c: b("Slice", bias, i1, j1, c0))  # (B, T, d)
        return b("Add", x, b("Mul", upd, b("Unsqueeze", _masked_gate(b, gate, keep), b.const([2]))))

    if variant == "sparse" and dispatch:
        # run-time dispatch on the decisions: no kept token runs no query side at all (a decode
        # step's skipped block); a call where some sample keeps most of its tokens (every token
        # kept included) runs it on all rows without gather and scatter (the gathered rows would be
        # nearly every row, plus the gathers of their rows of hn, x and the (T, S) bias)
        y = _as_x(b, _dispatch(b, keep, every, x, some, projections, share=b.policy.dense_query_share), x)
    else:
        y = _as_x(b, some(), x) if variant == "sparse" else every()
    _name_output(b, y, "y")
    return _private(helper.make_function(
        DOMAIN, "ConditionalAttention", CA_INPUTS, ["y"], b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["num_heads"],
        doc_string=f"adaptex::conditional_attention, {variant} lowering (see docs/ops.md)",
    ))
