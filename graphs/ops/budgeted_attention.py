"""`adaptex::budgeted_attention`: multi-head self-attention that computes only k of H heads.

Schema (see docs/ops.md for the full spec)::

    budgeted_attention(Tensor x, Tensor key_mask, Tensor s, Tensor p,
                       Tensor w_qkv, Tensor b_qkv, Tensor w_o, Tensor b_o,
                       int num_heads) -> (Tensor y, Tensor k, Tensor head_mask)

    x         (B, T, d)  float   layer input (already normalised)
    key_mask  (B, T)     bool    True where the token is real (keys outside it are ignored)
    s         (B,)       float32 budget in (0, 1): the fraction of heads to use
    p         (B, H)     float32 head preferences (softmax of the head scores)
    w_qkv     (3d, d)    float   fused projection, rows [q heads | k heads | v heads],
                                 head i owning rows i*dh:(i+1)*dh of each third
    b_qkv     (3d,)      float
    w_o       (d, d)     float   output projection; head i owns columns i*dh:(i+1)*dh
    b_o       (d,)       float
    ->
    y         (B, T, d)  float   sum over selected heads of w_i * head_i(x) @ w_o[:, cols_i].T + b_o
    k         (B,)       int64   heads used: clamp(floor(s*H), 1, H)
    head_mask (B, H)     bool    True for the k heads of largest p (ties: lower index first)

with w_i = s * H * p_i. Heads outside the mask contribute nothing and cost nothing: the eager
kernel gathers only the selected heads' weight rows and columns.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.graphs.ops.facts import Margin, OpFacts, register

OP_NAME = "adaptex::budgeted_attention"
# ONNX Runtime's sparse lowering (exporter/targets/onnx/bodies/) runs one of three bodies a call,
# and the executed FLOP count (graphs/budgetformer.py) follows `onnx_body`:
# - "active_heads": in a batch of more than one sample, every sample on each of the A heads some
#   sample selected (B x A pairs), in a handful of batched kernels, where that computes at most
#   policy.active_heads_waste_rows token rows for pairs no sample selected ((B x A - sum_b k_b) x T). A
#   trained router's choices concentrate on a few heads (budgetformer-graded at B8, T = 32: 3 or 4 of
#   8), so B x A stays near sum_b k_b, and the few kernels beat a chain of about 20 a head
#   (docs/benchmarking.md);
# - "by_head": otherwise, where the batch's k differ this much (mean k below GROUP_BELOW x the
#   largest k), each head on the samples that selected it (sum_b k_b pairs);
# - "per_sample": otherwise, the largest k for every sample.
GROUP_BELOW = 0.9


def onnx_body(k, head_mask, seq: int, policy: OrtPolicy = DEFAULT) -> str:
    """The body ONNX Runtime's sparse lowering runs for a batch of `seq` tokens a sample with per-sample
    head counts k (B,) and head_mask (B, H) (numpy or torch): "active_heads", "by_head" or
    "per_sample", by the lowering's own integer rules."""
    k = np.asarray(k, dtype=np.int64)
    B, used, active = len(k), int(k.sum()), int(np.asarray(head_mask).astype(bool).any(axis=0).sum())
    if B > 1 and (B * active - used) * seq <= policy.active_heads_waste_rows:
        return "active_heads"
    num, den = group_ratio()
    return "by_head" if used * den < B * int(k.max()) * num else "per_sample"


def group_ratio() -> tuple[int, int]:
    """GROUP_BELOW as integers (num, den), as the lowering compares: sum k x den < B x max k x num."""
    return Fraction(GROUP_BELOW).limit_denominator(1000).as_integer_ratio()


def head_budget(s: Tensor, num_heads: int) -> Tensor:
    """k = clamp(floor(s*H), 1, H) as int64; computed in fp32 whatever the body precision."""
    return torch.clamp(torch.floor(s.float() * num_heads), 1, num_heads).to(torch.int64)


def head_ranks(p: Tensor) -> Tensor:
    """Rank of each head by descending p, ties to the lower index (ONNX TopK's rule): (B, H) int64.

    Pairwise comparison rather than a sort: exact, and every exporter can translate it."""
    H = p.shape[-1]
    pi, pj = p.float()[:, :, None], p.float()[:, None, :]  # (B, H, 1), (B, 1, H)
    lower = torch.ones(H, H, dtype=torch.bool, device=p.device).tril(-1)  # [i, j]: j < i
    return ((pj > pi) | ((pj == pi) & lower)).sum(-1)


def select_heads(s: Tensor, p: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Routing decisions: (k (B,), head_mask (B,H) bool, ranks (B,H)).

    Every lowering selects the same heads as this reference: the k heads of rank < k."""
    k = head_budget(s, num_heads)
    ranks = head_ranks(p)
    return k, ranks < k[:, None], ranks


def head_weights(s: Tensor, p: Tensor, num_heads: int) -> Tensor:
    """w_i = s * H * p_i, (B, H) fp32."""
    return s.float()[:, None] * num_heads * p.float()


def attend_selected(
    x: Tensor, key_mask: Tensor, weights: Tensor, head_mask: Tensor,
    w_qkv: Tensor, b_qkv: Tensor, w_o: Tensor, b_o: Tensor, num_heads: int,
) -> Tensor:
    """The kernel body: per sample, project and attend with the masked-in heads only.

    Samples are grouped by their head set, so a batch whose samples agree costs one pass per group.
    """
    B, T, d = x.shape
    dh = d // num_heads
    y = torch.empty_like(x)
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, row in enumerate(head_mask.tolist()):
        groups.setdefault(tuple(i for i, m in enumerate(row) if m), []).append(b)
    arange_dh = torch.arange(dh, device=x.device)
    for heads, members in groups.items():
        idx = torch.tensor(members, device=x.device)
        h = torch.tensor(heads, device=x.device)
        kk = len(heads)
        cols = (h[:, None] * dh + arange_dh).reshape(-1)  # (kk*dh,) rows of one third of w_qkv
        rows = torch.cat([cols, cols + d, cols + 2 * d])  # (3*kk*dh,)
        xs = x.index_select(0, idx)  # (b, T, d)
        qkv = F.linear(xs, w_qkv.index_select(0, rows), b_qkv.index_select(0, rows))  # (b, T, 3*kk*dh)
        q, k, v = qkv.view(len(members), T, 3, kk, dh).permute(2, 0, 3, 1, 4)  # each (b, kk, T, dh)
        attn_mask = key_mask.index_select(0, idx)[:, None, None, :]  # (b, 1, 1, T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (b, kk, T, dh)
        w = weights.index_select(0, idx).index_select(1, h).to(o.dtype)  # (b, kk)
        o = (o * w[:, :, None, None]).transpose(1, 2).reshape(len(members), T, kk * dh)
        y[idx] = F.linear(o, w_o.index_select(1, cols), b_o)  # (b, T, d)
    return y


def budgeted_attention_eager(
    x: Tensor, key_mask: Tensor, s: Tensor, p: Tensor,
    w_qkv: Tensor, b_qkv: Tensor, w_o: Tensor, b_o: Tensor, num_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The eager kernel as plain Python. Called directly (not through the op) it is what a user
    would write by hand: tracers see its data-dependent head sets as constants."""
    k, head_mask, _ = select_heads(s, p, num_heads)
    y = attend_selected(
        x, key_mask, head_weights(s, p, num_heads), head_mask, w_qkv, b_qkv, w_o, b_o, num_heads
    )
    return y, k, head_mask


@torch.library.custom_op(OP_NAME, mutates_args=())
def budgeted_attention(
    x: Tensor, key_mask: Tensor, s: Tensor, p: Tensor,
    w_qkv: Tensor, b_qkv: Tensor, w_o: Tensor, b_o: Tensor, num_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    return budgeted_attention_eager(x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o, num_heads)


@budgeted_attention.register_fake
def _(x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o, num_heads):
    B = x.shape[0]
    return (
        torch.empty_like(x),
        x.new_empty((B,), dtype=torch.int64),
        x.new_empty((B, num_heads), dtype=torch.bool),
    )


def budgeted_attention_dense_reference(
    x: Tensor, key_mask: Tensor, s: Tensor, p: Tensor,
    w_qkv: Tensor, b_qkv: Tensor, w_o: Tensor, b_o: Tensor, num_heads: int,
    head_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Every head computed, unselected ones zeroed: the obvious implementation, for tests and for
    the naive export. `head_mask` forces a routing (parity uses it to replay excused flips)."""
    B, T, d = x.shape
    dh = d // num_heads
    k, selected, _ = select_heads(s, p, num_heads)
    if head_mask is not None:
        selected, k = head_mask, head_mask.sum(-1)
    q, kk, v = F.linear(x, w_qkv, b_qkv).view(B, T, 3, num_heads, dh).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, kk, v, attn_mask=key_mask[:, None, None, :])  # (B,H,T,dh)
    w = head_weights(s, p, num_heads) * selected
    o = (o * w[:, :, None, None].to(o.dtype)).transpose(1, 2).reshape(B, T, d)
    return F.linear(o, w_o, b_o), k, selected


# --- the op's facts (graphs/ops/facts.py): routing inputs, Core ML fp32 parts, decisions, margins ---
FACTS = register(OpFacts(
    op=OP_NAME, function="BudgetedAttention", routing_inputs=("s", "p"),
    decisions={"k": "budget", "head_mask": "head_set"},
    margins={"budget": Margin(1e-4, 1e-2, "|s*H - round(s*H)|"),
             "head_set": Margin(1e-5, 1e-3, "gap between the k-th and (k+1)-th p")}))
