"""The ONNX lowerings of the adaptex ops, registered once for both `onnx` and `tensorrt`: each op
becomes one custom-domain node (`adaptex.<Op>`) whose body ships as a model-local function, which
ONNX Runtime inlines and TensorRT's parser inlines too (a plugin of the same name can override it).
A TensorRT-only body is a higher-priority entry in the tensorrt cell (conditional_attention's
CumSum partition), not a re-wrap."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx

from adaptex.exporter.registry import lowering
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy

BOTH = ("onnx", "tensorrt")


@dataclass(frozen=True)
class LoweringContext:
    """What a lowering may depend on besides the node itself."""
    target: str
    variant: str
    precision: str
    onnx_opset: int
    step: bool = False  # the decode-step program: every call one causal token after a non-empty cache
    decode_graph: bool = False  # the general program of an artifact whose decode steps run the step program
    by_sample: bool = True  # False: a program whose calls never reach attention by sample's threshold
    policy: OrtPolicy = DEFAULT  # ONNX Runtime's thresholds (graphs/ops/policy.py)


@dataclass
class OnnxLowering:
    """What an ONNX lowering hands the exporter: the translation that emits the node, and bodies."""
    translation: Callable
    functions: list[onnx.FunctionProto]


def _opset():
    from onnxscript.values import Opset

    return Opset(fx.DOMAIN, fx.OPSET_VERSION)


def budgeted_attention_node(x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o, num_heads: int):
    return _opset().BudgetedAttention(x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o, num_heads=num_heads)


def conditional_ffn_node(x, keep, gate, ln_w, ln_b, w1, b1, w2, b2, eps: float):
    return _opset().ConditionalFFN(x, keep, gate, ln_w, ln_b, w1, b1, w2, b2, eps=eps)


def conditional_attention_node(x, hn, keep, gate, k, v, bias, wq, bq, wo, bo, num_heads: int):
    return _opset().ConditionalAttention(x, hn, keep, gate, k, v, bias, wq, bq, wo, bo, num_heads=num_heads)


def elastic_attention_node(q, k, v, sa, key_mask, sink: int, window: int, causal: bool):
    return _opset().ElasticAttention(q, k, v, sa, key_mask, sink=sink, window=window, causal=int(causal))


def _pad_bias(op, key_mask):
    """fx._pad_bias in the graph, for a translation: 0 for a real key, NEG for a padded one, (B, 1, 1, S)."""
    return op.Unsqueeze(op.Where(key_mask, op.Constant(value_float=0.0), op.Constant(value_float=fx.NEG)),
                        op.Constant(value_ints=[1, 2]))


def elastic_step_node(q, k, v, sa, key_mask, sink: int, window: int, causal: bool):
    """A decode-step call (fx.elastic_step_function): what every layer's body reads alike, computed
    here in the graph from the key mask and the attributes (fx.STEP_SHARED), where the exporter's
    common-subexpression elimination keeps one copy for all the layers."""
    from onnxscript import opset20 as op

    ints = lambda *v: op.Constant(value_ints=list(v))  # noqa: E731
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    S1 = op.Shape(key_mask, start=1, end=2)
    ns1 = op.Min(S1, ints(sink))
    ws1 = op.Max(op.Sub(S1, ints(window)), ns1)  # the window starts after the sinks
    S, ns, ws = (op.Squeeze(t, ints(0)) for t in (S1, ns1, ws1))
    keys = op.Concat(op.Range(zero, ns, one), op.Range(ws, S, one), axis=0)  # (L,) sinks, then the window
    bias = _pad_bias(op, key_mask)  # (B, 1, 1, S)
    bias_sa = op.Gather(bias, keys, axis=3)  # (B, 1, 1, L)
    j = op.Range(zero, S, one)
    outside = op.Not(op.Or(op.Less(j, ns), op.GreaterOrEqual(j, ws)))  # (S,): keys an SA query does not read
    bias_far = op.Where(outside, op.Constant(value_float=fx.NEG), bias)  # (B, 1, 1, S): an SA pair's bias
    return _opset().ElasticAttention(q, k, v, sa, key_mask, keys, bias, bias_sa, bias_far, sink=sink,
                                     window=window, causal=int(causal))


def elastic_encoder_node_for(heads: int, policy: OrtPolicy = DEFAULT):
    """The translation of an encoder's calls (fx.elastic_attention_function with `heads`): what every
    layer's body reads alike (fx.ENCODER_SHARED), computed here in the graph from the key mask, the
    attributes and the head count, where the exporter's common-subexpression elimination keeps one
    copy for all the layers."""
    from onnxscript import opset20 as op

    def elastic_encoder_node(q, k, v, sa, key_mask, sink: int, window: int, causal: bool):
        ints = lambda *v: op.Constant(value_ints=list(v))  # noqa: E731
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        B1, S1 = op.Shape(key_mask, start=0, end=1), op.Shape(key_mask, start=1, end=2)
        B, S = op.Squeeze(B1, ints(0)), op.Squeeze(S1, ints(0))  # an encoder's queries are its keys: T = S
        half = op.Constant(value_int=window // 2)
        reach = op.Or(op.LessOrEqual(op.Sub(S, one), half), op.LessOrEqual(S, op.Constant(value_int=sink)))
        unpadded = op.Equal(op.ReduceMin(op.Cast(key_mask, to=onnx.TensorProto.INT32), keepdims=0),
                            op.Constant(value=onnx.helper.make_tensor("one", onnx.TensorProto.INT32, [], [1])))
        flat = op.Reshape(op.Expand(op.Unsqueeze(key_mask, ints(1)), op.Concat(B1, ints(heads), S1, axis=0)),
                          op.Concat(ints(-1), S1, axis=0))  # (B H, S)
        # a masked call's bias planes, (2 B, Tm, S): Tm = T where the body takes the masked path, else 0
        few = op.LessOrEqual(op.Mul(S, S), op.Constant(value_int=policy.mixed_call_masked_up_to // heads))
        if policy.mixed_call_masked_up_to > 0:  # also where masking adds few scores (call_runs_masked)
            beyond = op.Max(op.Sub(S, op.Constant(value_int=sink + 2 * window)), zero)  # keys past a row
            excess = op.Mul(op.Mul(B, op.Mul(op.Constant(value_int=heads), S)), beyond)
            few = op.Or(few, op.LessOrEqual(excess, op.Constant(value_int=policy.masked_excess_up_to)))
        Tm = op.Where(few, S, zero)
        a = op.Unsqueeze(op.Range(zero, Tm, one), ints(1))  # (Tm, 1) query positions
        j = op.Unsqueeze(op.Range(zero, S, one), ints(0))  # (1, S)
        within = op.LessOrEqual(op.Abs(op.Sub(j, a)), half)
        hide = op.Where(op.Not(op.Or(op.Less(j, op.Constant(value_int=sink)), within)),
                        op.Constant(value_float=fx.NEG), op.Constant(value_float=0.0))  # (Tm, S)
        pad = _pad_bias(op, key_mask)  # (B, 1, 1, S)
        fa_bias = op.Expand(pad, op.Concat(B1, ints(1), op.Unsqueeze(Tm, ints(0)), S1, axis=0))  # (B, 1, Tm, S)
        planes = op.Reshape(op.Concat(fa_bias, op.Add(fa_bias, hide), axis=1),
                            op.Concat(ints(-1), op.Unsqueeze(Tm, ints(0)), S1, axis=0))  # (2 B, Tm, S)
        first = op.Unsqueeze(op.Mul(op.Range(zero, B, one), op.Constant(value_int=2)), ints(1))  # (B, 1)
        return _opset().ElasticAttention(q, k, v, sa, key_mask, None, None, None, None, reach, unpadded, flat,
                                         planes, first, few, sink=sink, window=window, causal=int(causal))
    return elastic_encoder_node


def num_heads_of(node) -> int | None:
    """The node's num_heads (its last argument) when tracing left it a constant."""
    h = node.kwargs.get("num_heads", node.args[8] if len(node.args) > 8 else None) if node is not None else None
    return h if isinstance(h, int) else None


@lowering("adaptex::budgeted_attention", target=BOTH, variant="sparse")
def budgeted_attention_onnx_sparse(ctx, node):
    """TopK with a runtime K (the batch's largest k; TensorRT 8.6+ takes it, K <= H <= 3840), Gather
    of those heads' weight rows and output columns, attention on k heads only. At batch 1 exactly k
    heads run; in a batch, max_b k_b heads run and heads past a sample's own k get weight zero. On
    ONNX Runtime a batch whose k differ groups its samples by head instead (an If; the body is the
    function overload for the call's head count): sum_b k_b head-samples run."""
    grouped = num_heads_of(node) if ctx.target == "onnx" else None
    return OnnxLowering(budgeted_attention_node,
                        [fx.budgeted_attention_function("sparse", grouped_heads=grouped, policy=ctx.policy)])


@lowering("adaptex::budgeted_attention", target=BOTH, variant="dense")
def budgeted_attention_onnx_dense(ctx, node):
    """Every head projected and attended, unselected heads weighted by zero: static shapes."""
    return OnnxLowering(budgeted_attention_node, [fx.budgeted_attention_function("dense")])


@lowering("adaptex::conditional_ffn", target=BOTH, variant="sparse")
def conditional_ffn_onnx_sparse(ctx, node):
    """NonZero over the keep mask (a data-dependent shape, internal to a TensorRT engine), Gather of
    the kept tokens, LayerNorm + FFN (two MatMuls) on them only, ScatterND back without a reduction
    attribute (TensorRT <= 10.8 refuses even 'none'): skipped tokens cost nothing. The same body on
    ONNX Runtime: If nodes on the kept count cost more than the gather they skipped."""
    return OnnxLowering(conditional_ffn_node, [fx.conditional_ffn_function("sparse")])


@lowering("adaptex::conditional_ffn", target=BOTH, variant="dense")
def conditional_ffn_onnx_dense(ctx, node):
    """Every token through the FFN, the update multiplied by keep * gate: static shapes."""
    return OnnxLowering(conditional_ffn_node, [fx.conditional_ffn_function("dense")])


@lowering("adaptex::conditional_attention", target=BOTH, variant="sparse")
def conditional_attention_onnx_sparse(ctx, node):
    """TopK over the keep mask (K = the batch's largest kept count), Gather of those query rows, Q
    projection, scores, Softmax, AV and output projection on them only, ScatterND back: a skipped
    token's query side costs nothing (its keys and values are computed outside the op). On ONNX
    Runtime, If nodes on the kept count skip the query side when no token is kept and drop the
    gather when all are."""
    return OnnxLowering(conditional_attention_node,
                        [fx.conditional_attention_function("sparse", dispatch=ctx.target == "onnx",
                                                           by_sample=ctx.by_sample, policy=ctx.policy)])


@lowering("adaptex::conditional_attention", target="tensorrt", variant="sparse", priority=10)
def conditional_attention_tensorrt_sparse(ctx, node):
    """The kept positions first by a CumSum partition sliced at the batch's largest kept count (no
    TopK: its runtime K would run over the sequence axis, unbounded by TensorRT's 3840), Gather of the
    kept query rows, attention on them only, ScatterND without a reduction attribute."""
    return OnnxLowering(conditional_attention_node, [fx.conditional_attention_function("sparse", partition="cumsum")])


@lowering("adaptex::conditional_attention", target=BOTH, variant="dense")
def conditional_attention_onnx_dense(ctx, node):
    """Every query row attended, the update multiplied by keep * gate: static shapes."""
    return OnnxLowering(conditional_attention_node, [fx.conditional_attention_function("dense")])


def _query_dim(node, axis: int) -> int | None:
    """One axis of the node's queries (its first argument, (B, H, T, dh)) when tracing fixed it."""
    val = node.args[0].meta.get("val") if node is not None and node.args else None
    d = val.shape[axis] if val is not None and val.dim() == 4 else None
    return int(d) if isinstance(d, int) else None


def head_dim_of(node) -> int | None:
    """The per-head width of the node's queries when tracing fixed it."""
    return _query_dim(node, 3)


def heads_of(node) -> int | None:
    """The head count of the node's queries when tracing fixed it."""
    return _query_dim(node, 1)


def causal_flag(node) -> bool | None:
    """The node's causal flag when tracing left it a constant (an encoder's False), else None."""
    c = node.kwargs.get("causal", node.args[7] if node is not None and len(node.args) > 7 else None) \
        if node is not None else None
    return c if isinstance(c, bool) else None


@lowering("adaptex::elastic_attention", target=BOTH, variant="sparse")
def elastic_attention_onnx_sparse(ctx, node):
    """The (B*H) head pairs split by mode (NonZero over sa): FA pairs attend every visible key, SA
    pairs block-local (each block of min(window, T) queries against its own run of keys, plus the
    sinks: O(T (sink + window))); ScatterND puts both groups back. In a decode-step program (ONNX
    Runtime) the step's own body: an SA pair reads its sinks and window, a FA pair every key."""
    if ctx.step and ctx.target == "onnx":
        return OnnxLowering(elastic_step_node, [fx.elastic_step_function(head_dim_of(node), policy=ctx.policy)])
    ort = ctx.target == "onnx"
    causal = causal_flag(node)
    heads = heads_of(node) if ort and causal is False else None  # an encoder's layers share what they derive alike
    return OnnxLowering(elastic_encoder_node_for(heads, ctx.policy) if heads else elastic_attention_node,
                        [fx.elastic_attention_function("sparse", causal, dispatch=ort,
                                                       decode_step=ort and not ctx.decode_graph, fused=ort,
                                                       head_dim=head_dim_of(node), by_sample=ctx.by_sample,
                                                       heads=heads, policy=ctx.policy)])


@lowering("adaptex::elastic_attention", target=BOTH, variant="dense")
def elastic_attention_onnx_dense(ctx, node):
    """Every head over the full score matrix, SA heads through a band mask: static shapes."""
    return OnnxLowering(elastic_attention_node, [fx.elastic_attention_function("dense")])
