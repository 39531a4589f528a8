"""BudgetFormer: an encoder classifier whose attention layers pick k of H heads per input.

Per layer, from the mask-aware mean of the layer input h:
  s = sigmoid(f_theta(h))             budget: the fraction of heads to use
  p = softmax(g_phi(h) / tau)         head preferences
  w_i = s * H * p_i                   head i's output scale
Training ("soft") computes every head; inference ("hard") computes only the top-k heads by p with
k = clamp(floor(s*H), 1, H), through the custom op `adaptex::budgeted_attention`.

`adaptive=False` gives the standard Transformer of the same size (every head, unscaled): the
accuracy baseline, and (with a BudgetFormer's weights) the dense counterpart that latency is
measured against.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.ops import budgeted_attention as ba

MODES = ("soft", "hard", "naive", "eager", "dense")


@dataclass
class BudgetFormerConfig:
    vocab_size: int = 64
    num_classes: int = 4
    d_model: int = 256
    num_heads: int = 8
    num_layers: int = 2
    d_ff: int = 1024
    max_len: int = 256
    router_hidden: int = 64
    pad_id: int = 0
    adaptive: bool = True
    s_min: float = 0.25  # budget target interval: the hinge loss is zero inside [s_min, s_max]
    s_max: float = 0.375
    tau_infer: float = 0.5  # softmax temperature of the head scores at inference (= end of training)
    family: str = field(default="budgetformer", init=False)

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if not 0.0 < self.s_min <= self.s_max < 1.0:
            raise ValueError(f"budget range [{self.s_min}, {self.s_max}] must lie in (0, 1)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BudgetFormerConfig":
        d = {k: v for k, v in d.items() if k != "family"}
        return cls(**d)


def sinusoids(n: int, d: int) -> Tensor:
    """(n, d) fixed positional encodings: sin on even channels, cos on odd, geometric wavelengths."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
    pe = torch.zeros(n, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over the real tokens only: (B, T, d), (B, T) bool -> (B, d).

    Written as a (1 x T) @ (T x d) product: exported, it is one GEMV rather than a multiply and a
    strided reduction, which runtimes execute several times slower."""
    m = mask.to(x.dtype).unsqueeze(1)  # (B, 1, T)
    return (m @ x).squeeze(1) / m.sum(-1).clamp_min(1.0)  # (B, d)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max over the real tokens only: (B, T, d), (B, T) bool -> (B, d). The classifier pools this
    way: one decisive token's features survive it, where a mean would dilute them by the length."""
    return x.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)


@dataclass
class RoutingSchedule:
    """Training-time knobs that change with progress t in [0, 1] (all ignored at inference)."""
    tau: float = 1.0  # score temperature
    noise_std: float = 0.0  # exploration noise on the head scores
    rank_sharpness: float = 0.0  # 0 disables the budget-aware rank mask (see BudgetedSelfAttention)


class HeadRouter(nn.Module):
    """Budget network f_theta and head-scoring network g_phi on the pooled layer input."""

    def __init__(self, cfg: BudgetFormerConfig):
        super().__init__()
        d, r = cfg.d_model, cfg.router_hidden
        self.budget = nn.Sequential(nn.Linear(d, r), nn.GELU(), nn.Linear(r, 1))
        self.scorer = nn.Sequential(nn.Linear(d, r), nn.GELU(), nn.Linear(r, cfg.num_heads))

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        # Routers stay fp32: in fp16, floor(s*H) lands on the other side of an integer for inputs
        # near the boundary, and the top-k order flips on near-ties.
        h = masked_mean(x.float(), mask)  # (B, d)
        s = torch.sigmoid(self.budget(h)).squeeze(-1)  # (B,)
        z = self.scorer(h)  # (B, H)
        return s, z


class BudgetedSelfAttention(nn.Module):
    def __init__(self, cfg: BudgetFormerConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # rows [q heads | k heads | v heads]
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.router = HeadRouter(cfg) if cfg.adaptive else None

    def forward(self, x: Tensor, mask: Tensor, mode: str, sched: RoutingSchedule,
                force_mask: Tensor | None = None) -> tuple[Tensor, dict]:
        B, T, d = x.shape
        H = self.num_heads
        if self.router is None or mode == "dense":
            return self._dense(x, mask, None, explicit=not self.training), {}
        s, z = self.router(x, mask)
        if mode == "soft":
            if sched.noise_std > 0:
                z = z + sched.noise_std * torch.randn_like(z)
            p = torch.softmax(z / sched.tau, dim=-1)  # (B, H)
            w = ba.head_weights(s, p, H)  # (B, H)
            if sched.rank_sharpness > 0:
                # Budget-aware rank mask (an adaptex addition to the paper's soft mode): head of rank r
                # is scaled by sigmoid(g*(s*H - r - 1/2)), so s only pays off through the heads it
                # keeps and its gradient learns what one more head is worth on this input. As g
                # grows the mask approaches the hard top-k of inference and the soft/hard gap closes.
                ranks = ba.head_ranks(p).float()  # (B, H)
                w = w * torch.sigmoid(sched.rank_sharpness * (s[:, None] * H - ranks - 0.5))
            y = self._dense(x, mask, w)
            return y, {"s": s, "p": p}
        p = torch.softmax(z / self.cfg.tau_infer, dim=-1)
        args = (x, mask, s, p, self.qkv.weight, self.qkv.bias, self.out.weight, self.out.bias, H)
        if mode == "hard" and force_mask is None:
            y, k, head_mask = torch.ops.adaptex.budgeted_attention(*args)
        elif mode in ("hard", "naive"):
            y, k, head_mask = ba.budgeted_attention_dense_reference(*args, head_mask=force_mask)
        elif mode == "eager":
            y, k, head_mask = ba.budgeted_attention_eager(*args)
        else:
            raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
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


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BudgetFormerConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = BudgetedSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x, mask, mode, sched, force_mask=None):
        a, dec = self.attn(self.ln1(x), mask, mode, sched, force_mask)
        x = x + a
        x = x + self.ffn(self.ln2(x))
        return x, dec


class BudgetFormer(nn.Module):
    def __init__(self, cfg: BudgetFormerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Fixed sinusoidal positions: relative offsets are a linear map of them, so binding a token
        # to its neighbour (what the graded task needs) is learned in hundreds of steps, not thousands.
        self.register_buffer("pos", sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # A two-layer head: classes that compose several cues (sums, differences) are not linear
        # in the pooled features.
        self.head = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.GELU(),
                                  nn.Linear(cfg.d_model, cfg.num_classes))
        self.apply(self._init)

    @staticmethod
    def _init(m):
        # Token embeddings keep unit scale, comparable to the sinusoids (a 0.02 init would drown
        # token identity under position).
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, mode: str = "hard",
                sched: RoutingSchedule | None = None,
                force_masks: list[Tensor] | None = None) -> tuple[Tensor, list[dict]]:
        """(B, T) ids and mask -> logits (B, C) and per-layer decisions.

        mode: "soft" (training), "hard" (inference through the custom op), "naive" (inference with
        every head computed and masked: what a stock exporter sees), "eager" (the op's skipping
        kernel as plain Python: what tracers bake), "dense" (no routing at all).
        force_masks: per-layer (B, H) head masks to replay a given routing (parity uses it).
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
        sched = sched or RoutingSchedule()
        B, T = input_ids.shape
        mask = attention_mask.bool()  # (B, T)
        x = self.tok(input_ids) + self.pos[:T][None]  # (B, T, d)
        decisions = []
        for i, layer in enumerate(self.layers):
            fm = None if force_masks is None else force_masks[i]
            x, dec = layer(x, mask, mode, sched, fm)
            decisions.append(dec)
        logits = self.head(masked_max(self.ln_f(x), mask))  # (B, C)
        return logits, decisions


def flops_per_sample(cfg: BudgetFormerConfig, seq_len: int, heads_per_layer: list[float] | None) -> float:
    """Multiply-adds x2 of one forward pass at length T; heads_per_layer=None means every head.

    Counts projections, attention and FFN (what the heads budget changes, plus the fixed cost);
    router cost is included for adaptive models since it is real work the dense model does not do.
    """
    d, H, T, f = cfg.d_model, cfg.num_heads, seq_len, cfg.d_ff
    dh = d // H
    total = 0.0
    for layer in range(cfg.num_layers):
        k = H if heads_per_layer is None else heads_per_layer[layer]
        total += 2 * T * d * 3 * dh * k  # QKV projection of k heads
        total += 2 * 2 * T * T * dh * k  # scores and weighted values
        total += 2 * T * k * dh * d  # output projection
        total += 2 * 2 * T * d * f  # FFN
        if cfg.adaptive and heads_per_layer is not None:
            total += 2 * 2 * (d * cfg.router_hidden) + 2 * cfg.router_hidden * (1 + H)
    total += 2 * d * d + 2 * d * cfg.num_classes  # classifier head
    return total
