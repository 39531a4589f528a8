"""`adaptex::conditional_ffn`: a pre-norm FFN residual update computed for the kept tokens only.

Schema (see docs/ops.md for the full spec)::

    conditional_ffn(Tensor x, Tensor keep, Tensor gate, Tensor ln_w, Tensor ln_b,
                    Tensor w1, Tensor b1, Tensor w2, Tensor b2, float eps) -> Tensor y

    x     (B, T, d)   float   residual stream entering the FFN half of a block
    keep  (B, T)      bool    True for the tokens that run the FFN (TSA: p <= 0.5)
    gate  (B, T)      float32 scale of the kept tokens' update (TSA: 1 - p)
    ln_w, ln_b (d,)   float   the block's pre-FFN LayerNorm
    w1 (f, d), b1 (f,), w2 (d, f), b2 (d,)  the FFN: w2 @ gelu(w1 @ . + b1) + b2 (exact GELU)
    ->
    y     (B, T, d)   float   x + keep * gate * FFN(LayerNorm(x)), token by token

Skipped tokens pass through unchanged and cost nothing: the eager kernel gathers the kept tokens,
runs the norm and the FFN on them, and scatters the updates back (NonZero + Gather + FFN +
ScatterND in the ONNX lowering).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.ops.facts import Margin, OpFacts, register

OP_NAME = "adaptex::conditional_ffn"


def ffn_update(x: Tensor, ln_w: Tensor, ln_b: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
               eps: float) -> Tensor:
    """FFN(LayerNorm(x)) on the last axis, for any leading shape."""
    h = F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps)
    return F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)


def conditional_ffn_eager(x: Tensor, keep: Tensor, gate: Tensor, ln_w: Tensor, ln_b: Tensor,
                          w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, eps: float) -> Tensor:
    """The eager kernel: gather the kept tokens, transform them, scatter the updates back."""
    B, T, d = x.shape
    flat = x.reshape(B * T, d)
    idx = keep.reshape(-1).nonzero().squeeze(1)  # (N,) kept token positions
    y = flat.clone()
    if idx.numel():
        xs = flat.index_select(0, idx)  # (N, d)
        upd = ffn_update(xs, ln_w, ln_b, w1, b1, w2, b2, eps)  # (N, d)
        g = gate.reshape(-1).index_select(0, idx).to(upd.dtype)[:, None]  # (N, 1)
        y.index_add_(0, idx, upd * g)
    return y.view(B, T, d)


@torch.library.custom_op(OP_NAME, mutates_args=())
def conditional_ffn(x: Tensor, keep: Tensor, gate: Tensor, ln_w: Tensor, ln_b: Tensor,
                    w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, eps: float) -> Tensor:
    return conditional_ffn_eager(x, keep, gate, ln_w, ln_b, w1, b1, w2, b2, eps)


@conditional_ffn.register_fake
def _(x, keep, gate, ln_w, ln_b, w1, b1, w2, b2, eps):
    return torch.empty_like(x)


def conditional_ffn_dense_reference(x: Tensor, keep: Tensor, gate: Tensor, ln_w: Tensor, ln_b: Tensor,
                                    w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, eps: float) -> Tensor:
    """Every token transformed, skipped ones zeroed: the obvious implementation (tests, naive export)."""
    upd = ffn_update(x, ln_w, ln_b, w1, b1, w2, b2, eps)
    return x + upd * (gate.to(upd.dtype) * keep.to(upd.dtype))[..., None]


# --- the op's facts (graphs/ops/facts.py): routing inputs, Core ML fp32 parts, decisions, margins ---
FACTS = register(OpFacts(
    op=OP_NAME, function="ConditionalFFN", routing_inputs=("keep", "gate"),
    decisions={"keep": "keep"}, margins={"keep": Margin(1e-4, 1e-2, "|p - threshold|")},
    # the kept rows, the layer_norm, the residual add and the scatter back stay fp32 beside the
    # decoder's residual stream; the FFN's linears and gelu run in the body's precision
    coreml_fp32_parts=("", "_kept", "_ln", "_new", "_ext", "_ext_first", "_ext_zeros", "_scatter", "_end")))
