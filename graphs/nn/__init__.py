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
from adaptex.graphs.nn.adapt import adapt  # noqa: F401
from adaptex.graphs.nn.budgeted import (BudgetedAttention, BudgetRouter, RoutingSchedule, budget_hinge,  # noqa: F401
                                        budget_loss, masked_mean)
from adaptex.graphs.nn.elastic import ElasticAttention, HeadRouter, sparsity  # noqa: F401
from adaptex.graphs.nn.record import (ALIASES, DECISION_KINDS, MODES, AdaptiveLayer, Recorder,  # noqa: F401
                                      adaptive_mode, control_flow_traced, name_layers, record_decisions,
                                      traced_control_flow)
from adaptex.graphs.nn.tsa import (CausalSelfAttention, ConditionalBlock, TokenRouter, causal_bias,  # noqa: F401
                                   causal_visibility, depth_loss)

__all__ = ["adapt", "BudgetedAttention", "BudgetRouter", "RoutingSchedule", "TokenRouter", "ConditionalBlock",
           "ElasticAttention", "HeadRouter", "Recorder", "record_decisions", "adaptive_mode", "causal_bias",
           "budget_loss", "depth_loss", "sparsity", "masked_mean", "DECISION_KINDS"]

# the layers whose own computation is routing (every node they trace, but their adaptex op, stays fp32)
ROUTING_LAYERS = (BudgetedAttention, TokenRouter, ElasticAttention)


def class_name(cls) -> str:
    """A class's qualified name, as traced graphs record module types."""
    return f"{cls.__module__}.{cls.__qualname__}"


def routing_class_names() -> tuple[str, ...]:
    """Qualified class names of the routing layers (module stacks of traced graphs name them so)."""
    return tuple(class_name(c) for c in ROUTING_LAYERS)
