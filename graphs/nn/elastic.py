"""Elastic Attention's layer: every head full or streaming, routed from the keys."""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.parallel import batch_noise
from adaptex.graphs.nn.record import SOFT_MODES, AdaptiveLayer, Recorder, check_inputs, control_flow_traced
from adaptex.graphs.ops import elastic_attention as ea


# Pooling plans by key mask: every router of a model reads the same mask, so the positions and
# weights it pools with are made once per forward (and once in a traced graph) and reused by each
# layer. Keyed by the mask's identity and held by a weak reference (the entry goes with its mask);
# an in-place change of the mask (its version) makes a new plan.
_PLANS: dict[int, tuple] = {}


def _plans_of(key_mask: Tensor) -> dict:
    """The plans made for this very mask tensor (a fresh dict the first time)."""
    entry = _PLANS.get(id(key_mask))
    if entry is not None and entry[0]() is key_mask:
        return entry[1]

    def forget(ref, i=id(key_mask)) -> None:
        if i in _PLANS and _PLANS[i][0] is ref:
            del _PLANS[i]
    try:
        ref = weakref.ref(key_mask, forget)
    except TypeError:  # a mask that cannot be weakly referenced: no sharing
        return {}
    _PLANS[id(key_mask)] = (ref, {})
    return _PLANS[id(key_mask)][1]


class HeadRouter(nn.Module):
    """[FA, SA] logits per head from the layer's keys pooled over the first and last N real tokens,
    a task MLP shared by the heads plus a per-head bias, and a router MLP.

    Pooling: over the real tokens' ranks (encoders), or, with edge_pooling, two runs of N positions
    from the first real token (decoder batches are left-padded) and from the end (a decoder's decode
    steps skip the router: ElasticAttention's head_modes). Either way the two means are one MatMul of
    the keys with a (B, 2, S) weight matrix, made from the mask alone once for all the routers that
    read it (pool_plan): a layer reads its keys once, with no gather or index the size of the keys."""

    def __init__(self, num_heads: int, head_dim: int, hidden: int = 64, pool_tokens: int = 100,
                 edge_pooling: bool = False):
        super().__init__()
        self.pool_tokens, self.edge_pooling = pool_tokens, edge_pooling
        self.task = nn.Sequential(nn.Linear(2 * head_dim, hidden), nn.GELU())
        self.head_bias = nn.Parameter(torch.zeros(num_heads, hidden))
        self.router = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 2))

    def pool_plan(self, k: Tensor, key_mask: Tensor) -> Tensor:
        """(B, 1, 2, S) weights to pool (B, H, S, dh) keys with, one row per mean, each summing to 1
        over the positions it averages (0 for a row with no real token). Shared by every router with
        the same settings that reads this mask (see _PLANS)."""
        key = (self.edge_pooling, self.pool_tokens, key_mask._version)
        memo = _plans_of(key_mask)
        if key not in memo:
            memo.clear()  # plans of an earlier version of the mask
            w = self._edge_weights(key_mask) if self.edge_pooling else self._ranked_weights(key_mask)
            memo[key] = (w / w.sum(2, keepdim=True).clamp(min=1))[:, None]
        return memo[key]

    def _ranked_weights(self, key_mask: Tensor) -> Tensor:
        m = key_mask.float()  # (B, S)
        rank = torch.cumsum(m, dim=1) - 1  # rank of each real token among the real ones
        n_real = m.sum(1, keepdim=True)
        return torch.stack([m * (rank < self.pool_tokens).float(), m * (rank >= n_real - self.pool_tokens).float()], 1)

    def _edge_weights(self, key_mask: Tensor) -> Tensor:
        """The first N positions from the first real token and the last N (of the real ones):
        decoder batches are left-padded, so both are runs of positions, whatever the length."""
        S, N = key_mask.shape[1], self.pool_tokens
        j = torch.arange(S, device=key_mask.device)[None, :]  # (1, S)
        offset = S - key_mask.long().sum(1, keepdim=True)  # (B, 1): the left padding
        first = (j >= offset) & (j < offset + N)
        last = (j >= offset) & (j >= S - N)
        return torch.stack([first, last], 1).float()  # (B, 2, S)

    def pool(self, k: Tensor, key_mask: Tensor, plan: Tensor | None = None) -> Tensor:
        """(B, H, S, dh) keys -> (B, H, 2 dh): means over the first and the last N real tokens
        (plan: pool_plan's weights, else made or found here)."""
        B, H, S, dh = k.shape
        w = plan if plan is not None else self.pool_plan(k, key_mask)
        # the weights expanded over the heads, not broadcast in the MatMul: with the broadcast,
        # coremltools' shape inference left the head width of the next attention a symbol (seen:
        # the dense Core ML export of an elastic decoder failed on float(q.shape[-1]))
        return (w.expand(B, H, 2, S) @ k).reshape(B, H, 2 * dh)  # (B, H, 2, dh): [first mean, last mean]

    def route(self, k: Tensor, key_mask: Tensor, plan: Tensor | None = None, expand: bool = True) -> Tensor:
        """(B, H, 2) fp32 [FA, SA] logits. expand=False pools with the plan broadcast over the heads
        in the MatMul (two kernels fewer a layer in ONNX Runtime; see pool for why the rest expand)."""
        if expand:
            pooled = self.pool(k.float(), key_mask, plan)
        else:
            B, H, S, dh = k.shape
            w = plan if plan is not None else self.pool_plan(k, key_mask)
            pooled = (w @ k.float()).reshape(B, H, 2 * dh)
        h = self.task(pooled) + self.head_bias  # (B, H, hidden)
        return self.router(h)  # (B, H, 2) fp32: [FA, SA]

    def forward(self, k: Tensor, key_mask: Tensor) -> Tensor:
        return self.route(k, key_mask)


class ElasticAttention(AdaptiveLayer, HeadRouter):
    """Every head of a layer in one op, each head full attention (FA) or streaming attention (SA:
    the first `sink` keys plus a local `window`; causal for decoders, a symmetric band for encoders).

    forward(q, k, v (B, H, T|S, dh), key_mask (B, S) 1 = real key) -> (B, H, T, dh). Its only
    parameters are its router's (it is a HeadRouter): the router reads the keys and gives each head
    [FA, SA] logits; hard mode takes SA where that logit is larger. Soft mode (training) mixes both
    outputs by a straight-through Gumbel-softmax sample at temperature `tau` (anneal it).
    A decoder routes once at prefill and reuses the modes at decode steps: pass them as head_modes
    (B, H) bool, with use_modes (a bool scalar tensor; None: always) choosing them over the routed
    ones inside one traced graph; where they are used the router does not run (a step costs it
    nothing) and the logits are the given modes one-hot. Decisions: sa (B, H) bool, logits (B, H, 2).

    Grouped-query attention (kv_groups > 1): num_heads counts the KV heads; q has num_heads *
    kv_groups heads, k and v num_heads. A decision is per KV head, shared by its group of query
    heads: the router reads keys, which exist per KV head, and an SA KV head then needs only its
    sink and window in the cache, which a per-query-head decision would not allow as soon as one
    query head of the group stayed FA."""

    def __init__(self, num_heads: int, head_dim: int, sink: int = 4, window: int = 32, causal: bool = False,
                 router_hidden: int = 64, pool_tokens: int = 100, edge_pooling: bool | None = None,
                 kv_groups: int = 1):
        if sink < 0 or window < 1:
            raise ValueError(f"sink must be >= 0 and window >= 1 (got sink={sink}, window={window})")
        if kv_groups < 1:
            raise ValueError(f"kv_groups must be >= 1 (got {kv_groups})")
        super().__init__(num_heads, head_dim, router_hidden, pool_tokens,
                         edge_pooling=causal if edge_pooling is None else edge_pooling)
        self.sink, self.window, self.causal, self.tau = sink, window, causal, 1.0
        self.kv_groups = kv_groups
        self.num_heads = num_heads * kv_groups  # query heads (a check sizes its batches by them)

    def _groups(self, t: Tensor) -> Tensor:
        """(B, Hkv, ...) -> (B, Hkv * kv_groups, ...): a KV head's keys, values or mode for each
        query head of its group (plain expand and reshape: every target lowers them)."""
        g = self.kv_groups
        if g == 1:
            return t
        B, Hk = t.shape[:2]
        return t[:, :, None].expand(B, Hk, g, *t.shape[2:]).reshape(B, Hk * g, *t.shape[2:])

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, head_modes: Tensor | None = None,
                use_modes: Tensor | None = None, *, mode: str | None = None, force_sa: Tensor | None = None,
                tau: float | None = None, return_decisions: bool = False, given_logits: Tensor | None = None):
        """o (B, H, T, dh); with return_decisions, (o, decisions) (the shipped elastic models' call).
        given_logits: with head_modes and no use_modes (a decode step), their one-hot logits (B, Hkv, 2),
        made by the caller (given_mode_logits: a decoder's step program makes every layer's at once)."""
        check_inputs(type(self).__name__, k, None, None, rank=4, names=("k", "key_mask"))
        o, dec = self._attend(q, k, v, key_mask, head_modes, use_modes, self.resolve_mode(mode), force_sa, tau,
                              given_logits)
        return (o, dec) if return_decisions else o

    def _given_or_routed(self, k: Tensor, key_mask: Tensor, given: Tensor,
                         use_modes: Tensor | None) -> tuple[Tensor, Tensor]:
        """(logits (B, Hkv, 2), the routed SA choice (B, Hkv)) where head modes are given. Where they
        are used (a decode step: use_modes true, or None) the router does not run, so a step costs
        it nothing, and the logits are the given modes one-hot ([1, 0] FA, [0, 1] SA). Otherwise (a
        prefill) the router decides. Traced for a runtime that runs an `If` (traced_control_flow),
        the choice is a torch.cond; elsewhere the graph computes both and selects."""
        def given_logits(k: Tensor, key_mask: Tensor, given: Tensor, plan: Tensor | None = None) -> Tensor:
            return given_mode_logits(given)

        def routed_logits(k: Tensor, key_mask: Tensor, given: Tensor, plan: Tensor) -> Tensor:
            return self.route(k, key_mask, plan)

        if use_modes is None or (not torch.compiler.is_exporting() and bool(use_modes)):
            return given_logits(k, key_mask, given), given
        plan = self.pool_plan(k, key_mask)
        if not torch.compiler.is_exporting():
            logits = routed_logits(k, key_mask, given, plan)
        elif control_flow_traced():  # the plan made outside the If: a branch's values stay in the branch
            logits = torch.cond(use_modes, given_logits, routed_logits, (k, key_mask, given, plan))
        else:  # both computed and selected
            logits = torch.where(use_modes, given_logits(k, key_mask, given), routed_logits(k, key_mask, given, plan))
        return logits, _choice(logits)

    def _attend(self, q, k, v, key_mask, head_modes, use_modes, mode, force_sa, tau,
                given_logits=None) -> tuple[Tensor, dict]:
        key_mask = key_mask.bool()
        kq, vq = self._groups(k), self._groups(v)  # (B, H, S, dh) for the query heads
        if mode == "dense":  # every head full attention: the backbone itself
            fa = torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
            return ea.elastic_attention_dense_reference(q, kq, vq, fa, key_mask, self.sink, self.window, self.causal), {}
        if mode in SOFT_MODES:
            logits = self.route(k, key_mask)  # (B, Hkv, 2)
            g = _gumbel_hard(logits, tau or self.tau)[..., 1]  # (B, Hkv): 1 = SA, straight-through gradient
            sa = g > 0.5
            fa_o, sa_o = (ea.elastic_attention_dense_reference(q, kq, vq, self._groups(torch.full_like(sa, m)),
                                                               key_mask, self.sink, self.window, self.causal)
                          for m in (False, True))
            o = fa_o + (sa_o - fa_o) * self._groups(g)[:, :, None, None].to(q.dtype)
            self.record({"sa": sa, "logits": logits}, aux={"g": g})
            return o, {"sa": sa, "logits": logits, "g": g}
        if head_modes is None:
            logits = self.route(k, key_mask)  # (B, Hkv, 2)
            sa = _choice(logits)
        elif given_logits is not None and use_modes is None:
            logits, sa = given_logits, head_modes.bool()
        else:  # the given modes' logits are one-hot, so the choice read off the logits is theirs
            logits, sa = self._given_or_routed(k, key_mask, head_modes.bool(), use_modes)
        margin = None
        if not torch.compiler.is_exporting():
            gap = (logits[..., 1] - logits[..., 0]).abs().double()
            if head_modes is not None:  # an input: no flip of it is excusable
                margin = torch.full_like(gap, math.inf) if use_modes is None else \
                    torch.where(use_modes, torch.full_like(gap, math.inf), gap)
            else:
                margin = gap
        force_sa = force_sa if force_sa is not None else self.forced("sa")
        if force_sa is not None:
            sa = force_sa.bool()
        fn = ea.elastic_attention if mode in ("hard", "eager") else ea.elastic_attention_dense_reference
        o = fn(q, kq, vq, self._groups(sa), key_mask, self.sink, self.window, self.causal)
        self.record({"sa": sa, "logits": logits}, margins={"sa": margin} if margin is not None else None)
        return o, {"sa": sa, "logits": logits, "g": sa.float()}

    def attend_within_reach(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor,
                            bias: Tensor, far: Tensor | None = None) -> tuple[Tensor, dict]:
        """A prefill (empty cache) whose every key lies within each SA query's sinks and window
        (causal, at most sink + window keys): SA computes what FA does there, so every head attends
        as dense attention does, the scores plus `bias` (B, 1, T, S: the padding and causal mask,
        made once for every layer by the caller). far (B, 2, T, S): for a longer prefill, `bias` and
        `bias` plus NEG on the keys outside the sinks and window (those the op's masked body hides),
        which the SA heads add instead: a layer takes each head's plane by one Gather of whole (T, S)
        planes (0.94 to 0.97 of a Where between the two, whole artifact, T = 128;
        docs/benchmarking.md#short-calls). The router still decides: its decisions are outputs, and
        the decode steps after this call read them. Returns (o, decisions) as the hard
        op path does. The exporter's masked short-call program (ElasticDecoder.forward's program "masked")
        runs it; the plain one, whose output no decision changes, runs attend_biased and routes
        every layer at once after the last (route_layers). The op computes the same on such calls
        (tests/models/test_elastic_decoder.py, and the artifact's graphs against each other in
        tests/targets/test_decode_graph.py)."""
        if not self.causal:
            raise ValueError("attend_within_reach serves causal (decoder) calls")
        logits = self.route(k, key_mask.bool(), expand=False)
        sa = _choice(logits)
        if far is not None:  # sample b's plane 2 b for an FA head, 2 b + 1 for an SA head
            B, H, T, S = q.shape[0], q.shape[1], far.shape[2], far.shape[3]
            pick = torch.arange(B, device=q.device)[:, None] * 2 + self._groups(sa).long()  # (B, H)
            bias = far.reshape(B * 2, T, S)[pick]  # (B, H, T, S)
        return self.attend_biased(q, k, v, bias), self.routed(logits, sa)

    def attend_biased(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """Every head as dense attention, the scores plus `bias` (broadcast to (B, H, T, S))."""
        scores = (q * (q.shape[-1] ** -0.5)) @ self._groups(k).transpose(-1, -2) + bias
        return torch.softmax(scores, dim=-1) @ self._groups(v)

    def routed(self, logits: Tensor, sa: Tensor | None = None) -> dict:
        """The decisions of a hard routing by `logits` (B, Hkv, 2) (sa: their choice, where made
        already), recorded: {sa, logits, g}."""
        sa = _choice(logits) if sa is None else sa
        self.record({"sa": sa, "logits": logits})
        return {"sa": sa, "logits": logits, "g": sa.float()}


def route_layers(routers, ks: list[Tensor], key_mask: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Every layer's routing at once, each router (of one model: the same pooling and widths) on its
    layer's keys ks[i] (B, Hkv, S, dh), as HeadRouter.route and _choice make it one layer at a time:
    [(logits (B, Hkv, 2), sa (B, Hkv))] per layer. The keys are concatenated over the heads and
    pooled by one MatMul; each Linear is one MatMul of (L, B Hkv, in) rows against the layers'
    weights stacked (constants of a traced graph): one product of every sample's rows a layer, as a
    layer's own router runs it. For a call whose output no decision changes (a decoder's short-call
    program: graphs.elastic_decoder), so that the routers can run after the last layer: one chain
    for every layer where each layer ran its own."""
    first, L = routers[0], len(ks)
    B, H, _, dh = ks[0].shape
    plan = first.pool_plan(ks[0], key_mask)  # (B, 1, 2, S), the same for every router
    pooled = (plan @ torch.cat([k.float() for k in ks], 1)).reshape(B, L, H * 2 * dh)  # (B, L, H 2 dh)
    pooled = pooled.transpose(0, 1).reshape(L, B * H, 2 * dh)

    def linear(x: Tensor, layers) -> Tensor:  # (L, N, in) through each layer's own Linear
        w = torch.stack([m.weight for m in layers]).transpose(1, 2)  # (L, in, out)
        return x @ w + torch.stack([m.bias for m in layers])[:, None]  # + (L, 1, out)

    t, r = [m.task for m in routers], [m.router for m in routers]
    h = first.task[1](linear(pooled, [m[0] for m in t])).reshape(L, B, H, -1)
    h = (h + torch.stack([m.head_bias for m in routers])[:, None]).reshape(L, B * H, -1)
    logits = linear(first.router[1](linear(h, [m[0] for m in r])), [m[2] for m in r])  # (L, B Hkv, 2)
    logits = logits.reshape(L, B, H * 2).transpose(0, 1).reshape(B, L * H, 2)
    return list(zip(logits.split(H, dim=1), _choice(logits).split(H, dim=1)))


def given_mode_logits(modes: Tensor) -> Tensor:
    """(..., 2) fp32 one-hot [FA, SA] logits of given modes (..., ) bool: two kernels in a graph
    (Unsqueeze, Where; a Gather of the identity's rows is three, a stack of ~modes and modes five)."""
    eye = torch.eye(2, device=modes.device)  # an op, not a tensor constant: a torch.cond branch takes it
    return torch.where(modes[..., None], eye[1], eye[0])


def _choice(logits: Tensor) -> Tensor:
    """SA where its logit is the larger, [FA, SA] -> (B, H) bool (a tie is FA): two kernels in a
    graph (ArgMax, Equal), where comparing the two slices takes five."""
    return logits.argmax(-1) == 1


def _gumbel_hard(logits: Tensor, tau: float) -> Tensor:
    """A one-hot Gumbel-softmax sample over the last axis whose gradient is the relaxed sample's
    (straight-through). The Gumbel noise is drawn as F.gumbel_softmax draws it, through
    parallel.batch_noise: in data-parallel training a sample's noise is the same for any number of
    processes."""
    noise = batch_noise(tuple(logits.shape), lambda s: -torch.empty(s, dtype=logits.dtype,
                                                                    device=logits.device).exponential_().log())
    soft = ((logits + noise) / tau).softmax(-1)
    hard = torch.zeros_like(soft).scatter_(-1, soft.argmax(-1, keepdim=True), 1.0)
    return hard - soft.detach() + soft


def sparsity_per_row(decisions) -> Tensor:
    """Omega of each sample (B,): its fraction of SA heads over every ElasticAttention (soft)."""
    return torch.stack([d["g"].float().reshape(d["g"].shape[0], -1).mean(1) for d in decisions]).mean(0)


def sparsity(rec_or_decisions) -> Tensor:
    """Omega: the fraction of SA heads over every ElasticAttention (soft: the straight-through
    weights, so it has a gradient). Takes a Recorder or a family's list of decision dicts."""
    if isinstance(rec_or_decisions, Recorder):
        gs = [rec_or_decisions.aux[p].get("g", d["sa"].float()) for p, d in rec_or_decisions.decisions.items()
              if "sa" in d]
    else:
        gs = [d["g"] for d in rec_or_decisions]
    if not gs:
        raise ValueError("no ElasticAttention decisions were recorded; call the model inside record_decisions()")
    return torch.stack([g.float().mean() for g in gs]).mean()


