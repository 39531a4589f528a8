"""The Core ML lowerings of the adaptex ops: each returns the MIL emitter of its variant (mil_ops.py)."""
from __future__ import annotations

from functools import partial

from adaptex.exporter.registry import lowering
from adaptex.exporter.targets.coreml import mil_ops


@lowering("adaptex::budgeted_attention", target="coreml", variant="sparse")
def budgeted_attention_coreml_sparse(ctx, node):
    """MIL topk needs a constant k: argsort + slice_by_index with a runtime end (the batch's largest k)
    + gather of those heads' weights; attention on k heads only."""
    return partial(mil_ops.budgeted_attention_mil, variant="sparse")


@lowering("adaptex::budgeted_attention", target="coreml", variant="dense")
def budgeted_attention_coreml_dense(ctx, node):
    """Static shapes: argsort over all heads, every head computed, unselected heads weighted by zero;
    the variant that can stay on the Neural Engine."""
    return partial(mil_ops.budgeted_attention_mil, variant="dense")


@lowering("adaptex::conditional_ffn", target="coreml", variant="sparse")
def conditional_ffn_coreml_sparse(ctx, node):
    """non_zero on the (B, T) keep mask ((batch, token) index pairs), gather_nd of the kept tokens'
    rows, layer_norm + linear + gelu + linear on them only, scatter_nd (mode update) back: dynamic
    shapes, skipped tokens cost nothing (runs off the Neural Engine)."""
    return partial(mil_ops.conditional_ffn_mil, variant="sparse")


@lowering("adaptex::conditional_ffn", target="coreml", variant="dense")
def conditional_ffn_coreml_dense(ctx, node):
    """Static shapes: every token through layer_norm + FFN, the update multiplied by keep * gate
    (fp32 routing), so skipped tokens pass through unchanged; the variant that can stay on the
    Neural Engine."""
    return partial(mil_ops.conditional_ffn_mil, variant="dense")


@lowering("adaptex::conditional_attention", target="coreml", variant="sparse")
def conditional_attention_coreml_sparse(ctx, node):
    """argsort of the (B, T) keep mask sliced at the batch's largest kept count (a runtime end),
    gather_nd of those query rows and their bias rows, queries + scores + softmax + AV + output
    projection on them only, scatter_nd (mode update) back: a skipped token's query side costs
    nothing (runs off the Neural Engine)."""
    return partial(mil_ops.conditional_attention_mil, variant="sparse")


@lowering("adaptex::conditional_attention", target="coreml", variant="dense")
def conditional_attention_coreml_dense(ctx, node):
    """Static shapes: every query row attended, the update multiplied by keep * gate (fp32 routing);
    the variant that can stay on the Neural Engine."""
    return partial(mil_ops.conditional_attention_mil, variant="dense")


@lowering("adaptex::elastic_attention", target="coreml", variant="sparse")
def elastic_attention_coreml_sparse(ctx, node):
    """non_zero over sa splits the (batch, head) pairs by mode, gather_nd gathers each group's q, k, v
    and key-mask rows; FA pairs: matmul + softmax over every visible key; SA pairs: block-local, a
    gather by a (blocks, L) key index gives each block of Bq = min(window, T) queries its own run of
    keys, plus the sinks (O(T * (sink + window)), no T x S scores); scatter_nd (mode update) puts
    both groups back. Dynamic shapes: runs off the Neural Engine."""
    return partial(mil_ops.elastic_attention_mil, variant="sparse")


@lowering("adaptex::elastic_attention", target="coreml", variant="dense")
def elastic_attention_coreml_dense(ctx, node):
    """Static shapes: every head's full T x S score matrix, SA heads through a band mask (sinks +
    local window, built from range_1d positions) selected per head by sa, padded keys by the key
    mask, all as additive biases before one softmax; the variant that can stay on the Neural Engine."""
    return partial(mil_ops.elastic_attention_mil, variant="dense")
