"""Tiny configurations every test reuses."""
from __future__ import annotations

import torch

from graphs import checkpoint
from graphs.budgetformer import BudgetFormer, BudgetFormerConfig

TINY = dict(vocab_size=64, num_classes=4, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=64,
            router_hidden=16)


def tiny_model(seed: int = 0, spread: float = 40.0, **overrides) -> BudgetFormer:
    """An untrained tiny BudgetFormer. `spread` scales the routers' last layers so that budgets and
    head preferences vary widely across inputs (an untrained router would give k = constant)."""
    torch.manual_seed(seed)
    model = BudgetFormer(BudgetFormerConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.router.budget[2].weight.mul_(spread)
            layer.attn.router.scorer[2].weight.mul_(spread)
    return model.eval()


def save_tiny(path, **kw):
    return checkpoint.save(path, tiny_model(**kw), {"training": {"task": "graded"}, "description": "test model"})


TINY_TSA = dict(vocab_size=32, d_model=32, num_heads=4, num_layers=3, d_ff=64, max_len=32)


def tiny_tsa(seed: int = 0, spread: float = 20.0, **overrides):
    """An untrained tiny TSA decoder whose routers are scaled so keep decisions vary across tokens."""
    from graphs.tsa import TSAConfig, TSADecoder

    torch.manual_seed(seed)
    model = TSADecoder(TSAConfig(**{**TINY_TSA, **overrides}))
    with torch.no_grad():
        for r in model.routers:
            r.net[0].weight.mul_(spread)
            r.net[2].weight.mul_(spread)
    return model.eval()
