"""Core ML target (ML program): each adaptex op translated to MIL through coremltools' torch.export path.

budgeted_attention (BudgetFormer): MIL `topk` takes only a constant k, so dynamic k is argsort +
slice_by_index with a runtime end + gather (`sparse`); `dense` keeps static shapes (argsort over all
heads, every head computed, the unselected ones weighted by zero), the variant that can stay on the
Neural Engine.

conditional_attention (TSA decoder): `sparse` is argsort over the (B, T) keep mask sliced at the
batch's largest kept count, gather_nd of those query rows, attention on them only,
scatter_nd back; `dense` attends every query row and scales the update by keep * gate.

conditional_ffn (TSA decoder): `sparse` is non_zero over the (B, T) keep mask, gather_nd of the
kept tokens' rows, layer_norm + linear + gelu + linear on them only, scatter_nd (mode update) back:
the row count is known at run time only, so it runs off the Neural Engine; `dense` computes every token and
scales the update by keep * gate (static shapes).

elastic_attention (Elastic encoders): `sparse` is non_zero over sa and gather_nd of each mode's
(batch, head) pairs; FA pairs attend every visible key, SA pairs block-local (a gather by a
(blocks, L) key index gives each block of queries its own run of keys, plus the sinks), and
scatter_nd (mode update) writes both groups back; `dense` scores every head over the full T x S
matrix, SA heads through a band mask. Masks are additive biases of -1e4 (fp16-safe), so a query
that sees no key at all (only ever a padded one) averages over its raw scores where the eager
kernel averages uniformly; such rows never reach an output. An encoder layer whose heads are all
in one mode runs the other group on zero pairs: fine in the MIL reference evaluation, unverified
on the Core ML runtime (see the zero-size caveat below).

fp16 (default) or fp32 bodies; routing (routers, temperature softmax, floor(s*H), ranking; TSA's
token routers, keep = p <= threshold and gate = keep * (1 - p); Elastic's HeadRouters and sa
decisions), the classifier tail (final norm, pooling, head; Elastic's mean pooling and L2 norm)
and every float output always fp32. A TSA package also keeps its residual stream
fp32 (embedding add, every residual add, conditional_ffn's residual add and scatter) and its
LayerNorms (mixed precision: matmuls, attention and FFN bodies fp16). A TSA package's LM head follows the body's
precision: it is O(B*T*d*V), as large as the body, and fp32 there buys little (its logits error is
the fp16 body's). Packages are checked on Linux by runtimes/coreml_mil.py and on macOS by
runtimes/coreml.py.

A TSA package takes Optimum's decoder-with-past inputs (input_ids, attention_mask, past_key_values.
{i}.key/value, dots written as underscores in Core ML feature names) with flexible batch, sequence
and past length; past_sequence may be 0 (MIN_PAST), so a prefill passes empty caches. coremltools 9
converts and saves such a range; whether the Core ML runtime accepts a zero-length input on every
compute unit cannot be checked on Linux (coremltools issues #1040 and #2516 report zero-size
tensors and lower bounds of 0 failing at prediction time), so check a prefill on macOS before
relying on it; the fallback is MIN_PAST = 1 with a masked dummy cache slot, which shifts positions.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

from adaptex.exporter import metadata as artifact
from adaptex.exporter.errors import ExportError
from adaptex.exporter.registry import lowering

PRECISIONS = ("fp16", "fp32")
DEFAULT_PRECISION = "fp16"


def default_precision(cfg) -> str:
    """fp16 bodies by default, except TSA decoders: their fp16 package missed the fp16 tolerance on
    the shipped character LM (max abs error 3.9e-2 against atol 1e-2 + rtol 1e-2, even with the
    residual stream and norms in fp32), so they default to fp32 and fp16 stays an explicit choice.
    Elastic encoders default to fp16 (routers, sa decisions and pooling fp32): their fp16 package
    passes the fp16 tolerance with no decision flips, on the tiny test encoder (max abs error
    1.1e-3, 40 inputs, sparse and dense) and on all-MiniLM-L6-v2 with untrained routers (3.3e-4,
    40 texts up to 512 tokens), both by MIL reference evaluation."""
    return "fp32" if cfg.family in ("tsa", "elastic_decoder") else DEFAULT_PRECISION
MIN_TARGETS = {"iOS16": "iOS16", "iOS17": "iOS17", "iOS18": "iOS18",
               "macOS13": "macOS13", "macOS14": "macOS14", "macOS15": "macOS15"}
DEFAULT_MIN_TARGET = "iOS17"
# MIL ops whose name (or an output's name) starts with one of these stay fp32 in an fp16 package:
# route_ for routing, resid_ for a decoder's residual stream (see decoder_residual_node_names)
FP32_PREFIXES = ("route_", "resid_")
# the variant each registered MIL translation emits during a convert, set from the registry per export
_VARIANT = {"adaptex::budgeted_attention": "sparse", "adaptex::conditional_ffn": "sparse",
            "adaptex::conditional_attention": "sparse", "adaptex::elastic_attention": "sparse"}


def _budgeted_attention_mil(context, node, variant: str):
    """Emit MIL for one adaptex::budgeted_attention node (weights are constants, laid out head-major)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs

    x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o, H = _get_inputs(context, node, expected=9)
    H = int(H.val)
    r = f"route_{node.name}_"  # routing ops carry this prefix: the fp16 pass leaves them in fp32
    wq, bq, wo, bo = (np.asarray(t.val, dtype=np.float32) for t in (w_qkv, b_qkv, w_o, b_o))
    d = wq.shape[1]
    dh = d // H
    w_h = wq.T.reshape(d, 3, H, dh).transpose(2, 0, 1, 3).reshape(H, d, 3 * dh)  # (H, d, 3dh)
    b_h = bq.reshape(3, H, dh).transpose(1, 0, 2).reshape(H, 1, 3 * dh)  # (H, 1, 3dh)
    wo_h = wo.T.reshape(H, dh, d)  # (H, dh, d)
    # routing, fp32: k = clamp(floor(s*H), 1, H); heads ranked by descending p
    sH = mb.mul(x=s, y=np.float32(H), name=r + "sH")
    kf = mb.clip(x=mb.floor(x=sH, name=r + "floor"), alpha=np.float32(1), beta=np.float32(H), name=r + "clip")
    k = mb.cast(x=kf, dtype="int32", name=r + "k")  # (B,)
    order = mb.argsort(x=p, axis=-1, ascending=False, name=r + "order")  # (B, H)
    ranks = mb.argsort(x=order, axis=-1, ascending=True, name=r + "ranks")  # inverse permutation
    head_mask = mb.less(x=ranks, y=mb.expand_dims(x=k, axes=[1], name=r + "k1"), name=r + "mask")  # (B, H)
    if variant == "sparse":
        kmax = mb.reduce_max(x=k, axes=[0], keep_dims=True)  # (1,): the batch's largest k
        batch = mb.slice_by_index(x=mb.shape(x=p), begin=[0], end=[1])
        order = mb.slice_by_index(x=order, begin=[0, 0], end=mb.concat(values=[batch, kmax], axis=0))  # (B, K)
        j = mb.range_1d(start=np.int32(0), end=mb.squeeze(x=kmax), step=np.int32(1))  # (K,)
    else:
        j = np.arange(H, dtype=np.int32)
    valid = mb.cast(x=mb.less(x=mb.expand_dims(x=j, axes=[0]), y=mb.expand_dims(x=k, axes=[1])), dtype="fp32",
                    name=r + "valid")
    topv = mb.gather_along_axis(x=p, indices=order, axis=1, name=r + "topv")
    weights = mb.mul(x=mb.mul(x=topv, y=mb.expand_dims(x=sH, axes=[1], name=r + "sH1"), name=r + "w0"),
                     y=valid, name=r + "weights")  # (B, K): s*H*p_i, zero past a sample's own k
    wg = mb.gather(x=w_h, indices=order, axis=0)  # (B, K, d, 3dh)
    bg = mb.gather(x=b_h, indices=order, axis=0)  # (B, K, 1, 3dh)
    qkv = mb.add(x=mb.matmul(x=mb.expand_dims(x=x, axes=[1]), y=wg), y=bg)  # (B, K, T, 3dh)
    q, kk, v = mb.split(x=qkv, num_splits=3, axis=-1)  # (B, K, T, dh) each
    scores = mb.mul(x=mb.matmul(x=q, y=kk, transpose_y=True), y=np.float32(dh ** -0.5))  # (B, K, T, T)
    # padded keys: a large negative bias (select with scalar branches loses its shape in coremltools 9).
    # -1e4, not -1e30: the body may run in fp16, where 1e30 is inf and 0 * inf is NaN.
    bias = mb.mul(x=mb.sub(x=mb.cast(x=key_mask, dtype="fp32"), y=np.float32(1)), y=np.float32(1e4))  # (B, T)
    scores = mb.add(x=scores, y=mb.expand_dims(x=bias, axes=[1, 2]))
    o = mb.matmul(x=mb.softmax(x=scores, axis=-1, name=f"{node.name}_attn_softmax"), y=v)  # (B, K, T, dh)
    o = mb.mul(x=o, y=mb.expand_dims(x=weights, axes=[2, 3]))
    o = mb.transpose(x=o, perm=[0, 2, 1, 3])  # (B, T, K, dh)
    o = mb.reshape(x=o, shape=mb.concat(values=[mb.slice_by_index(x=mb.shape(x=o), begin=[0], end=[2]),
                                                np.array([-1], np.int32)], axis=0))  # (B, T, K*dh)
    wog = mb.gather(x=wo_h, indices=order, axis=0)  # (B, K, dh, d)
    wog = mb.reshape(x=wog, shape=mb.concat(values=[mb.slice_by_index(x=mb.shape(x=wog), begin=[0], end=[1]),
                                                    np.array([-1, d], np.int32)], axis=0))  # (B, K*dh, d)
    y = mb.add(x=mb.matmul(x=o, y=wog), y=bo)
    context.add((y, k, head_mask), node.name)


def _ffn_mil(x, ln_w, ln_b, w1, b1, w2, b2, eps: float, name: str):
    """FFN(LayerNorm(x)) on the last axis: layer_norm + linear + exact gelu + linear."""
    from coremltools.converters.mil import Builder as mb

    h = mb.layer_norm(x=x, axes=[-1], gamma=ln_w, beta=ln_b, epsilon=np.float32(eps), name=f"{name}_ln")
    h = mb.gelu(x=mb.linear(x=h, weight=w1, bias=b1, name=f"{name}_fc1"), mode="EXACT", name=f"{name}_gelu")
    return mb.linear(x=h, weight=w2, bias=b2, name=f"{name}_fc2")


def _conditional_ffn_mil(context, node, variant: str):
    """Emit MIL for one adaptex::conditional_ffn node: y = x + keep * gate * FFN(LayerNorm(x)).

    keep (B, T) bool and gate (B, T) fp32 are routing: every op that touches them carries the route_
    prefix, so an fp16 package keeps them fp32 (the gate is cast to the body's precision only where
    it scales the update)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs

    x, keep, gate, ln_w, ln_b, w1, b1, w2, b2, eps = _get_inputs(context, node, expected=10)
    r = f"route_{node.name}_"
    lw, lb, w1, b1, w2, b2 = (np.asarray(t.val, dtype=np.float32) for t in (ln_w, ln_b, w1, b1, w2, b2))
    eps = float(eps.val)
    if variant == "sparse":
        # the kept tokens' (batch, token) indices: their count N is known at run time only. Not a flat
        # index over B*T rows: an fp16 convert casts gather_nd indices to uint16 (coremltools'
        # add_int16_cast), which a flat index overflows past 65535 tokens; b < 4096 and t < max_len fit.
        idx = mb.non_zero(x=keep, name=r + "idx")  # (N, 2) int32
        g = mb.gather_nd(x=gate, indices=idx, name=r + "gate_kept")  # (N,) fp32
        xs = mb.gather_nd(x=x, indices=idx, name=f"{node.name}_kept")  # (N, d)
        u = _ffn_mil(xs, lw, lb, w1, b1, w2, b2, eps, node.name)  # (N, d)
        ys = mb.add(x=xs, y=mb.mul(x=u, y=mb.expand_dims(x=g, axes=[1], name=r + "gate_col"),
                                   name=f"{node.name}_gated"), name=f"{node.name}_new")
        y = mb.scatter_nd(data=x, indices=idx, updates=ys, mode="update", name=node.name)  # (B, T, d)
    else:
        # every token through the FFN, its update scaled by keep * gate (zero for skipped tokens)
        u = _ffn_mil(x, lw, lb, w1, b1, w2, b2, eps, node.name)  # (B, T, d)
        scale = mb.mul(x=mb.cast(x=keep, dtype="fp32", name=r + "keep_f"), y=gate, name=r + "scale")  # (B, T)
        y = mb.add(x=x, y=mb.mul(x=u, y=mb.expand_dims(x=scale, axes=[-1], name=r + "scale_col"),
                                 name=f"{node.name}_gated"), name=node.name)
    context.add(y, node.name)


def _conditional_attention_mil(context, node, variant: str):
    """Emit MIL for one adaptex::conditional_attention node:
    y = x + keep * gate * (softmax(q k^T / sqrt(dh) + bias) v wo^T + bo), q = hn wq^T + bq.

    sparse: per batch row the kept positions first (argsort of keep, descending) sliced at
    max(1, the batch's largest kept count) n with a runtime end; gather_nd by (batch, token) pairs
    of those rows of hn, bias, gate and x; queries, scores, softmax, AV and the output projection on them only;
    scatter_nd (mode update) back. Routing (keep, gate, the order) carries the route_ prefix; the
    residual part (_kept, _new and the scatter) is kept fp32 in an fp16 package like the decoder's
    residual stream."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs

    x, hn, keep, gate, k, v, bias, wq, bq, wo, bo, H = _get_inputs(context, node, expected=12)
    H = int(H.val)
    r = f"route_{node.name}_"
    wq, bq, wo, bo = (np.asarray(t.val, dtype=np.float32) for t in (wq, bq, wo, bo))
    d = wq.shape[0]
    dh = d // H
    scale = dh ** -0.5
    g = mb.mul(x=gate, y=mb.cast(x=keep, dtype="fp32", name=r + "keep_f"), name=r + "gate_kept")  # (B, T)
    if variant == "sparse":
        keep_i = mb.cast(x=keep, dtype="int32", name=r + "keep_i")
        n = mb.maximum(x=mb.reduce_max(x=mb.reduce_sum(x=keep_i, axes=[1], name=r + "count"), axes=[0],
                                       keep_dims=True, name=r + "nmax"), y=np.int32(1), name=r + "n")  # (1,)
        order = mb.argsort(x=mb.cast(x=keep_i, dtype="fp32", name=r + "keep_rank"), axis=1, ascending=False,
                           name=r + "order_all")  # (B, T): kept positions first
        batch = mb.slice_by_index(x=mb.shape(x=keep, name=r + "shape"), begin=[0], end=[1], name=r + "batch")
        order = mb.slice_by_index(x=order, begin=[0, 0], end=mb.concat(values=[batch, n], axis=0, name=r + "end"),
                                  name=r + "order")  # (B, n)
        # (batch, token) index pairs, as conditional_ffn's (gather with batch_dims does not evaluate
        # in coremltools 9's MIL reference)
        b_idx = mb.add(x=mb.mul(x=order, y=np.int32(0), name=r + "zeros"),
                       y=mb.expand_dims(x=mb.range_1d(start=np.int32(0), end=mb.squeeze(x=batch, name=r + "B"),
                                                      step=np.int32(1), name=r + "b_range"), axes=[1],
                                        name=r + "b_col"), name=r + "batch_idx")  # (B, n)
        idx = mb.concat(values=[mb.expand_dims(x=b_idx, axes=[2], name=r + "b_idx3"),
                                mb.expand_dims(x=order, axes=[2], name=r + "t_idx3")], axis=2, name=r + "idx")  # (B, n, 2)
        hq = mb.gather_nd(x=hn, indices=idx, name=f"{node.name}_hq")  # (B, n, d)
        bias_rows = mb.expand_dims(x=mb.gather_nd(x=mb.squeeze(x=bias, axes=[1]), indices=idx),
                                   axes=[1], name=f"{node.name}_bias_rows")  # (B, 1, n, S)
        gs = mb.gather_nd(x=g, indices=idx, name=r + "gate_rows")  # (B, n)
        xs = mb.gather_nd(x=x, indices=idx, name=f"{node.name}_kept")  # (B, n, d)
    else:
        hq, bias_rows, gs, xs = hn, bias, g, x
    q = mb.linear(x=hq, weight=wq * np.float32(scale), bias=bq * np.float32(scale), name=f"{node.name}_q")
    lead = mb.slice_by_index(x=mb.shape(x=q), begin=[0], end=[2])  # [B, n] (n is known at run time only)
    q = mb.reshape(x=q, shape=mb.concat(values=[lead, _i32([H, dh])], axis=0), name=f"{node.name}_q_heads")
    q = mb.transpose(x=q, perm=[0, 2, 1, 3])  # (B, H, n, dh)
    scores = mb.add(x=mb.matmul(x=q, y=k, transpose_y=True), y=bias_rows, name=f"{node.name}_scores")
    o = mb.matmul(x=mb.softmax(x=scores, axis=-1, name=f"{node.name}_softmax"), y=v)  # (B, H, n, dh)
    o = mb.reshape(x=mb.transpose(x=o, perm=[0, 2, 1, 3]), shape=mb.concat(values=[lead, _i32([d])], axis=0),
                   name=f"{node.name}_o")  # (B, n, d)
    u = mb.linear(x=o, weight=wo, bias=bo, name=f"{node.name}_out")
    upd = mb.mul(x=u, y=mb.expand_dims(x=gs, axes=[-1], name=r + "gate_col"), name=f"{node.name}_gated")
    if variant == "sparse":
        new = mb.add(x=xs, y=upd, name=f"{node.name}_new")  # (B, n, d)
        y = mb.scatter_nd(data=x, indices=idx, updates=new, mode="update", name=node.name)
    else:
        y = mb.add(x=x, y=upd, name=node.name)
    context.add(y, node.name)


MASK_BIAS = 1e4  # added (negated) to masked scores: finite in fp16, and exp(-1e4) is exactly 0 in either precision


def _i32(x):
    return np.asarray(x, dtype=np.int32)


def _ea_bias(vis, name: str):
    """0/1 visibility (float) -> additive score bias: 0 where visible, -MASK_BIAS where not. (select
    with a scalar branch loses its shape in coremltools 9, so masks are applied additively.)"""
    from coremltools.converters.mil import Builder as mb

    return mb.mul(x=mb.sub(x=vis, y=np.float32(1)), y=np.float32(MASK_BIAS), name=name)


def _ea_attend(q, k, v, vis, scale: float, name: str):
    """softmax(q k^T * scale + bias(vis)) v over the last two axes; vis broadcasts to the scores."""
    from coremltools.converters.mil import Builder as mb

    scores = mb.mul(x=mb.matmul(x=q, y=k, transpose_y=True), y=np.float32(scale), name=f"{name}_scores")
    scores = mb.add(x=scores, y=_ea_bias(vis, f"{name}_bias"))
    return mb.matmul(x=mb.softmax(x=scores, axis=-1, name=f"{name}_softmax"), y=v, name=f"{name}_av")


def _ea_dims(q, k):
    """T and S as int32 scalars, read off the input shapes at run time."""
    from coremltools.converters.mil import Builder as mb

    T = mb.gather(x=mb.shape(x=q), indices=np.int32(2), axis=0)
    S = mb.gather(x=mb.shape(x=k), indices=np.int32(2), axis=0)
    return T, S


def _ea_band(T, S, sink: int, window: int, causal: bool):
    """(T, S) 0/1 float masks of the keys an FA and an SA query sees (before padding), as
    graphs.ops.elastic_attention.visibility; FA's is None when every key is visible (encoders)."""
    from coremltools.converters.mil import Builder as mb

    a = mb.range_1d(start=mb.sub(x=S, y=T), end=S, step=np.int32(1))  # (T,) absolute query positions
    j = mb.range_1d(start=np.int32(0), end=S, step=np.int32(1))  # (S,)
    d = mb.sub(x=mb.expand_dims(x=a, axes=[1]), y=mb.expand_dims(x=j, axes=[0]))  # (T, S) query - key
    if causal:
        fa = mb.greater_equal(x=d, y=np.int32(0))
        local = mb.logical_and(x=fa, y=mb.less(x=d, y=np.int32(window)))
    else:
        fa, half = None, np.int32(window // 2)
        local = mb.logical_and(x=mb.greater_equal(x=d, y=-half), y=mb.less_equal(x=d, y=half))
    sa = mb.logical_or(x=local, y=mb.expand_dims(x=mb.less(x=j, y=np.int32(sink)), axes=[0]))
    if fa is not None:
        sa = mb.logical_and(x=sa, y=fa)
        fa = mb.cast(x=fa, dtype="fp32")
    return fa, mb.cast(x=sa, dtype="fp32")


def _ea_dense(q, k, v, sa, km, sink: int, window: int, causal: bool, scale: float, name: str):
    """Every head over its full (T, S) score matrix; SA heads through a band mask (static shapes)."""
    from coremltools.converters.mil import Builder as mb

    T, S = _ea_dims(q, k)
    fa_vis, sa_vis = _ea_band(T, S, sink, window, causal)
    sa_f = mb.expand_dims(x=mb.cast(x=sa, dtype="fp32"), axes=[2, 3])  # (B, H, 1, 1)
    base = np.float32(1) if fa_vis is None else fa_vis
    vis = mb.add(x=mb.mul(x=sa_f, y=mb.sub(x=sa_vis, y=base)), y=base)  # (B, H, T, S): SA ? sa_vis : fa_vis
    vis = mb.mul(x=vis, y=mb.expand_dims(x=km, axes=[1, 2]))  # padded keys
    return _ea_attend(q, k, v, vis, scale, name)


def _ea_blocks(T, S, sink: int, window: int, causal: bool):
    """The block-local SA layout of graphs.ops.elastic_attention.block_index, computed at run time:
    blocks of Bq = max(1, min(window, T)) queries, nb = ceil(T / Bq) of them, each reading its own
    run of L keys. Returns qi (nb, Bq) the query row of each block slot (clamped to T - 1: the
    padding slots are dropped afterwards), jc (nb, L) the key of each run slot (clamped into range),
    valid (nb, Bq, L) 0/1 float (in the query's window, past the sinks, in range) and a (nb, Bq)
    the absolute query positions."""
    from coremltools.converters.mil import Builder as mb

    one = np.int32(1)
    before, extra = (window - 1, window - 1) if causal else (window // 2, 2 * (window // 2))
    Bq = mb.maximum(x=mb.minimum(x=T, y=np.int32(window)), y=one)
    nb = mb.floor_div(x=mb.sub(x=mb.add(x=T, y=Bq), y=one), y=Bq)
    L = mb.add(x=Bq, y=np.int32(extra))
    ib = mb.range_1d(start=np.int32(0), end=Bq, step=one)  # (Bq,)
    il = mb.range_1d(start=np.int32(0), end=L, step=one)  # (L,)
    q0 = mb.mul(x=mb.range_1d(start=np.int32(0), end=nb, step=one), y=Bq)  # (nb,) first query row of each block
    rows = mb.add(x=mb.expand_dims(x=q0, axes=[1]), y=mb.expand_dims(x=ib, axes=[0]))  # (nb, Bq)
    qi = mb.minimum(x=rows, y=mb.sub(x=T, y=one))
    a0 = mb.add(x=q0, y=mb.sub(x=S, y=T))  # (nb,) absolute position of each block's first query
    a = mb.add(x=rows, y=mb.sub(x=S, y=T))  # (nb, Bq)
    j = mb.add(x=mb.expand_dims(x=mb.sub(x=a0, y=np.int32(before)), axes=[1]),
               y=mb.expand_dims(x=il, axes=[0]))  # (nb, L) absolute key positions
    jc = mb.maximum(x=mb.minimum(x=j, y=mb.sub(x=S, y=one)), y=np.int32(0))
    # query minus key is i + before - l whatever the block: one (Bq, L) window mask for all blocks
    d = mb.sub(x=mb.add(x=mb.expand_dims(x=ib, axes=[1]), y=np.int32(before)), y=mb.expand_dims(x=il, axes=[0]))
    if causal:
        inwin = mb.logical_and(x=mb.greater_equal(x=d, y=np.int32(0)), y=mb.less(x=d, y=np.int32(window)))
    else:
        half = np.int32(window // 2)
        inwin = mb.logical_and(x=mb.greater_equal(x=d, y=-half), y=mb.less_equal(x=d, y=half))
    # j >= sink also excludes j < 0 (sink >= 0); the sinks have their own part
    jok = mb.logical_and(x=mb.greater_equal(x=j, y=np.int32(sink)), y=mb.less(x=j, y=S))  # (nb, L)
    valid = mb.logical_and(x=mb.expand_dims(x=inwin, axes=[0]), y=mb.expand_dims(x=jok, axes=[1]))
    return qi, jc, mb.cast(x=valid, dtype="fp32"), a


def _ea_streaming(qs, ks, vs, ms, T, S, sink: int, window: int, causal: bool, scale: float, name: str):
    """(N, T, dh) queries of the SA pairs over their sinks and block-local windows: each block of Bq
    queries gathers its own run of L keys (gather by the (nb, L) index), so O(T * (sink + window))."""
    from coremltools.converters.mil import Builder as mb

    qi, jc, valid, a = _ea_blocks(T, S, sink, window, causal)
    qb = mb.gather(x=qs, indices=qi, axis=1, name=f"{name}_q_blocks")  # (N, nb, Bq, dh)
    kb = mb.gather(x=ks, indices=jc, axis=1, name=f"{name}_k_runs")  # (N, nb, L, dh)
    vb = mb.gather(x=vs, indices=jc, axis=1, name=f"{name}_v_runs")
    vis = mb.mul(x=mb.expand_dims(x=mb.gather(x=ms, indices=jc, axis=1), axes=[2]), y=valid)  # (N, nb, Bq, L)
    s_loc = mb.mul(x=mb.matmul(x=qb, y=kb, transpose_y=True), y=np.float32(scale))
    s_loc = mb.add(x=s_loc, y=_ea_bias(vis, f"{name}_loc_bias"), name=f"{name}_loc_scores")
    if sink > 0:
        jn = np.arange(sink, dtype=np.int32)
        jnc = mb.minimum(x=jn, y=mb.sub(x=S, y=np.int32(1)))  # (sink,) clamped; keys past S masked below
        k_sink = mb.expand_dims(x=mb.gather(x=ks, indices=jnc, axis=1), axes=[1])  # (N, 1, sink, dh)
        v_sink = mb.expand_dims(x=mb.gather(x=vs, indices=jnc, axis=1), axes=[1])
        vis_s = mb.mul(x=mb.gather(x=ms, indices=jnc, axis=1), y=mb.cast(x=mb.less(x=jn, y=S), dtype="fp32"))
        vis_s = mb.expand_dims(x=vis_s, axes=[1, 2])  # (N, 1, 1, sink)
        if causal:
            seen = mb.less_equal(x=jn, y=mb.expand_dims(x=a, axes=[2]))  # (nb, Bq, sink)
            vis_s = mb.mul(x=vis_s, y=mb.cast(x=seen, dtype="fp32"))
        s_sink = mb.mul(x=mb.matmul(x=qb, y=k_sink, transpose_y=True), y=np.float32(scale))  # (N, nb, Bq, sink)
        s_sink = mb.add(x=s_sink, y=_ea_bias(vis_s, f"{name}_sink_bias"), name=f"{name}_sink_scores")
        p = mb.softmax(x=mb.concat(values=[s_sink, s_loc], axis=-1), axis=-1, name=f"{name}_softmax")
        keep = [True, True, True, False]
        p_sink = mb.slice_by_index(x=p, begin=[0, 0, 0, 0], end=[0, 0, 0, sink], end_mask=keep)
        p_loc = mb.slice_by_index(x=p, begin=[0, 0, 0, sink], end=[0, 0, 0, 0], begin_mask=keep,
                                  end_mask=[True] * 4)
        o = mb.add(x=mb.matmul(x=p_sink, y=v_sink), y=mb.matmul(x=p_loc, y=vb))  # (N, nb, Bq, dh)
    else:
        o = mb.matmul(x=mb.softmax(x=s_loc, axis=-1, name=f"{name}_softmax"), y=vb)
    # (N, nb, Bq, dh) -> (N, nb * Bq, dh) -> the first T rows
    shp = mb.shape(x=o)
    rows = mb.mul(x=mb.slice_by_index(x=shp, begin=[1], end=[2]), y=mb.slice_by_index(x=shp, begin=[2], end=[3]))
    o = mb.reshape(x=o, shape=mb.concat(values=[mb.slice_by_index(x=shp, begin=[0], end=[1]), rows,
                                                mb.slice_by_index(x=shp, begin=[3], end=[4])], axis=0))
    return mb.slice_by_index(x=o, begin=[0, 0, 0], end=mb.concat(values=[_i32([0]), mb.expand_dims(x=T, axes=[0]),
                                                                         _i32([0])], axis=0),
                             end_mask=[True, False, True], name=f"{name}_o")


def _ea_sparse(q, k, v, sa, km, sink: int, window: int, causal: bool, scale: float, name: str):
    """The (b, h) pairs of each mode gathered (non_zero over sa, gather_nd), FA pairs over every
    visible key, SA pairs block-local, both scattered back (scatter_nd, mode update) into q's
    shape: every pair is written by exactly one group."""
    from coremltools.converters.mil import Builder as mb

    T, S = _ea_dims(q, k)
    out = q
    for group, pick in (("fa", mb.logical_not(x=sa)), ("sa", sa)):
        g = f"{name}_{group}"
        idx = mb.non_zero(x=pick, name=f"{g}_pairs")  # (N, 2) (batch, head); N known at run time only
        qs, ks, vs = (mb.gather_nd(x=t, indices=idx, name=f"{g}_{n}") for t, n in ((q, "q"), (k, "k"), (v, "v")))
        b = mb.slice_by_index(x=idx, begin=[0, 0], end=[0, 1], end_mask=[True, False])  # (N, 1) batch index
        ms = mb.gather_nd(x=km, indices=b, name=f"{g}_key_mask")  # (N, S)
        if group == "fa":
            vis = mb.expand_dims(x=ms, axes=[1])  # (N, 1, S)
            if causal:  # keys up to the query's own position
                vis = mb.mul(x=vis, y=_ea_band(T, S, sink, window, causal)[0])
            o = _ea_attend(qs, ks, vs, vis, scale, g)  # (N, T, dh)
        else:
            o = _ea_streaming(qs, ks, vs, ms, T, S, sink, window, causal, scale, g)
        out = mb.scatter_nd(data=out, indices=idx, updates=o, mode="update", name=f"{g}_scatter")
    return out


def _elastic_attention_mil(context, node, variant: str):
    """Emit MIL for one adaptex::elastic_attention node (sink, window and causal are constants)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs

    q, k, v, sa, key_mask, sink, window, causal = _get_inputs(context, node, expected=8)
    sink, window, causal = int(sink.val), int(window.val), bool(causal.val)
    scale = float(q.shape[-1]) ** -0.5
    km = mb.cast(x=key_mask, dtype="fp32", name=f"{node.name}_key_mask")  # (B, S) 0/1
    fn = _ea_sparse if variant == "sparse" else _ea_dense
    o = fn(q, k, v, sa, km, sink, window, causal, scale, node.name)
    context.add(mb.identity(x=o, name=node.name), node.name)


def _register_translation() -> None:
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op

    @register_torch_op(torch_alias=["adaptex::budgeted_attention"], override=True)
    def budgeted_attention(context, node):
        _budgeted_attention_mil(context, node, _VARIANT["adaptex::budgeted_attention"])

    @register_torch_op(torch_alias=["adaptex::conditional_ffn"], override=True)
    def conditional_ffn(context, node):
        _conditional_ffn_mil(context, node, _VARIANT["adaptex::conditional_ffn"])

    @register_torch_op(torch_alias=["adaptex::conditional_attention"], override=True)
    def conditional_attention(context, node):
        _conditional_attention_mil(context, node, _VARIANT["adaptex::conditional_attention"])

    @register_torch_op(torch_alias=["adaptex::elastic_attention"], override=True)
    def elastic_attention(context, node):
        _elastic_attention_mil(context, node, _VARIANT["adaptex::elastic_attention"])


@lowering("adaptex::budgeted_attention", target="coreml", variant="sparse")
def budgeted_attention_coreml_sparse(ctx, node):
    """argsort + slice_by_index with a runtime end (the batch's largest k) + gather of those heads'
    weights; attention on k heads only."""
    return "sparse"


@lowering("adaptex::budgeted_attention", target="coreml", variant="dense")
def budgeted_attention_coreml_dense(ctx, node):
    """Static shapes: argsort over all heads, every head computed, unselected heads weighted by zero."""
    return "dense"


@lowering("adaptex::conditional_ffn", target="coreml", variant="sparse")
def conditional_ffn_coreml_sparse(ctx, node):
    """non_zero on the (B, T) keep mask ((batch, token) index pairs), gather_nd of the kept tokens'
    rows, layer_norm + linear + gelu + linear on them only, scatter_nd (mode update) back: dynamic
    shapes, skipped tokens cost nothing (runs off the Neural Engine)."""
    return "sparse"


@lowering("adaptex::conditional_ffn", target="coreml", variant="dense")
def conditional_ffn_coreml_dense(ctx, node):
    """Static shapes: every token through layer_norm + FFN, the update multiplied by keep * gate
    (fp32 routing), so skipped tokens pass through unchanged; the variant that can stay on the
    Neural Engine."""
    return "dense"


@lowering("adaptex::conditional_attention", target="coreml", variant="sparse")
def conditional_attention_coreml_sparse(ctx, node):
    """argsort of the (B, T) keep mask sliced at the batch's largest kept count (a runtime end),
    gather_nd of those query rows and their bias rows, queries + scores + softmax + AV +
    output projection on them only, scatter_nd (mode update) back: dynamic shapes, a skipped token's
    query side costs nothing (runs off the Neural Engine)."""
    return "sparse"


@lowering("adaptex::conditional_attention", target="coreml", variant="dense")
def conditional_attention_coreml_dense(ctx, node):
    """Static shapes: every query row attended, the update multiplied by keep * gate (fp32 routing);
    the variant that can stay on the Neural Engine."""
    return "dense"


@lowering("adaptex::elastic_attention", target="coreml", variant="sparse")
def elastic_attention_coreml_sparse(ctx, node):
    """non_zero over sa splits the (batch, head) pairs by mode, gather_nd gathers each group's q, k, v
    and key-mask rows; FA pairs: matmul + softmax over every visible key; SA pairs: block-local, a
    gather by a (blocks, L) key index gives each block of Bq = min(window, T) queries its own run of
    keys, plus the sinks (O(T * (sink + window)), no T x S scores); scatter_nd (mode update) puts
    both groups back. Dynamic shapes: runs off the Neural Engine."""
    return "sparse"


@lowering("adaptex::elastic_attention", target="coreml", variant="dense")
def elastic_attention_coreml_dense(ctx, node):
    """Static shapes: every head's full T x S score matrix, SA heads through a band mask (sinks +
    local window, built from range_1d positions) selected per head by sa, padded keys by the key
    mask, all as additive biases before one softmax; the variant that can stay on the Neural Engine."""
    return "dense"


def _output_dtype(name: str):
    """Every float output is fp32 even in an fp16 package: left to coremltools, an fp16 body's outputs
    are fp16, which rounds logits in the tens by up to 8e-3 and the fp32 routing's s to 3 digits."""
    import numpy as np

    return np.int32 if name.endswith(".k") else np.float32


def head_node_names(ep) -> set[str]:
    """The classifier tail: the final norm and everything downstream of it (pooling, head MLP).

    It runs fp32 in an fp16 package: it is O(B*d^2) against the body's O(B*T*d^2), and an fp16 head
    rounds logits of magnitude ~20 at 2^-11 relative (up to 1e-2 absolute) on its own."""
    start = [n for n in ep.graph.nodes
             if [v[0] for v in (n.meta.get("nn_module_stack") or {}).values()][-1:] == ["model.ln_f"]]
    names, todo = set(), list(start)
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.name not in names:
            names.add(n.name)
            todo.extend(n.users)
    return names


def routing_node_names(ep) -> set[str]:
    """FX nodes that compute routing (the routers, and the temperature softmax of the head scores):
    they must stay fp32 in an fp16 package, or floor(s*H) and the top-k order move near boundaries."""
    names = set()
    for n in ep.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        path = [v[0] for v in stack.values()][-1] if stack else ""
        if ".router" in path or (path.endswith(".attn") and n.target is not None
                                  and "budgeted_attention" not in str(n.target) and n.op == "call_function"
                                  and "getitem" not in str(n.target)):
            names.add(n.name)
    return names


def decoder_routing_node_names(ep) -> set[str]:
    """A TSA decoder's routing FX nodes: the TokenRouters (model.routers.*), and the ops between a
    router's p and each conditional_ffn's keep (p <= threshold) and gate (keep * (1 - p)).

    They stay fp32 in an fp16 package: an fp16 p <= 0.5 would flip keep for every p within 2^-12 of
    the threshold. The walk back from keep and gate stops at the router nodes, so it never enters the
    body (the residual stream that feeds the routers)."""
    from adaptex.exporter.trace import adaptex_nodes

    def path(n):
        stack = n.meta.get("nn_module_stack") or {}
        return [v[0] for v in stack.values()][-1] if stack else ""

    def per_token(n):  # routing values are (B, T): never the (B, T, d) residual stream
        val = n.meta.get("val")
        return getattr(val, "ndim", 3) <= 2

    router = {n.name for n in ep.graph.nodes if n.op == "call_function" and path(n).startswith("model.routers.")}
    names = set(router)
    todo = [a for node in adaptex_nodes(ep) if "conditional_ffn" in str(node.target) for a in node.args[1:3]]
    todo += [a for node in adaptex_nodes(ep) if "conditional_attention" in str(node.target) for a in node.args[2:4]]
    while todo:
        n = todo.pop()
        if not hasattr(n, "op") or n.op != "call_function" or n.name in names or not per_token(n):
            continue
        names.add(n.name)
        todo.extend(a for a in n.all_input_nodes)
    return names


def elastic_routing_node_names(ep) -> set[str]:
    """An elastic encoder's routing FX nodes: the HeadRouters (model.routers.*: key pooling, task and
    router MLPs) and the ops from a router's [FA, SA] logits to each elastic_attention's sa (the
    logit slices and their comparison). They stay fp32 in an fp16 package: an fp16 logit gap would
    flip every head whose gap is within fp16 rounding of zero. The walk back from sa stops at the
    router nodes, so it never enters the body."""
    from adaptex.exporter.trace import adaptex_nodes

    def path(n):
        stack = n.meta.get("nn_module_stack") or {}
        return [v[0] for v in stack.values()][-1] if stack else ""

    names = {n.name for n in ep.graph.nodes if n.op == "call_function" and path(n).startswith("model.routers.")}
    todo = [node.args[3] for node in adaptex_nodes(ep) if "elastic_attention" in str(node.target)]
    while todo:
        n = todo.pop()
        if not hasattr(n, "op") or n.op != "call_function" or n.name in names \
                or getattr(n.meta.get("val"), "ndim", 4) > 3:  # per-head values only: never (B, H, T, dh)
            continue
        names.add(n.name)
        todo.extend(n.all_input_nodes)
    return names


def elastic_tail_node_names(ep) -> set[str]:
    """An elastic encoder's pooling tail: everything downstream of the last LayerNorm (masked mean
    over tokens, L2 normalisation). It runs fp32 in an fp16 package, like the classifier tail: it is
    O(B*T*d) against the body's O(B*T*d^2), and a sum over T tokens is where fp16 would round most."""
    import torch

    norms = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.layer_norm.default]
    if not norms:
        return set()
    names, todo = set(), list(norms[-1].users)
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.name not in names:
            names.add(n.name)
            todo.extend(n.users)
    # and the attention-mask side of the mean (mask as float, token count, clamp): the walk back
    # from the tail stops at the LayerNorm, so it only reaches ops computed from the mask
    todo = [a for n in ep.graph.nodes if n.name in names for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n is not norms[-1] and n.name not in names:
            names.add(n.name)
            todo.extend(n.all_input_nodes)
    return names


def _prefix_routing_nodes(ep, names: set[str]) -> set[str]:
    """Rename the routing FX nodes `names` to route_<name>: coremltools names each MIL op after its
    FX node, uniquifying clashes with a suffix (a router's squeeze_1 became squeeze_1_1 next to the
    squeeze_1 of an attention's unbind), so the fp16 op selector matches them by the prefix, which
    no suffix can break, instead of by name. Graph outputs keep their names (the signature refers to
    them); those are returned, for the selector's name set."""
    return _prefix_nodes(ep, names, "route_")


def decoder_residual_node_names(ep) -> set[str]:
    """A TSA decoder's residual-stream FX nodes: the token and position embeddings and their add,
    every residual add (B, T, d) outside the attention and FFN bodies, and the LayerNorms (ln1, ln2,
    ln_f). They stay fp32 in an fp16 package (standard mixed precision: matmuls, attention and FFN
    bodies fp16): the trained residual stream reaches |h| ~ 30 with per-token std ~ 5, so an fp16 h
    before each LayerNorm costs ~1.6e-3 relative after normalisation, compounding over the blocks
    (tsa-charlm's fp16 logits were off by 6.5e-2 with an fp16 residual stream)."""
    import torch

    def path(n):
        stack = n.meta.get("nn_module_stack") or {}
        return [v[0] for v in stack.values()][-1] if stack else ""

    names = set()
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        p, val = path(n), n.meta.get("val")
        if n.target == torch.ops.aten.layer_norm.default and (p.endswith((".ln1", ".ln2")) or p == "model.ln_f"):
            names.add(n.name)
        elif p in ("model.tok", "model.pos_emb") and n.target == torch.ops.aten.embedding.default:
            names.add(n.name)
        elif p == "model" and n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.index.Tensor) \
                and getattr(val, "ndim", 0) >= 2 and getattr(val, "dtype", None) == torch.float32:
            names.add(n.name)  # (B, T, d) residual adds and the embedding add; the (T, d) position rows
    for n in ep.graph.nodes:  # the position rows' unsqueeze before the embedding add
        if n.op == "call_function" and n.target == torch.ops.aten.unsqueeze.default and any(
                a.name in names and a.target == torch.ops.aten.index.Tensor for a in n.all_input_nodes):
            names.add(n.name)
    return names


def _conditional_ffn_fp32_ops(ep) -> set[str]:
    """The MIL op names the conditional_ffn translation gives its residual part (the kept rows, the
    layer_norm, the residual add and the scatter back): kept fp32 alongside the decoder's residual
    stream, while the FFN's linears and gelu run in the body's precision."""
    from adaptex.exporter.trace import adaptex_nodes

    return {f"{n.name}{s}" for n in adaptex_nodes(ep) if "conditional_ffn" in str(n.target)
            for s in ("", "_kept", "_ln", "_new")} | \
        {f"{n.name}{s}" for n in adaptex_nodes(ep) if "conditional_attention" in str(n.target)
         for s in ("", "_kept", "_new")}


def _prefix_nodes(ep, names: set[str], prefix: str) -> set[str]:
    """Rename the FX nodes `names` to <prefix><name> (see _prefix_routing_nodes); graph outputs keep
    their names and are returned."""
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outputs = {a.name for a in out_node.all_input_nodes}
    for n in list(ep.graph.nodes):
        if n.op == "call_function" and n.name in names and n.name not in outputs:
            n._rename(prefix + n.name)
    ep.graph_module.recompile()
    return names & outputs


def _bool_ops_as_logical(ep) -> None:
    """torch.export writes `a & b` / `a | b` on bool tensors as aten.__and__ / aten.__or__, which
    coremltools 9 does not look up (it registers them as "and" / "or"): the same ops as
    aten.logical_and / logical_or, which it converts."""
    import torch

    swap = {torch.ops.aten.__and__.Tensor: torch.ops.aten.logical_and.default,
            torch.ops.aten.__or__.Tensor: torch.ops.aten.logical_or.default}
    changed = False
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target in swap and all(
                getattr(a.meta.get("val"), "dtype", None) == torch.bool for a in n.all_input_nodes):
            n.target = swap[n.target]
            changed = True
    if changed:
        ep.graph_module.recompile()


def _convert(ep, names: list[str], precision: str, min_target: str, keep_fp32: set[str], inputs=None,
             keep_between: bool = False):
    """ct.convert an ExportedProgram to an ML program; in fp16, the FX nodes in keep_fp32 (and every
    op whose name carries a FP32_PREFIXES prefix) stay fp32, and every float output is fp32. `inputs`
    (ct.TensorType, in the program's input order) overrides the shapes coremltools reads off the trace.
    keep_between (elastic): an op fed only by kept ops and read only by kept ops stays fp32 too; it
    catches translations that name neither op nor result after the FX node (aten.clamp's clip_0
    inside a router or the pooling tail)."""
    import coremltools as ct

    logging.getLogger("coremltools").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if precision == "fp16":
            # coremltools names the MIL op of an unsuffixed FX node "linear" as "linear_0"
            keep = keep_fp32 | {n + "_0" for n in keep_fp32 if not n.rsplit("_", 1)[-1].isdigit()}

            def kept(op) -> bool:
                # route_ also by output name: translations such as aten.linear's name the result
                # after the FX node while the op keeps a counter name (linear_4)
                return (op.name in keep or op.name.startswith(FP32_PREFIXES)
                        or any(v.name.startswith(FP32_PREFIXES) for v in op.outputs))

            def between(op) -> bool:
                ins = [v.op for v in op.inputs.values() if not isinstance(v, (list, tuple))
                       and v.op is not None and v.op.op_type != "const"]
                outs = [c for v in op.outputs for c in v.child_ops]
                return bool(ins and outs) and all(kept(o) for o in ins + outs)

            compute = ct.transform.FP16ComputePrecision(
                op_selector=lambda op: not kept(op) and not (keep_between and between(op)))
        else:
            compute = ct.precision.FLOAT32
        return ct.convert(ep, convert_to="mlprogram", inputs=inputs,
                          minimum_deployment_target=getattr(ct.target, MIN_TARGETS[min_target]),
                          compute_precision=compute,
                          outputs=[ct.TensorType(name=n, dtype=_output_dtype(n)) for n in names])


def export_stock(model, out, mode: str, *, precision: str = "fp16", min_target: str = DEFAULT_MIN_TARGET) -> Path:
    """The model's `mode` path (dense, naive) converted by stock coremltools, as `adaptex bench`'s
    counterparts: no adaptex translation, the classifier tail kept fp32 like the adaptive package's.
    Raises whatever coremltools raises (the naive path's data-dependent top-k does not convert).

    A TSA decoder's naive path is its hard_dense mode (every token through every FFN, skipped
    tokens' updates zeroed); its package has the adaptive package's inputs and flexible shapes."""
    import torch

    from adaptex.exporter.trace import dynamic_shapes, example_inputs, export_wrapper, float_mode_inputs, io_names

    cfg = model.cfg
    decoder = cfg.family in ("tsa", "elastic_decoder")
    if decoder and mode == "naive":
        mode = "hard_dense"
    wrapper = export_wrapper(model, mode)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(wrapper, float_mode_inputs(example_inputs(cfg, mode=mode), cfg),
                                 dynamic_shapes=dynamic_shapes(cfg, mode)).run_decompositions({})
    names = io_names(cfg, mode)[1]
    if decoder:
        _bool_ops_as_logical(ep)
        mlmodel = _convert(ep, names, precision, min_target, set(), _decoder_input_types(cfg))
    else:
        mlmodel = _convert(ep, names, precision, min_target, head_node_names(ep))
    out = Path(out)
    mlmodel.save(str(out))
    return out


MAX_BATCH = 4096  # the batch bound of the trace (exporter.trace.dynamic_shapes)
MIN_PAST = 0  # the past_sequence lower bound of a decoder package (see the module doc)


def decoder_io(cfg) -> tuple[dict, dict]:
    """A TSA decoder package's (inputs, outputs) by their canonical (Optimum, dotted) names: dtype,
    shape (ints, or the names of the flexible axes) and the Core ML feature name (dots cannot appear
    in one, so they become underscores)."""
    from adaptex.exporter.trace import io_names

    H, dh, V = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.vocab_size
    ins, outs = io_names(cfg)
    kv_in = ["batch", H, "past_sequence", dh]
    kv_out = ["batch", H, "past_sequence + sequence", dh]
    inputs = {}
    for n in ins:
        if n == "input_ids":
            inputs[n] = {"dtype": "int32", "shape": ["batch", "sequence"]}
        elif n == "attention_mask":
            inputs[n] = {"dtype": "int32", "shape": ["batch", "past_sequence + sequence"]}
        elif n.startswith("head_modes."):  # float32 0/1: the prefill's decisions_layer{i}_sa fed back
            inputs[n] = {"dtype": "float32", "shape": ["batch", H]}
        else:
            inputs[n] = {"dtype": "float32", "shape": kv_in}
    outputs = {}
    for n in outs:
        if n == "logits":
            outputs[n] = {"dtype": "float32", "shape": ["batch", "sequence", V]}
        elif n.startswith("present."):
            outputs[n] = {"dtype": "float32", "shape": kv_out}
        elif n.endswith(".sa"):  # 1 = streaming attention (Core ML has no bool outputs)
            outputs[n] = {"dtype": "float32", "shape": ["batch", H]}
        elif n.endswith(".logits"):
            outputs[n] = {"dtype": "float32", "shape": ["batch", H, 2]}
        else:  # decisions.layer{l}.keep (0/1: Core ML has no bool outputs) and .p
            outputs[n] = {"dtype": "float32", "shape": ["batch", "sequence"]}
    for d in (inputs, outputs):
        for n, spec in d.items():
            spec["coreml_name"] = n.replace(".", "_")
    return inputs, outputs


def _decoder_input_types(cfg) -> list:
    """Flexible shapes: batch 1..MAX_BATCH, sequence 1..max_len, past_sequence MIN_PAST..max_len - 1
    (one range shared by every layer's key and value), and the mask's past + sequence 1..max_len
    (Core ML shapes cannot be sums of ranges; the runtime checks the mask against ids and past)."""
    import coremltools as ct

    H, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
    batch = ct.RangeDim(1, MAX_BATCH, default=1, symbol="batch")
    seq = ct.RangeDim(1, cfg.max_len, default=1, symbol="sequence")
    past = ct.RangeDim(MIN_PAST, cfg.max_len - 1, default=max(MIN_PAST, 1), symbol="past_sequence")
    total = ct.RangeDim(1, cfg.max_len, default=2, symbol="past_plus_sequence")
    types = []
    for n, spec in decoder_io(cfg)[0].items():
        shape = {"input_ids": (batch, seq), "attention_mask": (batch, total)}.get(
            n, (batch, H) if n.startswith("head_modes.") else (batch, H, past, dh))
        types.append(ct.TensorType(name=spec["coreml_name"], shape=shape,
                                   dtype=np.int32 if spec["dtype"] == "int32" else np.float32))
    return types


def export(model, info: dict, out, *, variant: str = "sparse", precision: str | None = None,
           min_target: str = DEFAULT_MIN_TARGET) -> dict:
    """Convert to an ML program package at `out` (a directory, written atomically)."""
    from adaptex.exporter.registry import lookup
    from adaptex.exporter.trace import adaptex_nodes, io_names, trace

    precision = precision or default_precision(model.cfg)
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the coreml target; use fp16 or fp32")
    if min_target not in MIN_TARGETS:
        raise ExportError(f"unknown --min-target {min_target!r}; choose one of {', '.join(MIN_TARGETS)}")
    out = Path(out)
    if out.suffix != ".mlpackage":
        raise ExportError(f"{out}: a Core ML package's name must end in .mlpackage; use -o {out}.mlpackage")
    parent = out.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ExportError(f"{out}: directory {parent} does not exist or is not writable; choose another -o")
    if out.exists() and not (out / "Manifest.json").is_file():
        raise ExportError(f"{out}: exists and is not an ML package; choose a new -o")
    try:
        import coremltools  # noqa: F401
    except ImportError as e:
        raise ExportError("the coreml target needs coremltools; install it with pip install 'adaptex[coreml]'") from e

    cfg = model.cfg
    elastic_decoder = cfg.family == "elastic_decoder"
    decoder, elastic = cfg.family == "tsa" or elastic_decoder, cfg.family == "elastic"
    ep = trace(model, mode="hard", float_modes=elastic_decoder).run_decompositions({})
    notes = {}
    for node in adaptex_nodes(ep):
        op = node.target.name()
        entry = lookup(op, "coreml", variant, node)
        notes[op] = entry.fn.__name__
        _VARIANT[op] = entry.fn(None, node)
    _register_translation()
    names = io_names(cfg)[1]
    if elastic_decoder:
        # the routers and their sa decisions stay fp32; the flexible shapes are the TSA decoder's
        _bool_ops_as_logical(ep)
        keep = _prefix_routing_nodes(ep, elastic_routing_node_names(ep))
        inputs = _decoder_input_types(cfg)
    elif decoder:
        _bool_ops_as_logical(ep)
        # routing stays fp32; the LM head follows the body's precision (see the module doc)
        keep = _prefix_routing_nodes(ep, decoder_routing_node_names(ep))
        # the residual stream and its LayerNorms stay fp32 too (mixed precision; see decoder_residual_node_names)
        keep |= _prefix_nodes(ep, decoder_residual_node_names(ep), "resid_") | _conditional_ffn_fp32_ops(ep)
        inputs = _decoder_input_types(cfg)
    elif elastic:
        # the routers, the sa decisions and the pooling tail stay fp32; inputs as BudgetFormer's
        _bool_ops_as_logical(ep)
        keep = _prefix_routing_nodes(ep, elastic_routing_node_names(ep)) | elastic_tail_node_names(ep)
        inputs = None
    else:
        keep = routing_node_names(ep) | head_node_names(ep)
        inputs = None
    try:
        mlmodel = _convert(ep, names, precision, min_target, keep, inputs, keep_between=elastic)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"coremltools conversion failed: {first}") from e
    meta = {
        "format": artifact.FORMAT_VERSION, "family": cfg.family, "target": "coreml", "variant": variant,
        "precision": precision, "routing_precision": "fp32",
        **({"residual_precision": "fp32"} if decoder else {}), "head_precision": precision if decoder else "fp32",
        "min_target": min_target, "opset": {"adaptex": 1}, "lowerings": notes,
        **artifact.routing_meta(cfg), "config": cfg.to_dict(),
        "source": {"checkpoint": info.get("name") or info.get("path"), "sha256": info.get("sha256")},
        "max_sequence": cfg.max_len,
    }
    if info.get("tokenizer"):
        meta["tokenizer"] = info["tokenizer"]
    spec = mlmodel.get_spec()
    if decoder:
        meta["inputs"], meta["outputs"] = decoder_io(cfg)
        meta["min_past_sequence"] = MIN_PAST
        got = ([i.name for i in spec.description.input], [o.name for o in spec.description.output])
        want = tuple([s["coreml_name"] for s in d.values()] for d in (meta["inputs"], meta["outputs"]))
        if got != want:
            raise ExportError(f"coremltools named the package's features {got}, expected {want}")
    else:
        meta["inputs"] = {i.name: {"dtype": "int32", "shape": ["batch", "sequence"]} for i in spec.description.input}
        meta["outputs"] = {o.name: {"dtype": "see package", "shape": []} for o in spec.description.output}
    mlmodel.short_description = (f"{cfg.family} ({cfg.num_layers} layers x {cfg.num_heads} heads) exported by "
                                 f"adaptex: {variant} lowering, {precision} body, fp32 routing")
    mlmodel.author = "adaptex"
    mlmodel.version = str(artifact.FORMAT_VERSION)
    describe = (_decoder_descriptions(cfg) if decoder else _elastic_descriptions(cfg) if elastic
                else _classifier_descriptions(cfg))
    spec_inputs = {i.name for i in spec.description.input}
    spec_outputs = {o.name for o in spec.description.output}
    for name, text in describe.items():
        if name in spec_inputs:
            mlmodel.input_description[name] = text
        elif name in spec_outputs:
            mlmodel.output_description[name] = text
    ud = mlmodel.user_defined_metadata
    ud[artifact.META_KEY] = json.dumps(meta)
    ud.update({"adaptex.family": cfg.family, "adaptex.variant": variant, "adaptex.precision": precision,
               "adaptex.routing_precision": "fp32", "adaptex.opset": "1", "adaptex.min_target": min_target,
               "adaptex.config": json.dumps(cfg.to_dict()),
               "adaptex.source_checkpoint": str(meta["source"]["checkpoint"]),
               "adaptex.source_sha256": str(meta["source"]["sha256"])})
    ud.update({f"adaptex.{k}": json.dumps(v) for k, v in artifact.routing_meta(cfg).items()})
    if decoder:
        ud["adaptex.residual_precision"] = "fp32"
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    try:
        mlmodel.save(str(tmp / out.name))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp / out.name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _classifier_descriptions(cfg) -> dict:
    describe = {
        "input_ids": f"token ids, int32 [batch, sequence], sequence 1..{cfg.max_len}",
        "attention_mask": "1 for real tokens, 0 for padding, int32 [batch, sequence]",
        "logits": f"class scores [batch, {cfg.num_classes}]",
    }
    for i in range(cfg.num_layers):
        describe[f"decisions_layer{i}_k"] = f"layer {i}: heads computed per sample, clamp(floor(s*H), 1, H)"
        describe[f"decisions_layer{i}_head_mask"] = f"layer {i}: 1 for the heads computed, 0 otherwise [batch, {cfg.num_heads}]"
        describe[f"decisions_layer{i}_s"] = f"layer {i}: budget s in (0, 1) per sample"
    return describe


def _elastic_descriptions(cfg) -> dict:
    """Feature descriptions of an elastic encoder package, by Core ML feature name."""
    H = cfg.num_heads
    describe = {
        "input_ids": f"token ids, int32 [batch, sequence], sequence 1..{cfg.max_len}",
        "attention_mask": "1 for real tokens, 0 for padding, int32 [batch, sequence]",
        "sentence_embedding": "mean-pooled, L2-normalised sentence embedding, float32 [batch, d_model]",
    }
    for i in range(cfg.num_layers):
        describe[f"decisions_layer{i}_sa"] = (f"layer {i}: 1 where the head ran streaming attention (sink {cfg.sink}, "
                                              f"window {cfg.window}), 0 full attention; float32 0/1 [batch, {H}]")
        describe[f"decisions_layer{i}_logits"] = f"layer {i}: the router's [FA, SA] logits, float32 [batch, {H}, 2]"
    return describe


def _decoder_descriptions(cfg) -> dict:
    """Feature descriptions of a TSA decoder package, by Core ML feature name."""
    H, dh, L = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.max_len
    describe = {
        "input_ids": f"token ids, int32 [batch, sequence], the new tokens of this step; past + sequence <= {L}",
        "attention_mask": ("1 for real tokens, 0 for padding, int32 [batch, past_sequence + sequence]: the "
                           "previous step's mask extended by the new tokens"),
        "logits": f"next-token scores, float32 [batch, sequence, {cfg.vocab_size}]",
    }
    for i in range(cfg.num_layers):
        for kv in ("key", "value"):
            describe[f"past_key_values_{i}_{kv}"] = (
                f"block {i} attention {kv}s of the cached tokens, float32 [batch, {H}, past_sequence, {dh}], "
                f"past_sequence {MIN_PAST}..{L - 1}: the previous step's present_{i}_{kv}"
                + (" (a prefill passes past_sequence 0)" if MIN_PAST == 0 else ""))
            describe[f"present_{i}_{kv}"] = (f"block {i} attention {kv}s of past and new tokens, float32 "
                                             f"[batch, {H}, past_sequence + sequence, {dh}]: the next step's past")
    if cfg.family == "elastic_decoder":
        for i in range(cfg.num_layers):
            describe[f"head_modes_{i}"] = (f"layer {i}: the head modes a decode step uses, float32 0/1 [batch, {H}]: "
                                           f"the prefill's decisions_layer{i}_sa (ignored at prefill: pass zeros)")
            describe[f"decisions_layer{i}_sa"] = (
                f"layer {i}: 1 where the head ran streaming attention (sink {cfg.sink}, window {cfg.window}), "
                f"0 full attention; routed at prefill, echoed at decode steps; float32 0/1 [batch, {H}]")
            describe[f"decisions_layer{i}_logits"] = f"layer {i}: the router's [FA, SA] logits, float32 [batch, {H}, 2]"
        return describe
    for li in range(1, cfg.num_layers):
        describe[f"decisions_layer{li}_keep"] = (f"block {li}: 1 where the token ran the FFN (p <= {cfg.threshold}), "
                                                 "0 where it skipped; float32 0/1 [batch, sequence]")
        describe[f"decisions_layer{li}_p"] = f"block {li}: the router's skip probability p, float32 [batch, sequence]"
    return describe
