"""TSA's layers: the token router and the block whose query side and FFN run for kept tokens only."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.nn.record import AdaptiveLayer, Recorder, _resolve
from adaptex.graphs.ops import conditional_attention as ca
from adaptex.graphs.ops import conditional_ffn as cf


class TokenRouter(AdaptiveLayer, nn.Module):
    """p = sigmoid(W2 relu(W1 h + b1) + b2) per token; b2 = -1 so tokens start mostly kept.

    A token with p <= threshold keeps the next block; its updates are scaled by 1 - p.
    forward(h (B, T, d)) -> (keep (B, T) bool, gate (B, T) float32): pass both to the next
    `ConditionalBlock`. Soft mode: keep all, gate 1 - p; st (late training): hard forward, soft
    gradient; hard: keep = p <= threshold, gate = keep * (1 - p). Decisions: keep, p."""

    def __init__(self, d_model: int, hidden: int = 0, threshold: float = 0.5):
        super().__init__()
        hidden = hidden or max(d_model // 4, 16)
        self.threshold = threshold
        self.net = nn.Sequential(nn.Linear(d_model, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        nn.init.constant_(self.net[2].bias, -1.0)

    def probability(self, h: Tensor) -> Tensor:
        # on the rows of a 2-D view: an exported graph runs each Linear as one Gemm (ONNX Runtime fuses
        # the first with its ReLU), where a (B, T, d) input ran a MatMul and an Add each: 9 kernels fewer
        # a call for tsa-charlm (docs/benchmarking.md#never-slower-than-dense); the same values
        rows = self.net(h.float().reshape(-1, h.shape[-1]))  # (B*T, 1)
        return torch.sigmoid(rows.view(h.shape[:-1]))  # (B, T) fp32

    def forward(self, h: Tensor, *, mode: str | None = None, force_keep: Tensor | None = None,
                return_p: bool = False):
        """(keep, gate); with return_p, (keep, gate, p) (the shipped TSA decoder's call). In dense
        mode there is no routing: (None, None), and the next block runs every token."""
        mode = self.resolve_mode(mode)
        if mode == "dense":
            return (None, None, None) if return_p else (None, None)
        p = self.probability(h)
        keep = p <= self.threshold
        force_keep = force_keep if force_keep is not None else self.forced("keep")
        if force_keep is not None:
            keep = force_keep.bool()
        if mode == "soft":
            gate = 1 - p
        elif mode == "st":  # forward: keep * (1 - p); backward: as if soft
            soft = 1 - p
            gate = keep.float() * soft + (soft - soft.detach()) * (1 - keep.float())
        else:
            # keep * (1 - p) as one Where: the same values, and an exported graph runs one kernel where
            # a Cast and a Mul ran (per router, every call)
            gate = torch.where(keep, 1 - p, 0.0)
        margins = {"keep": (p.double() - self.threshold).abs()} if not torch.compiler.is_exporting() else None
        self.record({"keep": keep, "p": p}, margins=margins)
        return (keep, gate, p) if return_p else (keep, gate)


def causal_visibility(key_ok: Tensor, past_len, T: int) -> Tensor:
    """(B, T, P+T) bool: query i (absolute position P+i) sees real keys at positions <= P+i, and
    always itself (so a padded query row is never empty)."""
    S = key_ok.shape[1]
    qpos = torch.arange(T, device=key_ok.device) + past_len  # (T,)
    kpos = torch.arange(S, device=key_ok.device)  # (S,)
    causal = kpos[None, :] <= qpos[:, None]  # (T, S)
    own = kpos[None, :] == qpos[:, None]  # (T, S)
    return (causal[None] & key_ok[:, None, :]) | own[None]


def causal_bias(attention_mask: Tensor, past_len, T: int) -> Tensor:
    """The additive attention bias every ConditionalBlock of a decoder shares, (B, 1, T, P+T): query
    i (position P+i) sees real keys at positions <= P+i, and always itself (so a padded query row is
    never empty); 0 visible, -inf hidden. attention_mask (B, P+T), 1 for real tokens."""
    allowed = causal_visibility(attention_mask.bool(), past_len, T)
    # one additive bias for every layer: an Add per layer, where a masked_fill would be a Where over
    # (B, H, T, P+T) per layer (16% of prefill time at T=512 in ONNX Runtime)
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
        ~allowed, float("-inf"))[:, None]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        # d a Python constant: read from x.shape, a legacy export kept a Shape and ran the weight slices
        # below at every call instead of folding them into initializers (the dense-legacy graphs)
        self.h, self.dh, self.d = num_heads, d_model // num_heads, d_model
        self.num_heads = num_heads  # as every adaptex attention layer names it (a check sizes its batches by it)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, bias: Tensor, past_k: Tensor, past_v: Tensor):
        B, T, _ = x.shape
        d = self.d
        # the score scale 1/sqrt(dh) goes into the query rows of the fused projection, not onto the
        # scores: an exported graph then folds it into the weights, and ONNX Runtime's score MatMul
        # runs without a scale (FusedMatMul with alpha != 1 took 1.56x as long for a decode step's
        # (B*H, 1, dh) x (dh, S) product: docs/benchmarking.md#measured-here)
        s, w, b = 1.0 / math.sqrt(self.dh), self.qkv.weight, self.qkv.bias
        qkv = F.linear(x, torch.cat([w[:d] * s, w[d:]]), torch.cat([b[:d] * s, b[d:]]))
        q, k, v = qkv.view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)  # each (B, H, T, dh)
        k = torch.cat([past_k, k], dim=2)  # (B, H, P+T, dh)
        v = torch.cat([past_v, v], dim=2)
        att = ((q @ k.transpose(-1, -2)) + bias).softmax(-1)  # (B, H, T, P+T)
        y = (att @ v).transpose(1, 2).reshape(B, T, d)  # (B, T, d)
        return self.proj(y), k, v

    def kv(self, x: Tensor, past_k: Tensor, past_v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of every token (past + these T), each (B, H, P+T, dh): the rows of the
        fused projection after the query's, so a gated block projects queries for kept tokens only."""
        B, T, _ = x.shape
        d = self.d
        k, v = F.linear(x, self.qkv.weight[d:], self.qkv.bias[d:]).view(B, T, 2, self.h, self.dh).permute(2, 0, 3, 1, 4)
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)

    def query_args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(wq, bq, wo, bo) for adaptex::conditional_attention."""
        d = self.d
        return self.qkv.weight[:d], self.qkv.bias[:d], self.proj.weight, self.proj.bias


class ConditionalBlock(nn.Module):
    """A pre-norm causal Transformer block whose attention query side and FFN run only for the
    tokens the previous TokenRouter kept.

    forward(h (B, T, d), bias (B, 1, T, P+T) from `causal_bias`, past (key, value) each
    (B, H, P, dh), keep, gate) -> (h, (key, value)) with the cache grown by T. Every token's keys
    and values are computed (later tokens attend to a skipped one); a skipped token's query,
    scores, attention output and FFN are not (`adaptex::conditional_attention` and
    `adaptex::conditional_ffn`). Without keep and gate (the first block) every token runs."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, ln_eps: float = 1e-5):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=ln_eps)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.ln2 = nn.LayerNorm(d_model, eps=ln_eps)
        self.ffn = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def ffn_args(self):
        return (self.ln2.weight, self.ln2.bias, self.ffn[0].weight, self.ffn[0].bias,
                self.ffn[2].weight, self.ffn[2].bias, self.ln2.eps)

    def empty_past(self, B: int, device=None) -> tuple[Tensor, Tensor]:
        z = torch.zeros(B, self.attn.h, 0, self.attn.dh, device=device)
        return z, z

    def forward(self, h: Tensor, bias: Tensor, past: tuple[Tensor, Tensor] | None = None,
                keep: Tensor | None = None, gate: Tensor | None = None,
                mode: str | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        past = past if past is not None else self.empty_past(h.shape[0], h.device)
        mode = _resolve(mode, self.training)
        if gate is not None and mode in ("hard", "naive", "eager"):
            # gate = keep * (1 - p), zero for the skipping tokens: every token's keys and values, but
            # queries, attention rows and FFN for the kept tokens only
            hn = self.ln1(h)
            k, v = self.attn.kv(hn, *past)
            sparse = mode in ("hard", "eager")
            attn = ca.conditional_attention if sparse else ca.conditional_attention_dense_reference
            h = attn(h, hn, keep, gate, k, v, bias, *self.attn.query_args(), self.attn.h)
            ffn = cf.conditional_ffn if sparse else cf.conditional_ffn_dense_reference
            return ffn(h, keep, gate, *self.ffn_args()), (k, v)
        a, k, v = self.attn(self.ln1(h), bias, *past)
        if gate is None or mode == "dense":
            h = h + a
            return h + self.ffn(self.ln2(h)), (k, v)
        h = h + a * gate[..., None]  # soft, st
        return h + self.ffn(self.ln2(h)) * gate[..., None], (k, v)


def depth_loss(rec: Recorder, mask: Tensor | None = None) -> Tensor:
    """TSA's depth loss over every TokenRouter a soft-mode pass recorded: (1/R) sum_r mean over real
    tokens of (1 - p_r). Add lambda times it to the task loss (lambda = 0 works too)."""
    ps = [d["p"] for d in rec.decisions.values() if "keep" in d]
    if not ps:
        raise ValueError("no TokenRouter decisions were recorded; call the model inside record_decisions()")
    m = torch.ones_like(ps[0]) if mask is None else mask[:, -ps[0].shape[1]:].float()
    return torch.stack([((1 - p) * m).sum() / m.sum().clamp(min=1) for p in ps]).mean()


