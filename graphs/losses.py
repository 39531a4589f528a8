"""BudgetFormer's training objective: L_task + L_budget + L_entropy, and its schedules."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def budget_hinge(s: Tensor, s_min: float, s_max: float) -> Tensor:
    """Quadratic hinge: zero inside [s_min, s_max], (distance outside)^2 beyond it."""
    return torch.relu(s_min - s) ** 2 + torch.relu(s - s_max) ** 2


def head_entropy(p: Tensor) -> Tensor:
    """Entropy of the head preferences, (B, H) -> (B,)."""
    return -(p * torch.log(p.clamp_min(1e-9))).sum(-1)


def linear(t: float, start: float, end: float) -> float:
    return start + (end - start) * min(max(t, 0.0), 1.0)


def geometric(t: float, start: float, end: float) -> float:
    """Exponential interpolation: tau(t) falls by the same factor each step."""
    t = min(max(t, 0.0), 1.0)
    return start * math.exp(t * math.log(end / start))


def entropy_beta(t: float, beta_explore: float, beta_exploit: float, turn: float = 0.5) -> float:
    """beta(t): negative before `turn` (rewards high entropy: exploration), positive after
    (rewards low entropy: specialisation), moving linearly through zero at `turn`."""
    if t < turn:
        return beta_explore * (1.0 - t / turn)
    return beta_exploit * (t - turn) / (1.0 - turn)
