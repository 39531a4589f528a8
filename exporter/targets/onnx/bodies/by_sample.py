"""Attention a sample at a time in a Loop for a large call, else batched."""
from __future__ import annotations

from adaptex.exporter.targets.onnx.bodies.builder import _Body


def _attention(b: _Body, q: str, k: str, v: str, bias: str) -> str:
    """softmax(q k^T + bias) v over (B, H, n, dh) queries and (B, H, S, dh) keys and values."""
    scores = b("MatMul", q, b("Transpose", k, perm=[0, 1, 3, 2]))  # (B, H, n, S)
    return b("MatMul", b("Softmax", b("Add", scores, bias), axis=-1), v)  # (B, H, n, dh)


def large_batch(b: _Body, q: str, k: str, key_axis: int = 2) -> str:
    """True where attention of q (B, ..., n, dh) over keys k should run by sample (policy.by_sample_from);
    k's axis key_axis holds the S keys."""
    qs = b("Shape", q)
    B = b("Slice", qs, b.const([0]), b.const([1]))  # (1,)
    scores = b("Mul", b("ReduceProd", b("Slice", qs, b.const([0]), b.const([-1])), keepdims=1),
               b("Shape", k, start=key_axis, end=key_axis + 1))  # (1,): B ... n S
    return b("Squeeze", b("And", b("Greater", B, b.const([1])), b("GreaterOrEqual", scores, b.const([b.policy.by_sample_from]))),
             b.const([0]))


def _by_sample(b: _Body, q: str, k: str, v: str, batched, attend_one, counts: str | None = None,
               n1: str | None = None, key_axis: int = 2) -> str:
    """Attention of q (B, ..., n, dh) over k, v: batched() for the whole batch or, for a large call
    (policy.by_sample_from), a sample at a time in a Loop: attend_one(qi, ki, vi, i1, j1, c) for sample i's
    slices (i1 = [i], j1 = [i + 1]). With counts (B,), q is (B, H, n, dh) and sample i attends its
    first c = counts[i] query rows only, its rows after them zero (n1: n as a (1,) tensor)."""
    c0, c1 = b.const([0]), b.const([1])

    def one(i: str) -> str:  # sample i, its leading axis dropped
        i1 = b("Unsqueeze", i, c0)  # (1,)
        j1 = b("Add", i1, c1)
        if counts is None:
            qi, c = b("Slice", q, i1, j1, c0), None
        else:
            c = b("Gather", counts, i1, axis=0)  # (1,)
            qi = b("Slice", q, b("Concat", i1, c0, axis=0), b("Concat", j1, c, axis=0), b.const([0, 2]))  # (1, H, c, dh)
        o = attend_one(qi, b("Slice", k, i1, j1, c0), b("Slice", v, i1, j1, c0), i1, j1, c)
        if counts is not None:  # zero rows after the sample's own: every sample hands back (1, H, n, dh)
            o = b("Pad", o, b("Concat", b.const([0, 0, 0, 0, 0, 0]), b("Sub", n1, c), c0, axis=0))
        return b("Squeeze", o, c0)
    return b.if_(large_batch(b, q, k, key_axis), lambda: b.loop_(b("Squeeze", b("Shape", q, start=0, end=1), c0), one),
                 batched)
