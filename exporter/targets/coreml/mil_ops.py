"""MIL translations of the adaptex ops: what each lowering emits into coremltools' torch frontend.

Routing (routers' outputs, k, rankings, keep and gate, head modes) is emitted under names with the
`route_` prefix, which the fp16 pass leaves in fp32 (precision.py). Masks are additive biases of
-MASK_BIAS (fp16-safe): `select` with scalar branches loses its shape in coremltools 9.
"""
from __future__ import annotations

import numpy as np

def budgeted_attention_mil(context, node, variant: str):
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


def _spare_row(x, name: str):
    """x with one more row of zeros along axis 0: (B, ...) -> (B+1, ...)."""
    from coremltools.converters.mil import Builder as mb

    rank = len(x.shape)
    first = mb.slice_by_index(x=x, begin=[0] * rank, end=[1] + [0] * (rank - 1),
                              end_mask=[False] + [True] * (rank - 1), name=f"{name}_first")
    return mb.concat(values=[x, mb.mul(x=first, y=np.array(0, dtype=_np_dtype(x)), name=f"{name}_zeros")], axis=0,
                     name=name)


def _np_dtype(x):
    from coremltools.converters.mil.mil import types

    return types.nptype_from_builtin(x.dtype) if not types.is_bool(x.dtype) else np.bool_


def _nonzero_with_spare(mask, name: str):
    """The (N+1, 2) index pairs of a (B, X) bool mask's True entries, the last one (B, 0): the mask
    with a spare row that is True at its first entry only, so the result is never empty."""
    from coremltools.converters.mil import Builder as mb

    X = mb.gather(x=mb.shape(x=mask), indices=np.int32(1), axis=0, name=f"{name}_X")
    spare = mb.expand_dims(x=mb.equal(x=mb.range_1d(start=np.int32(0), end=X, step=np.int32(1)), y=np.int32(0)),
                           axes=[0], name=f"{name}_spare")  # (1, X): True, False, ...
    return mb.non_zero(x=mb.concat(values=[mask, spare], axis=0, name=f"{name}_mask"), name=name)


def _drop_spare_row(y, like, name: str):
    """y (B+1, ...) -> (B, ...), B = like's first axis."""
    from coremltools.converters.mil import Builder as mb

    rank = len(like.shape)
    end = mb.concat(values=[mb.slice_by_index(x=mb.shape(x=like), begin=[0], end=[1]), _i32([0] * (rank - 1))],
                    axis=0, name=f"{name}_end")
    return mb.slice_by_index(x=y, begin=[0] * rank, end=end, end_mask=[False] + [True] * (rank - 1), name=name)


def conditional_ffn_mil(context, node, variant: str):
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
        # A spare batch row (zeros) and its index (B, 0) always join the kept ones, so no tensor is
        # ever empty when no token is kept (zero-size tensors fail at prediction time on some Core ML
        # devices, coremltools #1040 and #2516); its result is computed and dropped.
        x_ext = _spare_row(x, f"{node.name}_ext")  # (B+1, T, d)
        g_ext = _spare_row(gate, r + "gate_ext")  # (B+1, T)
        idx = _nonzero_with_spare(keep, r + "idx")  # (N+1, 2) int32
        g = mb.gather_nd(x=g_ext, indices=idx, name=r + "gate_kept")  # (N+1,) fp32
        xs = mb.gather_nd(x=x_ext, indices=idx, name=f"{node.name}_kept")  # (N+1, d)
        u = _ffn_mil(xs, lw, lb, w1, b1, w2, b2, eps, node.name)  # (N+1, d)
        ys = mb.add(x=xs, y=mb.mul(x=u, y=mb.expand_dims(x=g, axes=[1], name=r + "gate_col"),
                                   name=f"{node.name}_gated"), name=f"{node.name}_new")
        y = mb.scatter_nd(data=x_ext, indices=idx, updates=ys, mode="update", name=f"{node.name}_scatter")
        y = _drop_spare_row(y, x, node.name)  # (B, T, d)
    else:
        # every token through the FFN, its update scaled by keep * gate (zero for skipped tokens)
        u = _ffn_mil(x, lw, lb, w1, b1, w2, b2, eps, node.name)  # (B, T, d)
        scale = mb.mul(x=mb.cast(x=keep, dtype="fp32", name=r + "keep_f"), y=gate, name=r + "scale")  # (B, T)
        y = mb.add(x=x, y=mb.mul(x=u, y=mb.expand_dims(x=scale, axes=[-1], name=r + "scale_col"),
                                 name=f"{node.name}_gated"), name=node.name)
    context.add(y, node.name)


def conditional_attention_mil(context, node, variant: str):
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
    # a spare batch row and its pair (B, 0) join each group, so no group is ever empty when every head
    # of a batch runs one mode (zero-size tensors fail at prediction time on some Core ML devices,
    # coremltools #1040 and #2516); the spare row's results are computed and dropped
    q_ext, k_ext, v_ext = (_spare_row(t, f"{name}_{n}_ext") for t, n in ((q, "q"), (k, "k"), (v, "v")))
    km_ext = _spare_row(km, f"{name}_km_ext")
    out = q_ext
    for group, pick in (("fa", mb.logical_not(x=sa)), ("sa", sa)):
        g = f"{name}_{group}"
        idx = _nonzero_with_spare(pick, f"{g}_pairs")  # (N+1, 2) (batch, head)
        qs, ks, vs = (mb.gather_nd(x=t, indices=idx, name=f"{g}_{n}") for t, n in ((q_ext, "q"), (k_ext, "k"),
                                                                                  (v_ext, "v")))
        b = mb.slice_by_index(x=idx, begin=[0, 0], end=[0, 1], end_mask=[True, False])  # (N+1, 1) batch index
        ms = mb.gather_nd(x=km_ext, indices=b, name=f"{g}_key_mask")  # (N+1, S)
        if group == "fa":
            vis = mb.expand_dims(x=ms, axes=[1])  # (N+1, 1, S)
            if causal:  # keys up to the query's own position
                vis = mb.mul(x=vis, y=_ea_band(T, S, sink, window, causal)[0])
            o = _ea_attend(qs, ks, vs, vis, scale, g)  # (N+1, T, dh)
        else:
            o = _ea_streaming(qs, ks, vs, ms, T, S, sink, window, causal, scale, g)
        out = mb.scatter_nd(data=out, indices=idx, updates=o, mode="update", name=f"{g}_scatter")
    return _drop_spare_row(out, q, f"{name}_out")


def elastic_attention_mil(context, node, variant: str):
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


def register_translations(emitters: dict) -> None:
    """Register, for this conversion, a translation of every adaptex op that calls the emitter its
    lowering chose for each node ({FX node name: emit(context, node)}). The table is held by the
    closures coremltools keeps, not by this module, so conversions never share variant state."""
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op

    def translate(context, node):
        emit = emitters.get(node.name)
        if emit is None:
            from adaptex.exporter.errors import ExportError

            raise ExportError(f"no Core ML lowering was chosen for node {node.name}; export through adaptex")
        emit(context, node)

    from adaptex.graphs.ops import OPS

    for op in OPS:  # every adaptex op: its emitter comes from the registry (a missing cell refuses first)
        register_torch_op(translate, torch_alias=[op], override=True)
