"""BudgetFormer's layer: self-attention that computes k of H heads per input."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.nn.record import _RECORDERS, MODES, SOFT_MODES, AdaptiveLayer, Recorder, check_inputs
from adaptex.graphs.ops import budgeted_attention as ba
from adaptex.graphs.parallel import batch_noise


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
        check_inputs(type(self).__name__, x, mask, self.qkv.in_features, weights=self.qkv.weight)
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
                z = z + sched.noise_std * batch_noise(z.shape, lambda s: torch.randn(s, dtype=z.dtype, device=z.device))
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


