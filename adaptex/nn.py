"""adaptex.nn: the adaptive layers for your own models (see adaptex.graphs.nn and docs/api.md)."""
from adaptex.graphs.nn import (  # noqa: F401
    DECISION_KINDS, BudgetedAttention, adapt, BudgetRouter, ConditionalBlock, ElasticAttention, HeadRouter, Recorder,
    RoutingSchedule, TokenRouter, adaptive_mode, budget_loss, causal_bias, depth_loss, masked_mean,
    record_decisions, sparsity)

__all__ = ["adapt", "BudgetedAttention", "BudgetRouter", "RoutingSchedule", "TokenRouter", "ConditionalBlock", "causal_bias",
           "ElasticAttention", "HeadRouter", "Recorder", "record_decisions", "adaptive_mode", "budget_loss",
           "depth_loss", "sparsity", "masked_mean", "DECISION_KINDS"]
