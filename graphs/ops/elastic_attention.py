"""`adaptex::elastic_attention`: every head of a layer in one op, each head full or streaming.

Schema (see docs/ops.md for the full spec)::

    elastic_attention(Tensor q, Tensor k, Tensor v, Tensor sa, Tensor key_mask,
                      int sink, int window, bool causal) -> Tensor o

    q         (B, H, T, dh) float  queries of the T new tokens
    k, v      (B, H, S, dh) float  keys and values of all S = P + T tokens (P cached, then the T new)
    sa        (B, H)        bool   True: the head runs streaming attention (SA), False: full (FA)
    key_mask  (B, S)        bool   True for real keys
    sink, window            int    SA: the first `sink` keys, plus a local window
    causal                  bool   decoders: keys up to the query's own position
    ->
    o         (B, H, T, dh) float  softmax(q k^T / sqrt(dh) + mask) v, head by head

The query of new token i sits at absolute position a = S - T + i. FA sees keys j <= a (causal) or
every key. SA sees the sink keys j < sink (j <= a when causal) and a local window: the `window`
keys a - window < j <= a (causal), or a - window//2 <= j <= a + window//2 (encoders). Padded keys
are never seen. SA heads cost O(T * (sink + window)): the eager kernel (and the sparse lowerings)
work block-local, each block of queries against its own run of keys, instead of masking a T x S
score matrix; the (B, H) pairs of each mode are gathered first, so a layer's mix of modes runs in
one pass.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.graphs.ops.facts import Margin, OpFacts, register

OP_NAME = "adaptex::elastic_attention"
NEG = -1e30  # masked scores (finite: a row with no visible key stays finite, never NaN)


def runs_masked(pairs: int, T: int, S: int, policy: OrtPolicy = DEFAULT) -> bool:
    """Whether ONNX Runtime's general body attends a call of T > 1 new tokens over S keys, `pairs` (B, H)
    pairs a sample, every pair over every key (SA keys masked; policy.mixed_call_masked_up_to): what it
    then executes is full attention."""
    return T > 1 and pairs * T * S <= policy.mixed_call_masked_up_to


def masked_excess(batch: int, pairs: int, T: int, beyond: int) -> int:
    """The scores that attending a call of `batch` samples of T tokens (its keys), `pairs` (B, H) pairs a
    sample, every pair masked adds over block-local attention, whose rows hold about `beyond` = sink +
    2 window keys (also the masked short-call programs' guards: exporter/targets/onnx/guards.py)."""
    return batch * pairs * T * max(0, T - beyond)


def call_runs_masked(batch: int, pairs: int, T: int, sink: int, window: int, up_to: int | None = None,
                     policy: OrtPolicy = DEFAULT) -> bool:
    """runs_masked for a call whose T tokens are its keys (an encoder's; a decoder's prefill, which its
    masked short-call program runs): also where masked_excess fits `up_to` (default
    policy.masked_excess_up_to; a decoder's prefill policy.prefill_masked_excess_up_to); never with
    policy.mixed_call_masked_up_to at 0, which turns the masked path off."""
    bound = policy.masked_excess_up_to if up_to is None else up_to
    return runs_masked(pairs, T, T, policy) or (policy.mixed_call_masked_up_to > 0 and T > 1
                                                and masked_excess(batch, pairs, T, sink + 2 * window) <= bound)


def block_index(T: int, S: int, sink: int, window: int, causal: bool, device=None) -> tuple[int, Tensor, Tensor]:
    """Block-local SA layout: the T new queries in blocks of Bq = min(window, T) consecutive ones;
    each block reads one contiguous run of L keys. Returns Bq, the (nb, L) key indices of each
    block (clamped into range), and the (nb, Bq, L) mask of the keys each query's window covers
    (in range, and past the sinks, which the sink part covers)."""
    Bq = max(1, min(window, T))
    nb = -(-T // Bq)
    if causal:
        before, L = window - 1, Bq + window - 1  # query a sees a - window + 1 .. a
    else:
        half = window // 2
        before, L = half, Bq + 2 * half  # query a sees a - half .. a + half
    a0 = S - T + torch.arange(nb, device=device) * Bq  # (nb,) first query of each block
    j = a0[:, None] - before + torch.arange(L, device=device)[None, :]  # (nb, L) absolute key positions
    a = a0[:, None] + torch.arange(Bq, device=device)[None, :]  # (nb, Bq) absolute query positions
    d = a[:, :, None] - j[:, None, :]  # (nb, Bq, L) query minus key
    inwin = ((d >= 0) & (d < window)) if causal else (d.abs() <= window // 2)
    valid = inwin & (j[:, None, :] >= sink) & (j[:, None, :] >= 0) & (j[:, None, :] < S)
    return Bq, j.clamp(0, S - 1), valid


def _full(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, causal: bool) -> Tensor:
    """(N, T, dh) queries over (N, S, dh) keys: every visible key."""
    T, S = q.shape[1], k.shape[1]
    scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # (N, T, S)
    visible = key_mask[:, None, :]
    if causal:
        a = torch.arange(S - T, S, device=q.device)[:, None]
        visible = visible & (torch.arange(S, device=q.device)[None, :] <= a)[None]
    return torch.softmax(scores.masked_fill(~visible, NEG), dim=-1) @ v


def _streaming(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, sink: int, window: int, causal: bool) -> Tensor:
    """(N, T, dh) queries over sinks + local windows of (N, S, dh) keys, block-local: each block of
    Bq queries multiplies against its own run of L ~ Bq + window keys, so O(T * (sink + 2 window))."""
    N, T, dh = q.shape
    S = k.shape[1]
    scale = 1.0 / math.sqrt(dh)
    ns = min(sink, S)
    Bq, idx, valid = block_index(T, S, sink, window, causal, q.device)
    nb, L = idx.shape
    qb = torch.nn.functional.pad(q, (0, 0, 0, nb * Bq - T)).view(N, nb, Bq, dh)
    kb, vb = k[:, idx], v[:, idx]  # (N, nb, L, dh): contiguous runs, ~2x the keys in all
    s_loc = qb @ kb.transpose(-1, -2) * scale  # (N, nb, Bq, L)
    vis_loc = valid[None] & key_mask[:, idx][:, :, None, :]
    s_sink = qb @ k[:, None, :ns].transpose(-1, -2) * scale  # (N, nb, Bq, ns)
    vis_sink = key_mask[:, None, None, :ns].expand(N, nb, Bq, ns)
    if causal:
        a = S - T + torch.arange(nb * Bq, device=q.device).view(nb, Bq)
        vis_sink = vis_sink & (torch.arange(ns, device=q.device)[None, None, :] <= a[:, :, None])[None]
    scores = torch.cat([s_sink.masked_fill(~vis_sink, NEG), s_loc.masked_fill(~vis_loc, NEG)], dim=-1)
    p = torch.softmax(scores, dim=-1)
    o = p[..., :ns] @ v[:, None, :ns] + p[..., ns:] @ vb  # (N, nb, Bq, dh)
    return o.reshape(N, nb * Bq, dh)[:, :T]


def elastic_attention_eager(q: Tensor, k: Tensor, v: Tensor, sa: Tensor, key_mask: Tensor,
                            sink: int, window: int, causal: bool) -> Tensor:
    """The eager kernel: the (B, H) pairs of each mode gathered, each group attended its own way."""
    B, H, T, dh = q.shape
    S = k.shape[2]
    qf, kf, vf = q.reshape(B * H, T, dh), k.reshape(B * H, S, dh), v.reshape(B * H, S, dh)
    mf = key_mask[:, None, :].expand(B, H, S).reshape(B * H, S)
    out = torch.empty_like(qf)
    modes = sa.reshape(-1)
    for pick, fn in ((~modes, lambda i: _full(qf[i], kf[i], vf[i], mf[i], causal)),
                     (modes, lambda i: _streaming(qf[i], kf[i], vf[i], mf[i], sink, window, causal))):
        idx = pick.nonzero().squeeze(1)
        if idx.numel():
            out.index_copy_(0, idx, fn(idx))
    return out.view(B, H, T, dh)


@torch.library.custom_op(OP_NAME, mutates_args=())
def elastic_attention(q: Tensor, k: Tensor, v: Tensor, sa: Tensor, key_mask: Tensor,
                      sink: int, window: int, causal: bool) -> Tensor:
    return elastic_attention_eager(q, k, v, sa, key_mask, sink, window, causal)


@elastic_attention.register_fake
def _(q, k, v, sa, key_mask, sink, window, causal):
    return torch.empty_like(q)


def visibility(T: int, S: int, sink: int, window: int, causal: bool, device=None) -> tuple[Tensor, Tensor]:
    """(T, S) bool masks of the keys an FA and an SA query sees (before padding)."""
    a = torch.arange(S - T, S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    fa = (j <= a) if causal else torch.ones(T, S, dtype=torch.bool, device=device)
    local = ((a - j >= 0) & (a - j < window)) if causal else ((j - a).abs() <= window // 2)
    return fa, fa & ((j < sink) | local)


def elastic_attention_dense_reference(q: Tensor, k: Tensor, v: Tensor, sa: Tensor, key_mask: Tensor,
                                      sink: int, window: int, causal: bool) -> Tensor:
    """Every head over the full T x S score matrix, SA heads through a band mask: the obvious
    implementation (tests; the dense lowerings compute this)."""
    T, S = q.shape[2], k.shape[2]
    fa, sa_vis = visibility(T, S, sink, window, causal, q.device)
    m = sa[:, :, None, None]
    vis = ((m & sa_vis) | (~m & fa)) & key_mask[:, None, None, :]  # (B, H, T, S); no bool Where (ONNX Runtime lacks it)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~vis, NEG), dim=-1) @ v


# --- the op's facts (graphs/ops/facts.py): routing inputs, Core ML fp32 parts, decisions, margins ---
FACTS = register(OpFacts(
    op=OP_NAME, function="ElasticAttention", routing_inputs=("sa",),
    decisions={"sa": "head_mode"}, margins={"head_mode": Margin(1e-4, 1e-2, "FA/SA logit gap")}))
