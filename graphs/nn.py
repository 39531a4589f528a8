"""adaptex.nn: the adaptive building blocks, as ordinary `nn.Module`s for your own models.

Each layer trains in soft mode (every head or token computed, differentiable routing) and runs
hard at inference (decisions taken, the skipped work really skipped through an `adaptex::` op).
The shipped families are built from these same layers, so a model of your own exports, checks
and benches exactly as they do.

- `BudgetedAttention(d_model, num_heads)`: self-attention that computes k of H heads per input.
- `TokenRouter(d_model)` and `ConditionalBlock(d_model, num_heads, d_ff)`: TSA. The router after
  a block decides per token whether the next block's query side and FFN run for it.
- `ElasticAttention(num_heads, head_dim, sink, window, causal)`: per-head full or streaming
  attention, routed from the layer's keys.

Modes. A layer runs in soft mode while `model.training` and in hard mode in `model.eval()`;
`with adaptive_mode("dense"):` overrides that for every layer (dense: no routing at all, every head
and token; naive: hard decisions, every head and token computed and the skipped ones masked; the
benchmarks export these as counterparts).

Decisions. A layer's decisions are not in its return value (so it drops into any model); they are
recorded, with their distance to the decision boundary, while a recorder is active:

    with adaptex.nn.record_decisions(model) as rec:
        y = model(x, mask)
    rec.decisions["encoder.layers.2.attn"]["k"]   # (B,) heads used, per sample

`record_decisions(model, force={"encoder.layers.2.attn": {"head_mask": m}})` replays a given routing
(parity uses it to excuse a flip at the boundary without counting it again as a value error).
Exported, each decision becomes a named output, `decisions.<module path>.<field>`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.ops import budgeted_attention as ba
from adaptex.graphs.ops import conditional_attention as ca
from adaptex.graphs.ops import conditional_ffn as cf
from adaptex.graphs.ops import elastic_attention as ea

__all__ = ["BudgetedAttention", "BudgetRouter", "RoutingSchedule", "TokenRouter", "ConditionalBlock",
           "ElasticAttention", "HeadRouter", "Recorder", "record_decisions", "adaptive_mode", "causal_bias",
           "budget_loss", "depth_loss", "sparsity", "masked_mean", "DECISION_KINDS"]

# What each decision field is, for parity (runtimes.checks): a flip of a field of kind
#   budget     is excused when |s*H - round(s*H)| is below the margin (k, heads per sample)
#   head_set   when the gap between the k-th and (k+1)-th head preference is (the heads chosen)
#   keep       when |p - threshold| is (a TSA token's keep)
#   head_mode  when the router's |SA - FA logit| is (an elastic head's mode; never when the modes
#              were an input, as at a decoder's decode steps)
# Other recorded fields (s, p, logits) are values, compared like any output.
DECISION_KINDS = {"k": "budget", "head_mask": "head_set", "keep": "keep", "sa": "head_mode"}
SOFT_MODES = ("soft", "st")


# --- decisions: recording and replay ----------------------------------------------------------------

class Recorder:
    """The decisions of one forward pass, per layer path: values, margins and replays."""

    def __init__(self, force: dict[str, dict[str, Tensor]] | None = None):
        self.decisions: dict[str, dict[str, Tensor]] = {}  # path -> field -> tensor, in call order
        self.margins: dict[str, dict[str, Tensor]] = {}  # path -> decision field -> distance to the boundary
        self.aux: dict[str, dict[str, Tensor]] = {}  # path -> what a margin needs besides (head preferences)
        self.force = force or {}

    def record(self, path: str, values: dict, margins: dict | None = None, aux: dict | None = None) -> None:
        if path in self.decisions:  # one layer called twice in a forward (shared weights)
            n = 1
            while f"{path}.call{n}" in self.decisions:
                n += 1
            path = f"{path}.call{n}"
        self.decisions[path] = dict(values)
        self.margins[path] = dict(margins or {})
        self.aux[path] = dict(aux or {})

    def forced(self, path: str, field: str) -> Tensor | None:
        return self.force.get(path, {}).get(field)

    def flat(self) -> dict[str, Tensor]:
        """Every recorded field as `decisions.<path>.<field>`, in call order."""
        return {f"decisions.{p}.{f}": t for p, fields in self.decisions.items() for f, t in fields.items()}


_RECORDERS: list[Recorder] = []
_MODES: list[str] = []


def name_layers(model: nn.Module) -> None:
    """Give every adaptive layer of `model` its module path (what its decisions are recorded under)."""
    for name, m in model.named_modules():
        if isinstance(m, AdaptiveLayer):
            m.adaptex_path = name or type(m).__name__


@contextlib.contextmanager
def record_decisions(model: nn.Module | None = None, force: dict | None = None) -> Iterator[Recorder]:
    """Record the decisions of every adaptive layer called inside the block (named by their module
    path in `model`); `force` {path: {field: tensor}} replays given decisions instead of routing."""
    if model is not None:
        name_layers(model)
    rec = Recorder(force)
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


@contextlib.contextmanager
def adaptive_mode(mode: str) -> Iterator[None]:
    """Run every adaptive layer in `mode` (soft, st, hard, naive, dense) inside the block, whatever
    model.training says."""
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    _MODES.append(mode)
    try:
        yield
    finally:
        _MODES.pop()


MODES = ("soft", "st", "hard", "naive", "dense", "eager")
# the shipped families' older names: hard decisions computed densely, and no routing at all
ALIASES = {"hard_dense": "naive", "full": "dense"}


def _resolve(mode: str | None, training: bool) -> str:
    if mode is None:
        mode = _MODES[-1] if _MODES else ("soft" if training else "hard")
    return ALIASES.get(mode, mode)


class AdaptiveLayer:
    """What every layer that takes decisions shares (a mixin beside nn.Module): its mode and its
    recording."""

    adaptex_path: str = ""

    def resolve_mode(self, mode: str | None) -> str:
        return _resolve(mode, self.training)

    def forced(self, field: str) -> Tensor | None:
        return _RECORDERS[-1].forced(self.adaptex_path or type(self).__name__, field) if _RECORDERS else None

    def record(self, values: dict, margins: dict | None = None, aux: dict | None = None) -> None:
        if _RECORDERS:
            _RECORDERS[-1].record(self.adaptex_path or type(self).__name__, values, margins, aux)


# --- BudgetFormer: k of H heads per input ------------------------------------------------------------

@dataclass
class RoutingSchedule:
    """Training-time knobs that change with progress t in [0, 1] (all ignored at inference)."""
    tau: float = 1.0  # score temperature
    noise_std: float = 0.0  # exploration noise on the head scores
    rank_sharpness: float = 0.0  # 0 disables the budget-aware rank mask (see BudgetedAttention)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over the real tokens only: (B, T, d), (B, T) bool -> (B, d).

    Written as a (1 x T) @ (T x d) product: exported, it is one GEMV rather than a multiply and a
    strided reduction, which runtimes execute several times slower."""
    m = mask.to(x.dtype).unsqueeze(1)  # (B, 1, T)
    return (m @ x).squeeze(1) / m.sum(-1).clamp_min(1.0)  # (B, d)


class BudgetRouter(nn.Module):
    """Budget network f_theta and head-scoring network g_phi on the mask-aware mean of the input."""

    def __init__(self, d_model: int, num_heads: int, hidden: int = 64):
        super().__init__()
        self.budget = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, 1))
        self.scorer = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, num_heads))

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        # Routers stay fp32: in fp16, floor(s*H) lands on the other side of an integer for inputs
        # near the boundary, and the top-k order flips on near-ties.
        h = masked_mean(x.float(), mask)  # (B, d)
        s = torch.sigmoid(self.budget(h)).squeeze(-1)  # (B,)
        z = self.scorer(h)  # (B, H)
        return s, z


class BudgetedAttention(AdaptiveLayer, nn.Module):
    """Multi-head self-attention that computes k = clamp(floor(s*H), 1, H) of its H heads per input.

    From the mask-aware mean of x: a budget s in (0, 1) and head preferences p = softmax(z / tau);
    head i's output is scaled by w_i = s * H * p_i. Soft mode (training) computes every head with
    those weights; hard mode computes only the top-k heads by p (`adaptex::budgeted_attention`).
    forward(x (B, T, d), mask (B, T), 1 or True = real token) -> (B, T, d).
    Decisions: k (B,) int64, head_mask (B, H) bool, s (B,) float32.
    Training losses: `budget_loss` (keeps s inside [s_min, s_max]) on the recorded s and p."""

    def __init__(self, d_model: int, num_heads: int, router_hidden: int = 64, tau: float = 0.5,
                 adaptive: bool = True):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.tau = num_heads, tau
        self.qkv = nn.Linear(d_model, 3 * d_model)  # rows [q heads | k heads | v heads]
        self.out = nn.Linear(d_model, d_model)
        self.router = BudgetRouter(d_model, num_heads, router_hidden) if adaptive else None
        self.schedule = RoutingSchedule(tau=1.0)  # soft mode's knobs; a training loop anneals them

    def forward(self, x: Tensor, mask: Tensor | None = None, *, mode: str | None = None,
                sched: RoutingSchedule | None = None, force_mask: Tensor | None = None,
                return_decisions: bool = False):
        """y (B, T, d); with return_decisions, (y, decisions) (the shipped BudgetFormer's call)."""
        if mask is None:
            mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        y, dec = self._attend(x, mask.bool(), self.resolve_mode(mode), sched, force_mask)
        return (y, dec) if return_decisions else y

    def _attend(self, x: Tensor, mask: Tensor, mode: str, sched: RoutingSchedule | None,
                force_mask: Tensor | None) -> tuple[Tensor, dict]:
        H = self.num_heads
        if self.router is None or mode == "dense":
            return self._dense(x, mask, None, explicit=not self.training), {}
        sched = sched or self.schedule
        s, z = self.router(x, mask)
        if mode in SOFT_MODES:
            if sched.noise_std > 0:
                z = z + sched.noise_std * torch.randn_like(z)
            p = torch.softmax(z / sched.tau, dim=-1)  # (B, H)
            w = ba.head_weights(s, p, H)  # (B, H)
            if sched.rank_sharpness > 0:
                # Budget-aware rank mask (an adaptex addition to BudgetFormer's soft mode): head of
                # rank r is scaled by sigmoid(g*(s*H - r - 1/2)), so s only pays off through the heads
                # it keeps and its gradient learns what one more head is worth on this input. As g
                # grows the mask approaches the hard top-k of inference and the soft/hard gap closes.
                ranks = ba.head_ranks(p).float()  # (B, H)
                w = w * torch.sigmoid(sched.rank_sharpness * (s[:, None] * H - ranks - 0.5))
            dec = {"s": s, "p": p}
            self.record(dec)
            return self._dense(x, mask, w), dec
        p = torch.softmax(z / self.tau, dim=-1)
        force_mask = force_mask if force_mask is not None else self.forced("head_mask")
        args = (x, mask, s, p, self.qkv.weight, self.qkv.bias, self.out.weight, self.out.bias, H)
        if mode == "hard" and force_mask is None:
            y, k, head_mask = torch.ops.adaptex.budgeted_attention(*args)
        elif mode in ("hard", "naive"):
            y, k, head_mask = ba.budgeted_attention_dense_reference(*args, head_mask=force_mask)
        elif mode == "eager":
            y, k, head_mask = ba.budgeted_attention_eager(*args)
        else:
            raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
        if _RECORDERS and not torch.compiler.is_exporting():
            sH = s.double() * H
            self.record({"k": k, "head_mask": head_mask, "s": s}, margins={"k": (sH - sH.round()).abs()}, aux={"p": p})
        else:
            self.record({"k": k, "head_mask": head_mask, "s": s})
        return y, {"s": s, "p": p, "k": k, "head_mask": head_mask}

    def _dense(self, x: Tensor, mask: Tensor, w: Tensor | None, explicit: bool = False) -> Tensor:
        B, T, d = x.shape
        H = self.num_heads
        q, k, v = self.qkv(x).view(B, T, 3, H, d // H).permute(2, 0, 3, 1, 4)  # (B, H, T, dh) each
        if explicit:
            # Inference/export form: an additive key mask and a plain softmax. The stock exporter
            # turns SDPA with a bool mask into extra Where/IsNaN passes that would slow the dense
            # counterpart down and flatter every adaptive figure measured against it.
            bias = torch.zeros(B, 1, 1, T, dtype=q.dtype, device=q.device).masked_fill(
                ~mask[:, None, None, :], float("-inf"))
            att = torch.softmax(q @ k.transpose(-1, -2) * (d // H) ** -0.5 + bias, dim=-1)  # (B,H,T,T)
            o = att @ v  # (B, H, T, dh)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])  # (B,H,T,dh)
        if w is not None:
            o = o * w[:, :, None, None].to(o.dtype)
        return self.out(o.transpose(1, 2).reshape(B, T, d))


def budget_hinge(s: Tensor, s_min: float, s_max: float) -> Tensor:
    """Zero inside [s_min, s_max], quadratic outside."""
    return F.relu(s_min - s) ** 2 + F.relu(s - s_max) ** 2


def budget_loss(rec: Recorder, s_min: float = 0.25, s_max: float = 0.375, beta: float = 0.0) -> Tensor:
    """BudgetFormer's routing loss over every budgeted layer a soft-mode pass recorded: the budget
    hinge on the mean s plus beta times the head-preference entropy (beta < 0 early: exploration)."""
    layers = [d for d in rec.decisions.values() if "s" in d and "p" in d]
    if not layers:
        raise ValueError("no BudgetedAttention decisions were recorded; call the model inside record_decisions()")
    hinge = sum(budget_hinge(d["s"].mean(), s_min, s_max) for d in layers)
    entropy = sum(-(d["p"] * d["p"].clamp_min(1e-9).log()).sum(-1).mean() for d in layers)
    return (hinge + beta * entropy) / len(layers)


# --- TSA: tokens that skip a block's query side and FFN ---------------------------------------------

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
        return torch.sigmoid(self.net(h.float()).squeeze(-1))  # (B, T) fp32

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
            gate = keep.float() * (1 - p)
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
        self.h, self.dh = num_heads, d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, bias: Tensor, past_k: Tensor, past_v: Tensor):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)  # each (B, H, T, dh)
        k = torch.cat([past_k, k], dim=2)  # (B, H, P+T, dh)
        v = torch.cat([past_v, v], dim=2)
        att = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.dh)) + bias).softmax(-1)  # (B, H, T, P+T)
        y = (att @ v).transpose(1, 2).reshape(B, T, d)  # (B, T, d)
        return self.proj(y), k, v

    def kv(self, x: Tensor, past_k: Tensor, past_v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of every token (past + these T), each (B, H, P+T, dh): the rows of the
        fused projection after the query's, so a gated block projects queries for kept tokens only."""
        B, T, d = x.shape
        k, v = F.linear(x, self.qkv.weight[d:], self.qkv.bias[d:]).view(B, T, 2, self.h, self.dh).permute(2, 0, 3, 1, 4)
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)

    def query_args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(wq, bq, wo, bo) for adaptex::conditional_attention."""
        d = self.proj.weight.shape[0]
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


# --- Elastic Attention: each head full or streaming ---------------------------------------------------

class HeadRouter(nn.Module):
    """[FA, SA] logits per head from the layer's keys pooled over the first and last N real tokens,
    a task MLP shared by the heads plus a per-head bias, and a router MLP.

    Pooling: mask-weighted over the real tokens' ranks (encoders), or, with edge_pooling, two runs of
    N keys sliced from the first real token (decoder batches are left-padded) and from the end: O(N)
    whatever the length, so a decoder's router costs a decode step little."""

    def __init__(self, num_heads: int, head_dim: int, hidden: int = 64, pool_tokens: int = 100,
                 edge_pooling: bool = False):
        super().__init__()
        self.pool_tokens, self.edge_pooling = pool_tokens, edge_pooling
        self.task = nn.Sequential(nn.Linear(2 * head_dim, hidden), nn.GELU())
        self.head_bias = nn.Parameter(torch.zeros(num_heads, hidden))
        self.router = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 2))

    def pool(self, k: Tensor, key_mask: Tensor) -> Tensor:
        """(B, H, S, dh) keys -> (B, H, 2 dh): means over the first and the last N real tokens."""
        return self._pool_edges(k, key_mask) if self.edge_pooling else self._pool_ranked(k, key_mask)

    def _pool_ranked(self, k: Tensor, key_mask: Tensor) -> Tensor:
        m = key_mask.to(k.dtype)  # (B, S)
        rank = torch.cumsum(m, dim=1) - 1  # rank of each real token among the real ones
        n_real = m.sum(1, keepdim=True)
        first = m * (rank < self.pool_tokens).to(k.dtype)
        last = m * (rank >= n_real - self.pool_tokens).to(k.dtype)

        def mean(w):
            return (k * w[:, None, :, None]).sum(2) / w.sum(1).clamp(min=1)[:, None, None]
        return torch.cat([mean(first), mean(last)], dim=-1)

    def _pool_edges(self, k: Tensor, key_mask: Tensor) -> Tensor:
        B, H, S, dh = k.shape
        r = torch.arange(self.pool_tokens, device=k.device)[None, :]  # (1, N): a constant N, whatever S
        n_real = key_mask.long().sum(1, keepdim=True)  # (B, 1)
        offset = S - n_real  # left padding
        firsts = offset + r  # (B, N) the first N real positions
        lasts = (S - self.pool_tokens + r).expand(B, -1)  # (B, N) the last N positions
        w_first = (r < n_real).to(k.dtype)
        w_last = (lasts >= offset).to(k.dtype)

        def mean(pos, w):
            idx = pos.clamp(0, S - 1)[:, None, :, None].expand(B, H, -1, dh)
            return (torch.gather(k, 2, idx) * w[:, None, :, None]).sum(2) / w.sum(1).clamp(min=1)[:, None, None]
        return torch.cat([mean(firsts, w_first), mean(lasts, w_last)], dim=-1)

    def route(self, k: Tensor, key_mask: Tensor) -> Tensor:
        h = self.task(self.pool(k.float(), key_mask)) + self.head_bias  # (B, H, hidden)
        return self.router(h)  # (B, H, 2) fp32: [FA, SA]

    def forward(self, k: Tensor, key_mask: Tensor) -> Tensor:
        return self.route(k, key_mask)


class ElasticAttention(AdaptiveLayer, HeadRouter):
    """Every head of a layer in one op, each head full attention (FA) or streaming attention (SA:
    the first `sink` keys plus a local `window`; causal for decoders, a symmetric band for encoders).

    forward(q, k, v (B, H, T|S, dh), key_mask (B, S) 1 = real key) -> (B, H, T, dh). Its only
    parameters are its router's (it is a HeadRouter): the router reads the keys and gives each head
    [FA, SA] logits; hard mode takes SA where that logit is larger. Soft mode (training) mixes both
    outputs by a straight-through Gumbel-softmax sample at temperature `tau` (anneal it).
    A decoder routes once at prefill and reuses the modes at decode steps: pass them as head_modes
    (B, H) bool, with use_modes (a bool scalar tensor; None: always) choosing them over the routed
    ones inside one traced graph. Decisions: sa (B, H) bool, logits (B, H, 2)."""

    def __init__(self, num_heads: int, head_dim: int, sink: int = 4, window: int = 32, causal: bool = False,
                 router_hidden: int = 64, pool_tokens: int = 100, edge_pooling: bool | None = None):
        if sink < 0 or window < 1:
            raise ValueError(f"sink must be >= 0 and window >= 1 (got sink={sink}, window={window})")
        super().__init__(num_heads, head_dim, router_hidden, pool_tokens,
                         edge_pooling=causal if edge_pooling is None else edge_pooling)
        self.sink, self.window, self.causal, self.tau = sink, window, causal, 1.0

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, head_modes: Tensor | None = None,
                use_modes: Tensor | None = None, *, mode: str | None = None, force_sa: Tensor | None = None,
                tau: float | None = None, return_decisions: bool = False):
        """o (B, H, T, dh); with return_decisions, (o, decisions) (the shipped elastic models' call)."""
        o, dec = self._attend(q, k, v, key_mask, head_modes, use_modes, self.resolve_mode(mode), force_sa, tau)
        return (o, dec) if return_decisions else o

    def _attend(self, q, k, v, key_mask, head_modes, use_modes, mode, force_sa, tau) -> tuple[Tensor, dict]:
        key_mask = key_mask.bool()
        if mode == "dense":  # every head full attention: the backbone itself
            fa = torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
            return ea.elastic_attention_dense_reference(q, k, v, fa, key_mask, self.sink, self.window, self.causal), {}
        logits = self.route(k, key_mask)  # (B, H, 2)
        if mode in SOFT_MODES:
            g = F.gumbel_softmax(logits, tau=tau or self.tau, hard=True)[..., 1]  # (B, H): 1 = SA, ST gradient
            sa = g > 0.5
            fa_o, sa_o = (ea.elastic_attention_dense_reference(q, k, v, torch.full_like(sa, m), key_mask, self.sink,
                                                               self.window, self.causal) for m in (False, True))
            o = fa_o + (sa_o - fa_o) * g[:, :, None, None].to(q.dtype)
            self.record({"sa": sa, "logits": logits}, aux={"g": g})
            return o, {"sa": sa, "logits": logits, "g": g}
        sa = logits[..., 1] > logits[..., 0]
        if head_modes is not None:
            given = head_modes.bool()
            # logic, not a bool Where (ONNX Runtime has none)
            sa = given if use_modes is None else (use_modes & given) | (~use_modes & sa)
        margin = None
        if not torch.compiler.is_exporting():
            gap = (logits[..., 1] - logits[..., 0]).abs().double()
            if head_modes is not None:  # an input: no flip of it is excusable
                margin = torch.full_like(gap, math.inf) if use_modes is None else \
                    torch.where(use_modes, torch.full_like(gap, math.inf), gap)
            else:
                margin = gap
        force_sa = force_sa if force_sa is not None else self.forced("sa")
        if force_sa is not None:
            sa = force_sa.bool()
        fn = ea.elastic_attention if mode in ("hard", "eager") else ea.elastic_attention_dense_reference
        o = fn(q, k, v, sa, key_mask, self.sink, self.window, self.causal)
        self.record({"sa": sa, "logits": logits}, margins={"sa": margin} if margin is not None else None)
        return o, {"sa": sa, "logits": logits, "g": sa.float()}


def sparsity(rec_or_decisions) -> Tensor:
    """Omega: the fraction of SA heads over every ElasticAttention (soft: the straight-through
    weights, so it has a gradient). Takes a Recorder or a family's list of decision dicts."""
    if isinstance(rec_or_decisions, Recorder):
        gs = [rec_or_decisions.aux[p].get("g", d["sa"].float()) for p, d in rec_or_decisions.decisions.items()
              if "sa" in d]
    else:
        gs = [d["g"] for d in rec_or_decisions]
    if not gs:
        raise ValueError("no ElasticAttention decisions were recorded; call the model inside record_decisions()")
    return torch.stack([g.float().mean() for g in gs]).mean()


# the layers whose own computation is routing (every node they trace, but their adaptex op, stays fp32)
ROUTING_LAYERS = (BudgetedAttention, TokenRouter, ElasticAttention)


def routing_class_names() -> tuple[str, ...]:
    """Qualified class names of the routing layers, as traced graphs record them (module stacks)."""
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in ROUTING_LAYERS)
