"""`adaptex::conditional_attention`: the query side of self-attention computed for the kept tokens only.

A TSA token that skips block l+1 has its attention update multiplied by zero (the update is gated by
the binary keep mask; docs/models/tsa.md). Its keys and values are still needed (later tokens attend
to it), but its query row (the Q projection, its row of scores, softmax, the attention-weighted sum
of values and the output projection) is dead work, as large as its FFN at T = 512. This op skips it.

Schema (see docs/ops.md for the full spec)::

    conditional_attention(Tensor x, Tensor hn, Tensor keep, Tensor gate, Tensor k, Tensor v,
                          Tensor bias, Tensor wq, Tensor bq, Tensor wo, Tensor bo,
                          int num_heads) -> Tensor y

    x     (B, T, d)     float   residual stream entering the block
    hn    (B, T, d)     float   the block's pre-attention LayerNorm of x (the queries' input)
    keep  (B, T)        bool    True for the tokens whose attention update is computed
    gate  (B, T)        float32 scale of the kept tokens' update (TSA: keep * (1 - p))
    k, v  (B, H, S, dh) float   keys and values of every position (past + these T), S >= T
    bias  (B, 1, T, S)  float32 additive attention mask (0 visible, -inf hidden); each row has a 0
    wq (d, d), bq (d,)          the query projection
    wo (d, d), bo (d,)          the output projection
    ->
    y     (B, T, d)     float   x + keep * gate * (softmax(q k^T / sqrt(dh) + bias) v wo^T + bo),
                                q = hn wq^T + bq, token by token

Sparse: per batch row the kept positions are ordered first (a stable sort of keep, so at most
n = max_b sum_t keep[b, t] query rows per sample), only those n rows are projected, attended and
projected back, and the updated rows are scattered back. Rows past a sample's own count are not
kept and get a zero update. Skipped tokens pass through unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.ops.facts import Margin, OpFacts, register

OP_NAME = "adaptex::conditional_attention"


def kept_rows(keep: Tensor) -> Tensor:
    """(B, n) int64: per batch row, the kept positions first (in order), n = the largest kept count."""
    B, T = keep.shape
    n = int(keep.sum(1).max()) if B and T else 0
    return torch.sort(keep.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :n]


def _attend_rows(hq: Tensor, bias_rows: Tensor, k: Tensor, v: Tensor, wq: Tensor, bq: Tensor,
                 wo: Tensor, bo: Tensor, num_heads: int) -> Tensor:
    """hq (B, n, d) query inputs, bias_rows (B, 1, n, S) -> attention update (B, n, d)."""
    B, n, d = hq.shape
    dh = d // num_heads
    q = F.linear(hq, wq, bq).view(B, n, num_heads, dh).transpose(1, 2)  # (B, H, n, dh)
    att = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh)) + bias_rows).softmax(-1)  # (B, H, n, S)
    o = (att @ v).transpose(1, 2).reshape(B, n, d)
    return F.linear(o, wo, bo)


def conditional_attention_eager(x: Tensor, hn: Tensor, keep: Tensor, gate: Tensor, k: Tensor, v: Tensor,
                                bias: Tensor, wq: Tensor, bq: Tensor, wo: Tensor, bo: Tensor,
                                num_heads: int) -> Tensor:
    """The eager kernel: gather the kept query rows, attend with them only, scatter the updates back."""
    B, T, d = x.shape
    order = kept_rows(keep)  # (B, n)
    n = order.shape[1]
    y = x.clone()
    if n == 0:
        return y
    rows = (order + torch.arange(B, device=x.device)[:, None] * T).reshape(-1)  # (B*n,) flat rows
    hq = hn.reshape(B * T, d).index_select(0, rows).view(B, n, d)
    S = bias.shape[-1]
    bias_rows = bias.reshape(B * T, S).index_select(0, rows).view(B, 1, n, S)
    upd = _attend_rows(hq, bias_rows, k, v, wq, bq, wo, bo, num_heads)  # (B, n, d)
    g = (gate.float() * keep.float()).reshape(-1).index_select(0, rows).to(upd.dtype)[:, None]  # (B*n, 1)
    y.view(B * T, d).index_add_(0, rows, upd.reshape(B * n, d) * g)
    return y


@torch.library.custom_op(OP_NAME, mutates_args=())
def conditional_attention(x: Tensor, hn: Tensor, keep: Tensor, gate: Tensor, k: Tensor, v: Tensor,
                          bias: Tensor, wq: Tensor, bq: Tensor, wo: Tensor, bo: Tensor,
                          num_heads: int) -> Tensor:
    return conditional_attention_eager(x, hn, keep, gate, k, v, bias, wq, bq, wo, bo, num_heads)


@conditional_attention.register_fake
def _(x, hn, keep, gate, k, v, bias, wq, bq, wo, bo, num_heads):
    return torch.empty_like(x)


def conditional_attention_dense_reference(x: Tensor, hn: Tensor, keep: Tensor, gate: Tensor, k: Tensor,
                                          v: Tensor, bias: Tensor, wq: Tensor, bq: Tensor, wo: Tensor,
                                          bo: Tensor, num_heads: int) -> Tensor:
    """Every query row attended, skipped ones zeroed: the obvious implementation (tests, hard_dense)."""
    upd = _attend_rows(hn, bias, k, v, wq, bq, wo, bo, num_heads)  # (B, T, d)
    return x + upd * (gate.to(upd.dtype) * keep.to(upd.dtype))[..., None]


# --- the op's facts (graphs/ops/facts.py): routing inputs, Core ML fp32 parts, decisions, margins ---
FACTS = register(OpFacts(
    op=OP_NAME, function="ConditionalAttention", routing_inputs=("keep", "gate"),
    decisions={"keep": "keep"}, margins={"keep": Margin(1e-4, 1e-2, "|p - threshold|")},
    coreml_fp32_parts=("", "_kept", "_new")))  # the kept rows and the residual add, as conditional_ffn's
