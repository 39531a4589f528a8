"""adaptex.ElasticAttention's general body: every head full (FA) or streaming (SA: sinks + window)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.exporter.targets.onnx.bodies.builder import DOMAIN, MS_DOMAIN, ONNX_OPSET, _Body, _private
from adaptex.exporter.targets.onnx.bodies.by_sample import _by_sample


EA_INPUTS = ["q", "k", "v", "sa", "key_mask"]
NEG = -1e30  # masked scores: finite, so a query with no visible key gives a finite (ignored) row


def _pad_bias(b: _Body, key_mask: str) -> str:
    """(B, 1, 1, S): 0 for a real key, NEG for a padded one, added to (B, H, T, S) scores."""
    return b("Unsqueeze", b("Where", key_mask, b.const(0.0, np.float32), b.const(NEG, np.float32)), b.const([1, 2]))


def _pick(b: _Body, cond: str, x: str, y: str) -> str:
    """Where over bool tensors (ONNX Runtime's Where has no bool kernel): (cond & x) | (~cond & y)."""
    return b("Or", b("And", cond, x), b("And", b("Not", cond), y))


def _visibility(b: _Body, T: str, S: str, sink: str, window: str, causal: str):
    """(T, S) bool masks of the keys a full (FA) and a streaming (SA) query sees, before padding."""
    c0, c1 = b.const(0), b.const(1)
    a = b("Unsqueeze", b("Range", b("Sub", S, T), S, c1), b.const([1]))  # (T, 1) absolute query positions
    j = b("Unsqueeze", b("Range", c0, S, c1), b.const([0]))  # (1, S)
    is_causal = b("Equal", causal, c1)
    fa = b("Or", b("LessOrEqual", j, a), b("Not", is_causal))  # (T, S)
    d = b("Sub", a, j)  # (T, S): query minus key
    local_c = b("And", b("GreaterOrEqual", d, c0), b("Less", d, window))
    local_n = b("LessOrEqual", b("Abs", d), b("Div", window, b.const(2)))
    local = _pick(b, is_causal, local_c, local_n)
    return fa, b("And", fa, b("Or", b("Less", j, sink), local))


def _masked_softmax_av(b: _Body, scores: str, visible: str, v: str) -> str:
    return b("MatMul", b("Softmax", b("Where", visible, scores, b.const(NEG, np.float32)), axis=-1), v)


def elastic_attention_function(variant: str, causal_known: bool | None = None, dispatch: bool = False,
                               decode_step: bool = False, fused: bool = False, head_dim: int | None = None,
                               by_sample: bool = True, heads: int | None = None,
                               policy: OrtPolicy = DEFAULT) -> onnx.FunctionProto:
    """The body of adaptex.ElasticAttention: every head of a layer, each full or streaming.

    sparse: the (B*H) pairs of each mode gathered (NonZero over sa): FA pairs attend every visible
    key, SA pairs block-local (each block of Bq = min(window, T) queries against its own run of
    keys, via a (blocks, L) Gather, plus the sinks), and ScatterND (no reduction) puts both back.
    dispatch (ONNX Runtime): If nodes take a shorter path where one applies: a call whose pairs are
    all FA, or whose keys all lie within an SA query's sinks and window, attends every (B, H) pair
    over every visible key as it is (no reshape, gather or scatter); all SA, every pair
    block-local; only a mix gathers; and a call with SA pairs and at most
    policy.mixed_call_masked_up_to scores a sample (H*T*S; 0: never) attends every pair as it is, the
    SA pairs' keys outside their reach masked; an encoder's call (causal_known False) also does
    where masking adds few scores over block-local attention (policy.masked_excess_up_to)
    (elastic_attention.call_runs_masked; the translation's test, with `heads`). dense: the full
    score matrix for every head, SA heads through a band mask (static shapes). Padding masks by
    addition (a bias per key), causality by one Trilu of NEG above the diagonal (no T x S
    comparisons). causal_known (the call's causal flag where
    tracing fixed it) drops the branches of the other kind; head_dim (likewise) makes the score
    scale a constant.
    decode_step (with dispatch): an If sends a causal call with T = 1 (a decode step) to a short
    body that reads only the SA pairs' sinks and window; off where the artifact's decode steps run a
    decode-step graph of their own (elastic_step_function). TensorRT-bound bodies take neither: the
    operator docs of TensorRT 10.1 and 10.6 ask an If's branches for equal output shapes, only later
    releases for equal ranks, so its engines take the general body, which serves every call.
    fused (ONNX Runtime, encoders: causal_known False): FA pairs of a call with no padded key run
    ONNX Runtime's own fused attention kernel, com.microsoft.MultiHeadAttention (one head per pair).
    The fused kernel beats the floored MatMul + bias Add + Softmax + MatMul for FA pairs; with a
    padding mask it gains little, so padded calls keep the plain body. SA pairs stay out of it: the
    kernel's band mask sends its exp through subnormal floats, where block_local's floored Softmax
    does not (measurements: lab/notes/, lab/fused_mask_cost.py).
    Encoders only, because their yardstick has the same kernel (ONNX Runtime's transformer optimizer
    fuses the original checkpoint's attention into it); no dense decoder graph here does, so a
    decoder's FA heads keep the plain body rather than win by a kernel the dense graph lacks.
    by_sample (with dispatch): a large call's plain FA pairs attend a sample at a time
    (_by_sample); False for the body of a program whose calls never reach that threshold.
    heads (with dispatch, encoders: causal_known False): the layers' head count, fixed by tracing.
    The body then reads what every layer derives alike from the key mask (ENCODER_SHARED) as
    inputs, which the call's translation computes once for all the layers
    (lowerings.elastic_encoder_node_for)."""
    fused = fused and causal_known is False
    by_sample = dispatch and by_sample  # the by-sample If: ONNX Runtime's bodies only
    b = _Body("ea_", policy)
    q, k, v, sa, key_mask = EA_INPUTS
    shared = dict(zip(ENCODER_SHARED, ENCODER_SHARED)) if heads and dispatch and causal_known is False else {}
    sink, window, causal = b.attr_int("sink"), b.attr_int("window"), b.attr_int("causal")
    c0, c1 = b.const(0), b.const(1)
    T1, S1 = b("Shape", q, start=2, end=3), b("Shape", k, start=2, end=3)
    T, S = b("Squeeze", T1, b.const([0])), b("Squeeze", S1, b.const([0]))
    if head_dim:
        scale = b.const([1.0 / np.sqrt(head_dim)], np.float32)  # (1,)
    else:
        scale = b("Reciprocal", b("Sqrt", b("Cast", b("Shape", q, start=3, end=4), to=TensorProto.FLOAT)))
    is_causal = b("Equal", causal, c1) if causal_known is None else None

    def causal_or(when_causal, otherwise):  # the call's kind, chosen here where tracing fixed it
        if causal_known is None:
            return when_causal(), otherwise()
        return when_causal() if causal_known else otherwise()

    if variant == "dense":
        fa_vis, sa_vis = _visibility(b, T, S, sink, window, causal)
        scores = b("Mul", b("MatMul", q, b("Transpose", k, perm=[0, 1, 3, 2])), scale)  # (B, H, T, S)
        vis = _pick(b, b("Unsqueeze", sa, b.const([2, 3])), sa_vis, fa_vis)  # (B, H, T, S)
        vis = b("And", vis, b("Unsqueeze", key_mask, b.const([1, 2])))
        b.nodes.append(helper.make_node("Identity", [_masked_softmax_av(b, scores, vis, v)], ["o"]))
        return _ea_function(b, variant, fused)

    def pad_bias() -> str:  # made in the branch that reads it (only one branch runs)
        return _pad_bias(b, key_mask)
    causal_bias = causal_known is not False

    def with_causality(scores: str) -> str:  # keys after the query: NEG where j - i >= S - T + 1
        if not causal_bias:
            return scores
        kdiag = b("Add", b("Sub", S, T), c1)
        if causal_known is None:  # not causal: the diagonal past the last key, so nothing is masked
            kdiag = b("Where", is_causal, kdiag, S)
        full = b("ConstantOfShape", b("Concat", T1, S1, axis=0), value=helper.make_tensor("v", TensorProto.FLOAT, [1], [NEG]))
        return b("Add", scores, b("Trilu", full, kdiag, upper=1))

    def no_pad() -> str:  # ONNX Runtime's fused kernel computes the same where no key is padded
        if shared:
            return shared["unpadded"]
        return b("Equal", b("ReduceMin", b("Cast", key_mask, to=TensorProto.INT32), keepdims=0), b.const(1, np.int32))

    def every_fa() -> str:  # every (B, H) pair over every visible key, as it is: (B, H, T, dh)
        if fused:
            return b.if_(no_pad(), lambda: b("Reshape", b("MultiHeadAttention", *flat(q, k, v), domain=MS_DOMAIN,
                                                           num_heads=1), b("Shape", q)),
                         plain_fa)
        return plain_fa()

    def plain_fa() -> str:
        def attend(qx: str, kx: str, vx: str, bias: str) -> str:  # (B, H, T, dh) over (B, H, S, dh)
            scores = b("Add", b("MatMul", b("Mul", qx, scale), b("Transpose", kx, perm=[0, 1, 3, 2])), bias)
            return b("MatMul", b("Softmax", with_causality(scores), axis=-1), vx)
        if not by_sample:
            return attend(q, k, v, pad_bias())
        bias = pad_bias()  # (B, 1, 1, S)
        return _by_sample(b, q, k, v, lambda: attend(q, k, v, bias),
                          lambda qi, ki, vi, i1, j1, c: attend(qi, ki, vi, b("Slice", bias, i1, j1, b.const([0]))))

    def flat(*xs: str) -> list[str]:  # (B, H, L, dh) -> (B*H, L, dh)
        dh1 = b("Shape", q, start=3, end=4)
        return [b("Reshape", x, b("Concat", b.const([-1]), b("Shape", x, start=2, end=3), dh1, axis=0)) for x in xs]

    def flat_mask() -> str:  # (B, S) -> (B*H, S)
        if shared:
            return shared["flat_mask"]
        B1, H1 = b("Shape", q, start=0, end=1), b("Shape", q, start=1, end=2)
        return b("Reshape", b("Expand", b("Unsqueeze", key_mask, b.const([1])), b("Concat", B1, H1, S1, axis=0)),
                 b("Concat", b.const([-1]), S1, axis=0))

    def pairs_attend(qx: str, kx: str, vx: str, mx: str) -> str:  # (N, T, dh) pairs over every visible key
        def attend(qx: str, kx: str, vx: str, mx: str) -> str:
            bias = b("Where", b("Unsqueeze", mx, b.const([1])), b.const(0.0, np.float32), b.const(NEG, np.float32))
            scores = b("Add", b("MatMul", b("Mul", qx, scale), b("Transpose", kx, perm=[0, 2, 1])), bias)
            return b("MatMul", b("Softmax", with_causality(scores), axis=-1), vx)
        if not by_sample:
            return attend(qx, kx, vx, mx)
        return _by_sample(b, qx, kx, vx, lambda: attend(qx, kx, vx, mx),  # a pair at a time, for a large call
                          lambda qi, ki, vi, i1, j1, c: attend(qi, ki, vi, b("Slice", mx, i1, j1, b.const([0]))),
                          key_axis=1)

    def sees_all() -> str:  # every key within an SA query's reach: SA sees what FA sees
        if shared:
            return shared["reach"]
        return causal_or(lambda: b("LessOrEqual", S, b("Add", sink, window)),
                         lambda: b("Or", b("LessOrEqual", b("Sub", S, c1), b("Div", window, b.const(2))),
                                   b("LessOrEqual", S, sink)))

    def one_mode_or_mixed(every_sa_, every_fa_, mixed_) -> str:
        """A call whose pairs are all SA runs `every_sa_` (one If deep: the common case where the
        routers were trained for a high SA share); all FA, or keys an SA query all sees (where SA
        sees what FA sees), `every_fa_`; a mix `mixed_` (two Ifs deep)."""
        n_sa = b("ReduceSum", b("Cast", sa, to=TensorProto.INT64), keepdims=0)
        reach = sees_all()
        if causal_known is None:
            reach = _pick(b, is_causal, *reach)
        only_sa = b("And", b("Equal", n_sa, b("Size", sa)), b("Not", reach))
        return b.if_(only_sa, every_sa_, lambda: b.if_(b("Or", b("Equal", n_sa, c0), reach), every_fa_, mixed_))

    up_to = policy.mixed_call_masked_up_to

    def by_modes() -> str:
        """Any call: one of at most `up_to` scores a sample (H T S) every pair as it is, SA keys masked
        (one If deep, whatever its modes: an ONNX Runtime If costs more than a few small kernels);
        a larger one by its modes (one_mode_or_mixed)."""
        by_mode = lambda: one_mode_or_mixed(every_sa, every_fa, mixed)  # noqa: E731
        if up_to <= 0:
            return by_mode()
        if shared:  # the translation's test (the same), made once for every layer
            return b.if_(shared["masked"], masked, by_mode)
        H = b("Squeeze", b("Shape", sa, start=1, end=2), b.const([0]))
        HT = b("Mul", H, T)
        few = b("LessOrEqual", b("Mul", HT, S), b.const(up_to))
        if causal_known is False:  # an encoder's call: also where masking adds few
            # scores over block-local attention (elastic_attention.call_runs_masked)
            B = b("Squeeze", b("Shape", q, start=0, end=1), b.const([0]))
            beyond = b("Max", b("Sub", S, b("Add", sink, b("Mul", window, b.const(2)))), c0)  # keys past a row
            excess = b("Mul", b("Mul", B, HT), beyond)
            few = b("Or", few, b("LessOrEqual", excess, b.const(policy.masked_excess_up_to)))
        return b.if_(few, masked, by_mode)

    def masked() -> str:  # every pair over every visible key, an SA pair's keys outside its reach hidden
        if shared:
            pick = b("Add", shared["first"], b("Cast", sa, to=TensorProto.INT64))  # (B, H)
            return attend_masked(b("Gather", shared["planes"], pick, axis=0))
        a = b("Unsqueeze", b("Range", b("Sub", S, T), S, c1), b.const([1]))  # (T, 1) query positions
        j = b("Unsqueeze", b("Range", c0, S, c1), b.const([0]))  # (1, S)
        reach = causal_or(lambda: b("Less", b("Sub", a, j), window),  # keys after the query: the causal bias
                          lambda: b("LessOrEqual", b("Abs", b("Sub", j, a)), b("Div", window, b.const(2))))
        if causal_known is None:
            reach = _pick(b, is_causal, *reach)
        outside = b("Not", b("Or", b("Less", j, sink), reach))  # (T, S)
        # one bias a pair, gathered as whole (T, S) planes from the sample's two: padding and
        # causality (an FA pair's), and that plus the keys outside the reach (an SA pair's); the
        # pair's plane of sample b is 2 b + its mode. A Gather copies planes where a mode times the
        # reach bias plus the FA bias took a Mul and an Add over (B, H, T, S) (the masked short-call
        # graph's same change: 0.94 to 0.97 at T = 128, docs/benchmarking.md#short-calls)
        hide = b("Where", outside, b.const(NEG, np.float32), b.const(0.0, np.float32))  # (T, S)
        B1 = b("Shape", q, start=0, end=1)
        fa_bias = b("Expand", with_causality(pad_bias()), b("Concat", B1, b.const([1]), T1, S1, axis=0))  # (B, 1, T, S)
        planes = b("Reshape", b("Concat", fa_bias, b("Add", fa_bias, hide), axis=1),
                   b("Concat", b.const([-1]), T1, S1, axis=0))  # (2 B, T, S)
        first = b("Mul", b("Range", c0, b("Squeeze", B1, b.const([0])), c1), b.const(2))  # (B,)
        pick = b("Add", b("Unsqueeze", first, b.const([1])), b("Cast", sa, to=TensorProto.INT64))  # (B, H)
        return attend_masked(b("Gather", planes, pick, axis=0))

    def attend_masked(bias: str) -> str:  # every pair over every key, with its (B, H, T, S) bias
        scores = b("Add", b("MatMul", b("Mul", q, scale), b("Transpose", k, perm=[0, 1, 3, 2])), bias)
        return b("MatMul", b("Softmax", scores, axis=-1), v)

    def every_sa() -> str:
        qf, kf, vf = flat(q, k, v)
        return b("Reshape", block_local(qf, kf, vf, flat_mask()), b("Shape", q))

    def fa_pairs(qx: str, kx: str, vx: str, mx: str) -> str:  # gathered FA pairs, fused where it applies
        if not fused:
            return pairs_attend(qx, kx, vx, mx)
        return b.if_(no_pad(), lambda: b("MultiHeadAttention", qx, kx, vx, domain=MS_DOMAIN, num_heads=1),
                     lambda: pairs_attend(qx, kx, vx, mx))

    def mixed() -> str:  # FA pairs over every visible key, SA pairs block-local, each into its rows
        qf, kf, vf = flat(q, k, v)
        mf = flat_mask()
        modes = b("Reshape", sa, b.const([-1]))  # (BH,)
        out = b("Mul", qf, b.const(0.0, np.float32))
        for pick, fn in ((b("Not", modes), fa_pairs), (modes, block_local)):
            idx = b("Transpose", b("NonZero", pick), perm=[1, 0])  # (N, 1)
            rows = b("Squeeze", idx, b.const([1]))
            out = b("ScatterND", out, idx, fn(*(b("Gather", t, rows, axis=0) for t in (qf, kf, vf, mf))))
        return b("Reshape", out, b("Shape", q))

    def block_runs(before: str, extra: str):
        """Blocks of Bq = min(window, T) queries, block i's starting at position a0[i] = S - T + i Bq,
        and each block's run of L = Bq + extra keys, starting `before` keys ahead of it: (Bq, nb, L,
        a0 (nb,), j (nb, L) the run's key positions, some outside 0..S-1)."""
        Bq = b("Max", b("Min", window, T), c1)
        nb = b("Div", b("Sub", b("Add", T, Bq), c1), Bq)  # ceil(T / Bq)
        L = b("Add", Bq, extra)
        a0 = b("Add", b("Sub", S, T), b("Mul", b("Range", c0, nb, c1), Bq))  # (nb,)
        j = b("Add", b("Unsqueeze", b("Sub", a0, before), b.const([1])),
              b("Unsqueeze", b("Range", c0, L, c1), b.const([0])))  # (nb, L)
        return Bq, nb, L, a0, j

    def padded_queries(qs: str, nb: str, Bq: str) -> str:  # (Ns, T, dh) -> (Ns, nb Bq, dh), zero rows after T
        pad = b("Sub", b("Mul", nb, Bq), T)
        return b("Pad", qs, b("Concat", b.const([0, 0, 0, 0]), b("Unsqueeze", pad, b.const([0])), b.const([0]), axis=0))

    def block_local(qs: str, ks: str, vs: str, ms: str) -> str:  # SA pairs: windows plus sinks -> (Ns, T, dh)
        """Each block of Bq queries against one row of keys (nb, K = ns + L): the sinks, then the
        block's run. One score MatMul, one bias Add for what the block's queries may see (the band,
        the run's keys below the sinks or past S, a sink after a causal query) and one for the padded
        keys, one Softmax, one MatMul with the values: no Where on the scores, no Concat or Slice of
        them (0.55 to 0.7 of the chain that scored sinks and run apart and masked by Where; the
        encoders' SA pairs in ONNX Runtime's fused kernel were slower still, its mask sending exp
        through subnormal floats that no floor can reach; docs/benchmarking.md)."""
        dh1 = b("Shape", q, start=3, end=4)
        cm1 = b.const([-1])
        half = b("Div", window, b.const(2))
        # query a sees a - window + 1 .. a (causal) or a - half .. a + half: `before` keys ahead of
        # it, and a block's run is Bq plus `extra` keys long
        spans = causal_or(lambda: (b("Sub", window, c1),) * 2, lambda: (half, b("Mul", half, b.const(2))))
        if causal_known is None:
            (cb, ce), (nb_, ne) = spans
            spans = (b("Where", is_causal, cb, nb_), b("Where", is_causal, ce, ne))
        Bq, nb, L, a0, j = block_runs(*spans)
        ns = b("Min", sink, S)
        nb1, ns1 = b("Unsqueeze", nb, b.const([0])), b("Unsqueeze", ns, b.const([0]))
        sinks = b("Expand", b("Unsqueeze", b("Range", c0, ns, c1), b.const([0])), b("Concat", nb1, ns1, axis=0))
        keys = b("Concat", sinks, j, axis=1)  # (nb, K): the sinks, then the block's run
        a = b("Add", b("Unsqueeze", a0, b.const([1])), b("Unsqueeze", b("Range", c0, Bq, c1), b.const([0])))  # (nb, Bq)
        d = b("Sub", b("Unsqueeze", a, b.const([2])), b("Unsqueeze", keys, b.const([1])))  # (nb, Bq, K)
        inwin = causal_or(lambda: b("And", b("GreaterOrEqual", d, c0), b("Less", d, window)),
                          lambda: b("LessOrEqual", b("Abs", d), half))
        if causal_known is None:
            inwin = _pick(b, is_causal, *inwin)
        col = b("Less", b("Range", c0, b("Add", ns, L), c1), ns)  # (K,) the sink columns
        k3 = b("Unsqueeze", keys, b.const([1]))
        valid = b("And", b("Or", col, b("And", inwin, b("GreaterOrEqual", k3, sink))), b("Less", k3, S))
        if causal_bias:  # a sink after the query (the first queries of a short prompt)
            before = b("GreaterOrEqual", d, c0)
            if causal_known is None:
                before = b("Or", before, b("Not", is_causal))
            valid = b("And", valid, before)
        zero, neg = b.const(0.0, np.float32), b.const(NEG, np.float32)
        band = b("Where", valid, zero, neg)  # (nb, Bq, K)
        kc = b("Clip", keys, c0, b("Sub", S, c1))
        padded = b("Transpose", b("Gather", b("Transpose", ms, perm=[1, 0]), kc, axis=0), perm=[2, 0, 1])  # (Ns, nb, K)
        pad = b("Where", b("Unsqueeze", padded, b.const([2])), zero, neg)  # (Ns, nb, 1, K)
        Bq1 = b("Unsqueeze", Bq, b.const([0]))
        qb = b("Reshape", padded_queries(b("Mul", qs, scale), nb, Bq), b("Concat", cm1, nb1, Bq1, dh1, axis=0))
        kb, vb = b("Gather", ks, kc, axis=1), b("Gather", vs, kc, axis=1)  # (Ns, nb, K, dh)
        scores = b("Add", b("Add", b("MatMul", qb, b("Transpose", kb, perm=[0, 1, 3, 2])), band), pad)
        o = b("MatMul", b("Softmax", scores, axis=-1), vb)  # (Ns, nb, Bq, dh)
        o = b("Reshape", o, b("Concat", cm1, b("Unsqueeze", b("Mul", nb, Bq), b.const([0])), dh1, axis=0))
        return b("Slice", o, b.const([0]), T1, b.const([1]))  # (Ns, T, dh)

    def step() -> str:  # a decode step (T = 1, causal): the query is the last position
        # A layer's pairs are often all FA or all SA: those steps take no gather of pairs, no
        # scatter, and no copy of the FA pairs' cache. FA: every key is at or before the query, so
        # only padding is masked
        ns = b("Min", sink, S)
        ws = b("Max", b("Sub", S, window), ns)
        keys = b("Concat", b("Range", c0, ns, c1), b("Range", ws, S, c1), axis=0)  # (L,) sinks and window
        bias4 = pad_bias()
        step_fa = lambda: b("MatMul", b("Softmax", b("Add", b("MatMul", b("Mul", q, scale),  # noqa: E731
                                                                        b("Transpose", k, perm=[0, 1, 3, 2])), bias4),
                                                     axis=-1), v)

        def step_sa() -> str:
            kw, vw = b("Gather", k, keys, axis=2), b("Gather", v, keys, axis=2)
            scores = b("Add", b("MatMul", b("Mul", q, scale), b("Transpose", kw, perm=[0, 1, 3, 2])),
                       b("Gather", bias4, keys, axis=3))
            return b("MatMul", b("Softmax", scores, axis=-1), vw)

        def step_mixed() -> str:  # FA pairs over every key, SA pairs over their sinks and window
            qf, kf, vf = flat(q, k, v)
            mf = flat_mask()
            kw, vw, mw = b("Gather", kf, keys, axis=1), b("Gather", vf, keys, axis=1), b("Gather", mf, keys, axis=1)
            modes = b("Reshape", sa, b.const([-1]))
            out = b("Mul", qf, b.const(0.0, np.float32))
            for pick, kk, vv, mm in ((b("Not", modes), kf, vf, mf), (modes, kw, vw, mw)):
                idx = b("Transpose", b("NonZero", pick), perm=[1, 0])  # (N, 1)
                rows = b("Squeeze", idx, b.const([1]))
                out = b("ScatterND", out, idx, pairs_step(*(b("Gather", t, rows, axis=0) for t in (qf, kk, vv, mm))))
            return b("Reshape", out, b("Shape", q))

        def pairs_step(qx, kx, vx, mx) -> str:
            bias = b("Where", b("Unsqueeze", mx, b.const([1])), b.const(0.0, np.float32), b.const(NEG, np.float32))
            scores = b("Add", b("MatMul", b("Mul", qx, scale), b("Transpose", kx, perm=[0, 2, 1])), bias)
            return b("MatMul", b("Softmax", scores, axis=-1), vx)

        return one_mode_or_mixed(step_sa, step_fa, step_mixed)

    if not dispatch:  # TensorRT: no If
        out = mixed()
    elif not decode_step or causal_known is False:  # a decode-step graph elsewhere, or an encoder
        out = by_modes()
    else:  # one If: a step reads O(sink + window) keys per SA pair in ~20 nodes
        is_step = b("Equal", T, c1)
        if causal_known is None:
            is_step = b("And", is_step, is_causal)
        out = b.if_(is_step, step, by_modes)
    b.nodes.append(helper.make_node("Identity", [out], ["o"]))
    return _ea_function(b, variant, fused, heads if shared else None)


def _ea_function(b: _Body, variant: str, fused: bool, heads: int | None = None) -> onnx.FunctionProto:
    """heads: a body reading ENCODER_SHARED, whose translation derives them for that many heads (named
    in the doc string too, so calls of another head count need another body: export refuses them)."""
    return _private(helper.make_function(
        DOMAIN, "ElasticAttention", EA_INPUTS + (STEP_SHARED + ENCODER_SHARED if heads else []), ["o"], b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if fused else []),
        attributes=["sink", "window", "causal"],
        doc_string=f"adaptex::elastic_attention, {variant} lowering (see docs/ops.md)"
        + (f"; an encoder's, {heads} heads" if heads else ""),
    ))


# What a decode step's body reads besides EA_INPUTS, the same for every layer (they depend on the key
# mask and the attributes alone): the key positions an SA query reads (sinks, then the window), the
# padding bias (B, 1, 1, S) and at those positions (B, 1, 1, L), and the padding bias with the
# positions outside them hidden too (B, 1, 1, S: an SA pair's bias where a layer masks).
# The call's translation computes them in the graph (lowerings.elastic_step_node), where the
# exporter's common-subexpression elimination leaves one copy for every layer.
STEP_SHARED = ["keys", "bias", "bias_sa", "bias_far"]

# What an encoder's general body reads besides EA_INPUTS (after STEP_SHARED, which it leaves empty),
# the same for every layer: whether every key lies within an SA query's reach (a bool scalar), whether
# no key is padded (a bool scalar), the key mask per (sample, head) pair (B*H, S), a masked call's
# bias planes (2 B, T, S: a sample's padding bias, and that with the keys outside an SA query's reach
# hidden; empty, (2 B, 0, S), for a call past policy.mixed_call_masked_up_to) and each sample's first plane
# (B, 1: 2 b), and whether the call attends every pair masked (a bool scalar: the test of
# elastic_attention.call_runs_masked). lowerings.elastic_encoder_node_for computes them in the graph
# once for all the layers, where each layer's body had run about thirty small kernels for them.
ENCODER_SHARED = ["reach", "unpadded", "flat_mask", "planes", "first", "masked"]
