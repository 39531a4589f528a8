"""ONNX function bodies of the adaptex ops (model-local functions, ONNX opset 20).

Each op becomes one custom-domain node (`adaptex.BudgetedAttention`) whose body ships in
`model.functions`; ONNX Runtime and TensorRT's parser inline it. Bodies are written node by node so
every op in them is a standard one a reader can check against the spec in docs/ops.md, with one
exception: ONNX Runtime's encoder body of ElasticAttention calls that runtime's own fused attention
kernel (com.microsoft.MultiHeadAttention), which TensorRT-bound bodies never do.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from adaptex.graphs.ops.budgeted_attention import ACTIVE_HEADS_WASTE_ROWS, group_ratio
from adaptex.graphs.ops.conditional_attention import BY_SAMPLE_FROM, DENSE_QUERY_SHARE
from adaptex.graphs.ops.elastic_attention import MASKED_EXCESS_UP_TO, MIXED_CALL_MASKED_UP_TO

DOMAIN = "adaptex"
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops: ONNX Runtime bodies only (never TensorRT-bound)
OPSET_VERSION = 1  # version of the adaptex op set
ONNX_OPSET = 20


def _private(f: onnx.FunctionProto) -> onnx.FunctionProto:
    """Prefix the body's formal inputs and outputs with its name ("BudgetedAttention.x"): before 10.8
    TensorRT's parser bound a function input whose name matched an outer tensor to that tensor, and a
    model's own input may well be called x. Internal values already carry a per-body prefix."""
    rename = {n: f"{f.name}.{n}" for n in list(f.input) + list(f.output)}
    for seq in (f.input, f.output):
        seq[:] = [rename[n] for n in seq]

    def walk(nodes) -> None:  # If branches read the formal inputs too
        for node in nodes:
            node.input[:] = [rename.get(n, n) for n in node.input]
            node.output[:] = [rename.get(n, n) for n in node.output]
            for a in node.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(g.node)
    walk(f.node)
    return f


class _Body:
    """Accumulates the nodes of one function body; each call adds a node and returns its output(s)."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes, self.n = prefix, [], 0

    def __call__(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        self.n += 1
        names = [f"{self.prefix}{op_type}_{self.n}" + (f"_{i}" if outputs > 1 else "") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value, dtype=np.int64) -> str:
        arr = np.array(value, dtype=dtype)
        return self("Constant", value=numpy_helper.from_array(arr))

    def if_(self, cond: str, then_fn, else_fn, elem_type: int = TensorProto.FLOAT) -> str:
        """An If node on the scalar bool `cond`: each branch's nodes are what its function adds (it
        returns the branch's result, which may be an outer value). Branches read outer values by
        name, so only the taken one runs: this is how a lowering skips work at run time."""
        branches = []
        for tag, fn in (("then", then_fn), ("else", else_fn)):
            saved, self.nodes = self.nodes, []
            result = fn()
            if not any(result in n.output for n in self.nodes):  # an outer value: a branch output must be
                result = self("Identity", result)  # produced inside the branch (an Identity copies, so only then)
            branches.append(helper.make_graph(self.nodes, f"{self.prefix}{tag}_{self.n}", [],
                                              [helper.make_tensor_value_info(result, elem_type, None)]))
            self.nodes = saved
        return self("If", cond, then_branch=branches[0], else_branch=branches[1])

    def loop_(self, trips: str, body_fn, elem_type: int = TensorProto.FLOAT) -> str:
        """A Loop node run `trips` (int64 scalar) times, with no carried value: body_fn(i) adds the
        nodes of one iteration (i: the iteration's int64 scalar) and returns the value it contributes,
        all of one shape; the Loop stacks them along a new first axis."""
        self.n += 1
        i, c = f"{self.prefix}iter_{self.n}", f"{self.prefix}cond_{self.n}"
        saved, self.nodes = self.nodes, []
        result = body_fn(i)
        c_out = self("Identity", c)
        body = helper.make_graph(self.nodes, f"{self.prefix}loop_{self.n}",
                                 [helper.make_tensor_value_info(i, TensorProto.INT64, []),
                                  helper.make_tensor_value_info(c, TensorProto.BOOL, [])],
                                 [helper.make_tensor_value_info(c_out, TensorProto.BOOL, []),
                                  helper.make_tensor_value_info(result, elem_type, None)])
        self.nodes = saved
        # an explicit true condition, not an empty input: rewriting tools drop a trailing empty input,
        # and a Loop needs two
        return self("Loop", trips, self.const(True, np.bool_), body=body)

    def attr_int(self, attr: str) -> str:
        """A scalar int64 tensor holding the function's attribute `attr` (resolved at the call site)."""
        self.n += 1
        name = f"{self.prefix}{attr}_{self.n}"
        node = helper.make_node("Constant", [], [name])
        a = onnx.AttributeProto(name="value_int", ref_attr_name=attr, type=onnx.AttributeProto.INT)
        node.attribute.append(a)
        self.nodes.append(node)
        return name


def _name_output(b: _Body, value: str, name: str) -> None:
    """Make the body's last node, which computes `value`, write the function output `name`."""
    last = b.nodes[-1]
    assert value in last.output, (value, last.output)
    last.output[list(last.output).index(value)] = name


def _routing(b: _Body, s: str, p: str, full_order: bool):
    """k = clamp(floor(s*H), 1, H) and the top-k order of p. fp32 throughout: a decision computed in
    lower precision could land on the other side of an integer or swap a near-tie."""
    H = b.attr_int("num_heads")  # int64 scalar
    H1 = b("Unsqueeze", H, b.const([0]))  # (1,)
    Hf = b("Cast", H, to=TensorProto.FLOAT)
    sH = b("Mul", s, Hf)  # (B,)
    kf = b("Clip", b("Floor", sH), b.const(1.0, np.float32), Hf)
    k = b("Cast", kf, to=TensorProto.INT64)  # (B,)
    K = H1 if full_order else b("ReduceMax", k, keepdims=1)  # (1,) heads to rank
    topv, order = b("TopK", p, K, axis=-1, largest=1, sorted=1, outputs=2)  # (B, K); ties -> lower index
    j = b("Range", b.const(0), b("Squeeze", K), b.const(1))  # (K,)
    valid = b("Less", b("Unsqueeze", j, b.const([0])), b("Unsqueeze", k, b.const([1])))  # (B, K)
    valid_f = b("Cast", valid, to=TensorProto.FLOAT)
    zeros = b("Mul", p, b.const(0.0, np.float32))  # (B, H)
    mask_f = b("ScatterElements", zeros, order, valid_f, axis=1)  # (B, H)
    return H1, sH, k, topv, order, valid_f, mask_f


def _head_weights(b: _Body, sH: str, p: str, mask_f: str) -> str:
    """w_h = s*H*p_h on a sample's selected heads, 0 on the others: (B, H)."""
    return b("Mul", b("Mul", b("Unsqueeze", sH, b.const([1])), p), mask_f)


def _key_bias(b: _Body, key_mask: str) -> str:
    """0 on a real key, -inf on a padded one: (B, T)."""
    return b("Where", key_mask, b.const(0.0, np.float32), b.const(-np.inf, np.float32))


def _score_scale(b: _Body, dh1: str) -> str:
    """1 / sqrt(dh) from the (1,) head width: (1,)."""
    return b("Reciprocal", b("Sqrt", b("Cast", dh1, to=TensorProto.FLOAT)))


def _attend(b: _Body, q: str, kk: str, v: str, key_mask: str) -> str:
    """Scaled dot-product attention over (B, K, T, dh) with padded keys ignored."""
    dh = b("Cast", b("Shape", q, start=-1), to=TensorProto.FLOAT)  # (1,)
    q = b("Mul", q, b("Reciprocal", b("Sqrt", dh)))
    scores = b("MatMul", q, b("Transpose", kk, perm=[0, 1, 3, 2]))  # (B, K, T, T)
    bias = _key_bias(b, key_mask)  # (B, T)
    bias = b("Unsqueeze", bias, b.const([1, 2]))  # (B, 1, 1, T)
    attn = b("Softmax", b("Add", scores, bias), axis=-1)
    return b("MatMul", attn, v)  # (B, K, T, dh)


def _split3(b: _Body, qkv: str):
    parts = b("Split", qkv, axis=0, num_outputs=3, outputs=3)  # each (1, B, K, T, dh)
    return [b("Squeeze", t, b.const([0])) for t in parts]


INPUTS = ["x", "key_mask", "s", "p", "w_qkv", "b_qkv", "w_o", "b_o"]
OUTPUTS = ["y", "k", "head_mask"]


def budgeted_attention_function(variant: str, grouped_heads: int | None = None) -> onnx.FunctionProto:
    """The body of adaptex.BudgetedAttention for `variant` ("sparse" or "dense").

    sparse: TopK with the batch's largest k as K, the selected heads' weights gathered per sample,
    attention on K heads for every sample (heads past a sample's own k weighted by zero). With
    `grouped_heads` = H (ONNX Runtime; the body then serves calls with H heads only and ships as the
    function overload `heads{H}`), If branches choose one of three bodies by the batch's decisions
    (graphs/ops/budgeted_attention.py, onnx_body, states the rule):
    - active heads: every sample through each head some sample selected, the A heads' weights
      gathered once, their projections one batched MatMul over the batch's B x T rows, (A, B, T, T)
      scores, one output projection summing the heads (unselected pairs weighted by zero), for a
      batch of more than one sample where that wastes at most ACTIVE_HEADS_WASTE_ROWS token rows;
    - by head: a batch whose k differ (mean k < GROUP_BELOW x the largest), for each of the H heads
      the samples that selected it gathered and run through that head's own weights, so the batch
      computes sum_b k_b head-samples rather than B x max_b k_b, and every projection reads a
      constant weight slice (ONNX Runtime pre-packs those; the per-sample gathered weights above run
      at about half the rate);
    - per sample (above), otherwise."""
    b = _Body("ba_")
    x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o = INPUTS
    H1, sH, k, topv, order, valid_f, mask_f = _routing(b, s, p, full_order=(variant == "dense"))
    d1 = b("Shape", w_o, start=0, end=1)  # (1,) = [d]
    c3, c1, cm1, c0 = b.const([3]), b.const([1]), b.const([-1]), b.const([0])
    if variant == "sparse":
        dh1 = b("Div", d1, H1)  # (1,) = [dh]
        # Head-major weights (folded to constants in ONNX Runtime, outside any If): each head's Q, K
        # and V come out of one MatMul already in attention layout (no transposes of activations).
        w_h = b("Transpose", w_qkv, perm=[1, 0])  # (d, 3d)
        w_h = b("Reshape", w_h, b("Concat", d1, c3, H1, dh1, axis=0))  # (d, 3, H, dh)
        w_h = b("Transpose", w_h, perm=[2, 0, 1, 3])  # (H, d, 3, dh)
        w_h = b("Reshape", w_h, b("Concat", H1, d1, cm1, axis=0))  # (H, d, 3*dh)
        b_h = b("Transpose", b("Reshape", b_qkv, b("Concat", c3, H1, dh1, axis=0)), perm=[1, 0, 2])  # (H, 3, dh)
        b_h = b("Reshape", b_h, b("Concat", H1, c1, cm1, axis=0))  # (H, 1, 3*dh)
        wo_h = b("Reshape", b("Transpose", w_o, perm=[1, 0]), b("Concat", H1, cm1, d1, axis=0))  # (H, dh, d)

        def per_sample() -> str:  # the selected heads' weights gathered per sample, K = max_b k_b heads each
            wg = b("Gather", w_h, order, axis=0)  # (B, K, d, 3*dh)
            bg = b("Gather", b_h, order, axis=0)  # (B, K, 1, 3*dh)
            qkv = b("Add", b("MatMul", b("Unsqueeze", x, b.const([1])), wg), bg)  # (B, K, T, 3*dh)
            weights = b("Mul", b("Mul", topv, b("Unsqueeze", sH, b.const([1]))), valid_f)  # (B, K)
            q, kk, v = b("Split", qkv, axis=-1, num_outputs=3, outputs=3)  # (B, K, T, dh) each
            o = b("Mul", _attend(b, q, kk, v, key_mask), b("Unsqueeze", weights, b.const([2, 3])))
            o = b("Reshape", b("Transpose", o, perm=[0, 2, 1, 3]), b.const([0, 0, -1]))  # (B, T, K*dh)
            wo = b("Reshape", b("Gather", wo_h, order, axis=0), b("Concat", c0, cm1, d1, axis=0))  # (B, K*dh, d)
            return b("Add", b("MatMul", o, wo), b_o)  # (B, T, d)

        if grouped_heads is None:
            y = per_sample()
        else:
            def by_head() -> str:  # each head on the samples that selected it: sum_b k_b head-samples
                wts = _head_weights(b, sH, p, mask_f)  # (B, H)
                chosen = b("Greater", mask_f, b.const(0.0, np.float32))  # (B, H)
                scale = _score_scale(b, dh1)  # (1,)
                bias = _key_bias(b, key_mask)  # (B, T)
                bias = b("Unsqueeze", bias, b.const([1]))  # (B, 1, T)
                y = b("Add", b("Mul", x, b.const(0.0, np.float32)), b_o)  # (B, T, d)
                for h in range(grouped_heads):  # an empty group runs its nodes on zero rows
                    hc = b.const(h)
                    rows = b("Squeeze", b("NonZero", b("Gather", chosen, hc, axis=1)), b.const([0]))  # (n,)
                    qkv = b("Add", b("MatMul", b("Gather", x, rows, axis=0), b("Gather", w_h, hc, axis=0)),
                            b("Gather", b_h, hc, axis=0))  # (n, T, 3*dh): a constant weight slice
                    q, kk, v = b("Split", qkv, axis=-1, num_outputs=3, outputs=3)  # (n, T, dh) each
                    scores = b("MatMul", b("Mul", q, scale), b("Transpose", kk, perm=[0, 2, 1]))  # (n, T, T)
                    attn = b("Softmax", b("Add", scores, b("Gather", bias, rows, axis=0)), axis=-1)
                    w = b("Unsqueeze", b("Gather", b("Gather", wts, hc, axis=1), rows, axis=0), b.const([1, 2]))
                    u = b("MatMul", b("Mul", b("MatMul", attn, v), w), b("Gather", wo_h, hc, axis=0))  # (n, T, d)
                    # one scatter a head, whose indices never repeat: ONNX Runtime 1.32's ScatterND with
                    # reduction="add" races on repeated indices at 2 threads or more (docs/benchmarking.md)
                    y = b("ScatterND", y, b("Unsqueeze", rows, b.const([1])), u, reduction="add")
                return y

            def by_active_heads(active: str) -> str:  # each sample on every head some sample selected: B x A pairs
                wts = _head_weights(b, sH, p, mask_f)  # (B, H), 0 unselected
                heads = b("Squeeze", b("NonZero", active), b.const([0]))  # (A,)
                rows = b("Reshape", x, b("Concat", c1, cm1, d1, axis=0))  # (1, B*T, d)
                qkv = b("Add", b("MatMul", rows, b("Gather", w_h, heads, axis=0)),
                        b("Gather", b_h, heads, axis=0))  # (A, B*T, 3*dh): each head over every row
                qkv = b("Reshape", qkv, b("Concat", c0, b("Shape", x, start=0, end=2), cm1, axis=0))  # (A, B, T, 3*dh)
                q, kk, v = b("Split", qkv, axis=-1, num_outputs=3, outputs=3)  # (A, B, T, dh) each
                scale = _score_scale(b, dh1)  # (1,)
                scores = b("MatMul", b("Mul", q, scale), b("Transpose", kk, perm=[0, 1, 3, 2]))  # (A, B, T, T)
                bias = _key_bias(b, key_mask)  # (B, T)
                attn = b("Softmax", b("Add", scores, b("Unsqueeze", bias, b.const([1]))), axis=-1)
                w = b("Unsqueeze", b("Transpose", b("Gather", wts, heads, axis=1), perm=[1, 0]), b.const([2, 3]))
                o = b("Transpose", b("Mul", b("MatMul", attn, v), w), perm=[1, 2, 0, 3])  # (B, T, A, dh)
                o = b("Reshape", o, b("Concat", c0, c0, cm1, axis=0))  # (B, T, A*dh)
                wo = b("Reshape", b("Gather", wo_h, heads, axis=0), b("Concat", cm1, d1, axis=0))  # (A*dh, d)
                return b("Add", b("MatMul", o, wo), b_o)  # (B, T, d): the heads summed by the product

            def choose() -> str:  # a batch of more than one sample: one of the three bodies
                # by head where sum_b k_b < GROUP_BELOW * B * max_b k_b, in integers (num/den = GROUP_BELOW)
                num, den = group_ratio()
                padded = b("Mul", B0, b("ReduceMax", k, keepdims=0))  # () B * max k
                used = b("ReduceSum", k, keepdims=0)  # () sum k
                group = b("Less", b("Mul", used, b.const(den)), b("Mul", padded, b.const(num)))
                # the active heads where (B x A - sum_b k_b) x T <= ACTIVE_HEADS_WASTE_ROWS
                active = b("Greater", b("ReduceMax", mask_f, c0, keepdims=0), b.const(0.0, np.float32))  # (H,)
                n_active = b("ReduceSum", b("Cast", active, to=TensorProto.INT64), keepdims=0)  # () A
                waste = b("Mul", b("Sub", b("Mul", B0, n_active), used),
                          b("Squeeze", b("Shape", x, start=1, end=2), c0))  # () token rows of unselected pairs
                return b.if_(b("LessOrEqual", waste, b.const(ACTIVE_HEADS_WASTE_ROWS)), lambda: by_active_heads(active),
                             lambda: b.if_(group, by_head, per_sample))
            # one sample runs its own k heads (per_sample) without computing the others' conditions
            B0 = b("Squeeze", b("Shape", x, start=0, end=1), c0)  # () B
            y = b.if_(b("Greater", B0, b.const(1)), choose, per_sample)
    else:
        # Static shapes: every head projected and attended, unselected heads weighted by zero.
        qkv = b("Add", b("MatMul", x, b("Transpose", w_qkv, perm=[1, 0])), b_qkv)  # (B, T, 3d)
        qkv = b("Reshape", qkv, b("Concat", c0, c0, c3, H1, cm1, axis=0))  # (B, T, 3, H, dh)
        qkv = b("Transpose", qkv, perm=[2, 0, 3, 1, 4])  # (3, B, H, T, dh)
        weights = _head_weights(b, sH, p, mask_f)  # (B, H)
        q, kk, v = _split3(b, qkv)
        o = b("Mul", _attend(b, q, kk, v, key_mask), b("Unsqueeze", weights, b.const([2, 3])))  # (B, H, T, dh)
        o = b("Reshape", b("Transpose", o, perm=[0, 2, 1, 3]), b.const([0, 0, -1]))  # (B, T, H*dh)
        y = b("Add", b("MatMul", o, b("Transpose", w_o, perm=[1, 0])), b_o)  # (B, T, d)
    # bind the declared outputs
    b.nodes.append(helper.make_node("Identity", [y], ["y"]))
    b.nodes.append(helper.make_node("Identity", [k], ["k"]))
    b.nodes.append(helper.make_node("Cast", [mask_f], ["head_mask"], to=TensorProto.BOOL))
    f = _private(helper.make_function(
        DOMAIN, "BudgetedAttention", INPUTS, OUTPUTS, b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["num_heads"],
        doc_string=f"adaptex::budgeted_attention, {variant} lowering"
                   f"{f', grouped by head for {grouped_heads} heads' if grouped_heads else ''} (see docs/ops.md)",
    ))
    if grouped_heads is not None:
        f.overload = f"heads{grouped_heads}"
    return f


def _dispatch(b: _Body, keep: str, every, unchanged: str, some, prepare, share: float) -> str:
    """Run-time dispatch on the keep mask (ONNX Runtime): a call where some sample keeps at least
    `share` of its tokens (every token kept included: a decode step's kept block) runs `every()`
    (every row, the update masked: where gathering the kept rows costs more than computing the
    rest), one If deep; none kept returns `unchanged` (a decode step's skipped block) and a smaller
    mix runs `some()` (the gathered rows), both two Ifs deep. Each If a call passes through costs
    ONNX Runtime about 13 us at tsa-charlm's B1, T = 128, so the common prefill path goes through two
    (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts).

    ONNX Runtime (1.32, CPU) pre-packs a MatMul's constant weights when they are initializers of the
    graph the MatMul is in or of its parent, not of a graph further out (measured: ten 32x128x128
    MatMuls, 107 us one If deep, 129 us two deep, the same as with the weights fed as inputs). So
    `prepare()` runs in the branch that holds the mixed case and makes there the copies of the
    weights that `some()` reads (transposes of initializers, which fold to initializers of that
    branch at load): its MatMuls stay pre-packed, and a decode step keeps its single If.

    The condition is the largest of the samples' kept shares, reduced from the float mask: the
    fewest kernels a step runs before its If."""
    largest = b("ReduceMax", b("ReduceMean", b("Cast", keep, to=TensorProto.FLOAT), b.const([1]), keepdims=0),
                keepdims=0)

    def mixed() -> str:
        prepare()
        return some()

    def not_most() -> str:
        return b.if_(b("Equal", largest, b.const(0.0, np.float32)), lambda: unchanged, mixed)
    return b.if_(b("GreaterOrEqual", largest, b.const(share, np.float32)), every, not_most)


def _masked_gate(b: _Body, gate: str, keep: str) -> str:
    """keep * gate, (B, T), as one Where: the same values as Mul by the cast mask, one kernel fewer.
    A layer's attention and FFN bodies both make it; in a main graph ONNX Runtime merges the two, in
    the dense-dispatch branch the export does (passes.shared_subexpressions), and drops it there
    where the gate is already masked by the same keep, as TSA's router makes it (passes.masks_once)."""
    return b("Where", keep, gate, b.const(0.0, np.float32))


def _as_x(b: _Body, y: str, x: str) -> str:
    """y (the (B*T, d) rows, or already (B, T, d)) in x's shape. After a dispatch If, not inside its
    branch: an ONNX Runtime If copies a branch output that is a view of another value (a Reshape),
    where it hands a computed one (the ScatterND) out as it is. In a toy chain of ten Ifs over
    (1, T, 128), 8.8 us an If at T = 512 against 0.6
    (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts)."""
    return b("Reshape", y, b("Shape", x))


CFFN_INPUTS = ["x", "keep", "gate", "ln_w", "ln_b", "w1", "b1", "w2", "b2"]


def conditional_ffn_function(variant: str) -> onnx.FunctionProto:
    """The body of adaptex.ConditionalFFN: y = x + keep * gate * FFN(LayerNorm(x)).

    sparse: NonZero over the flattened keep mask, Gather of the kept tokens, LayerNormalization and
    two MatMuls on them only (none where no token is kept: the kernels run on zero rows), ScatterND
    (no reduction) of the updated rows back. dense: every token transformed, the update multiplied
    by keep * gate (static shapes). Every target takes the same sparse body: an If on the keep mask
    (nothing where none is kept, every row as it is where all are) cost ONNX Runtime more than it
    saved (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts)."""
    b = _Body("cf_")
    x, keep, gate, ln_w, ln_b, w1, b1, w2, b2 = CFFN_INPUTS
    # (in, out) weights: they fold to initializers at load, and MatMul + Add is the pattern ONNX
    # Runtime's fusions know (MatMul+Add, bias+Gelu)
    W = {"w1": b("Transpose", w1, perm=[1, 0]), "w2": b("Transpose", w2, perm=[1, 0])}

    def ffn(h_in: str) -> str:  # (..., d) -> (..., d)
        node = helper.make_node("LayerNormalization", [h_in, ln_w, ln_b], [f"cf_ln_{b.n + 1}"], axis=-1)
        # epsilon is the function's attribute `eps`, resolved at the call site
        node.attribute.append(onnx.AttributeProto(name="epsilon", ref_attr_name="eps", type=onnx.AttributeProto.FLOAT))
        b.n += 1
        b.nodes.append(node)
        u = b("Gelu", b("Add", b("MatMul", node.output[0], W["w1"]), b1))  # (..., f)
        return b("Add", b("MatMul", u, W["w2"]), b2)  # (..., d)

    def some() -> str:  # the kept rows only, as the (B*T, d) rows
        flat = b("Reshape", x, b("Concat", b.const([-1]), b("Shape", ln_w), axis=0))  # (B*T, d); folds at load
        gate_flat, kflat = b("Reshape", gate, b.const([-1])), b("Reshape", keep, b.const([-1]))
        # the kept rows as (1, K, d), not (K, d): on a 2-D input ONNX Runtime fuses MatMul + bias Add
        # into a Gemm, which leaves the Gelu unfused and runs slower than MatMul + BiasGelu, the
        # kernels the dense graph's FFN gets (docs/benchmarking.md#graph-level-findings-that-shape-the-artifacts)
        idx = b("NonZero", kflat)  # (1, K) int64: kept token rows
        xs = b("Gather", flat, idx, axis=0)  # (1, K, d)
        g = b("Unsqueeze", b("Gather", gate_flat, idx, axis=0), b.const([2]))  # (1, K, 1)
        new = b("Add", xs, b("Mul", ffn(xs), g))  # (1, K, d)
        return b("ScatterND", flat, b("Unsqueeze", idx, b.const([2])), new)  # (B*T, d); indices (1, K, 1)

    if variant == "dense":  # on x as it is: no reshape to rows, LayerNorm and MatMuls take (B, T, d)
        y = b("Add", x, b("Mul", ffn(x), b("Unsqueeze", _masked_gate(b, gate, keep), b.const([2]))))  # (B, T, d)
    else:
        y = _as_x(b, some(), x)
    _name_output(b, y, "y")
    return _private(helper.make_function(
        DOMAIN, "ConditionalFFN", CFFN_INPUTS, ["y"], b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["eps"],
        doc_string=f"adaptex::conditional_ffn, {variant} lowering (see docs/ops.md)",
    ))


def _attention(b: _Body, q: str, k: str, v: str, bias: str) -> str:
    """softmax(q k^T + bias) v over (B, H, n, dh) queries and (B, H, S, dh) keys and values."""
    scores = b("MatMul", q, b("Transpose", k, perm=[0, 1, 3, 2]))  # (B, H, n, S)
    return b("MatMul", b("Softmax", b("Add", scores, bias), axis=-1), v)  # (B, H, n, dh)


def large_batch(b: _Body, q: str, k: str, key_axis: int = 2) -> str:
    """True where attention of q (B, ..., n, dh) over keys k should run by sample (BY_SAMPLE_FROM);
    k's axis key_axis holds the S keys."""
    qs = b("Shape", q)
    B = b("Slice", qs, b.const([0]), b.const([1]))  # (1,)
    scores = b("Mul", b("ReduceProd", b("Slice", qs, b.const([0]), b.const([-1])), keepdims=1),
               b("Shape", k, start=key_axis, end=key_axis + 1))  # (1,): B ... n S
    return b("Squeeze", b("And", b("Greater", B, b.const([1])), b("GreaterOrEqual", scores, b.const([BY_SAMPLE_FROM]))),
             b.const([0]))


def _by_sample(b: _Body, q: str, k: str, v: str, batched, attend_one, counts: str | None = None,
               n1: str | None = None, key_axis: int = 2) -> str:
    """Attention of q (B, ..., n, dh) over k, v: batched() for the whole batch or, for a large call
    (BY_SAMPLE_FROM), a sample at a time in a Loop: attend_one(qi, ki, vi, i1, j1, c) for sample i's
    slices (i1 = [i], j1 = [i + 1]). With counts (B,), q is (B, H, n, dh) and sample i attends its
    first c = counts[i] query rows only, its rows after them zero (n1: n as a (1,) tensor)."""
    c0, c1 = b.const([0]), b.const([1])

    def one(i: str) -> str:  # sample i, its leading axis dropped
        i1 = b("Unsqueeze", i, c0)  # (1,)
        j1 = b("Add", i1, c1)
        if counts is None:
            qi, c = b("Slice", q, i1, j1, c0), None
        else:
            c = b("Gather", counts, i1, axis=0)  # (1,)
            qi = b("Slice", q, b("Concat", i1, c0, axis=0), b("Concat", j1, c, axis=0), b.const([0, 2]))  # (1, H, c, dh)
        o = attend_one(qi, b("Slice", k, i1, j1, c0), b("Slice", v, i1, j1, c0), i1, j1, c)
        if counts is not None:  # zero rows after the sample's own: every sample hands back (1, H, n, dh)
            o = b("Pad", o, b("Concat", b.const([0, 0, 0, 0, 0, 0]), b("Sub", n1, c), c0, axis=0))
        return b("Squeeze", o, c0)
    return b.if_(large_batch(b, q, k, key_axis), lambda: b.loop_(b("Squeeze", b("Shape", q, start=0, end=1), c0), one),
                 batched)


CA_INPUTS = ["x", "hn", "keep", "gate", "k", "v", "bias", "wq", "bq", "wo", "bo"]


def conditional_attention_function(variant: str, partition: str = "topk", dispatch: bool = False,
                                   by_sample: bool = True) -> onnx.FunctionProto:
    """The body of adaptex.ConditionalAttention: y = x + keep * gate * Attn(q(hn) over k, v + bias).

    sparse: per batch row the kept positions first, n = max(1, the batch's largest kept count) of
    them: `partition` "topk" takes a TopK over the keep mask with K = n (ONNX Runtime), "cumsum" a
    stable partition from CumSum slots scattered into a permutation and sliced to n (TensorRT,
    whose TopK wants K bounded over an axis of known size). Gather of those rows of hn, bias, gate
    and x; Q projection, scores, Softmax, AV and output projection on them only; ScatterND (no
    reduction; the rows are distinct) of the updated rows back. Rows past a sample's own count are
    not kept: their gate is zero and they are written back unchanged. n >= 1 keeps every tensor
    non-empty (a decode step whose token skips attends one ungated row). dense: every query row
    attended, the update multiplied by keep * gate (static shapes). dispatch (ONNX Runtime): If
    nodes on the keep mask pick nothing, every row, or the gathered rows at run time, and a mix
    whose largest kept count is at least DENSE_QUERY_SHARE of T every row, masked (see _dispatch);
    a large batch attends a sample at a time, each sample its own kept rows (_by_sample), unless
    by_sample is False (the body of a program whose calls never reach that threshold: the If and
    its size check cost a B1 call at T = 128 about 5%, docs/benchmarking.md#large-calls)."""
    if partition not in ("topk", "cumsum"):
        raise ValueError(f"unknown partition {partition!r}")
    by_sample = dispatch and by_sample  # the by-sample If: ONNX Runtime's bodies only
    b = _Body("ca_")
    x, hn, keep, gate, k, v, bias, wq, bq, wo, bo = CA_INPUTS
    c0, c1, cm1, one = b.const([0]), b.const([1]), b.const([-1]), b.const(1)
    # sizes from the weights (initializers), so these chains fold to constants at load
    H1 = b("Unsqueeze", b.attr_int("num_heads"), c0)  # (1,)
    d1 = b("Shape", wq, start=0, end=1)  # (1,)
    dh1 = b("Div", d1, H1)
    scale = _score_scale(b, dh1)
    # the score scale folded into the query weights: no Mul over the (B, H, n, S) scores
    bq_s = b("Mul", bq, scale)
    W = {}  # the (in, out) projection weights the MatMuls read (made again one If deeper by `projections`)

    def projections() -> None:
        W["q"] = b("Mul", b("Transpose", wq, perm=[1, 0]), scale)  # (d, d)
        W["o"] = b("Transpose", wo, perm=[1, 0])
    projections()
    head_split = b("Concat", c0, c0, H1, dh1, axis=0)  # [0, 0, H, dh]
    head_merge = b("Concat", c0, c0, d1, axis=0)  # [0, 0, d]

    def attend(hq: str, bias_rows, bias_of, counts: str | None = None, n1: str | None = None) -> str:
        """(B, n, d) query rows -> (B, n, d) updates. bias_rows() makes the (B, 1, n, S) bias, and
        bias_of(i1, j1, c) sample i's (1, 1, c, S) bias rows, for a large call run a sample at a time
        (_by_sample; counts (B,): each sample's own rows, n1 (1,) the batch's largest, or None: n)."""
        q = b("Add", b("MatMul", hq, W["q"]), bq_s)  # (B, n, d)
        q = b("Transpose", b("Reshape", q, head_split), perm=[0, 2, 1, 3])  # (B, H, n, dh)
        o = _by_sample(b, q, k, v, lambda: _attention(b, q, k, v, bias_rows()),
                       lambda qi, ki, vi, i1, j1, c: _attention(b, qi, ki, vi, bias_of(i1, j1, c)), counts, n1) \
            if by_sample else _attention(b, q, k, v, bias_rows())  # (B, H, n, dh)
        o = b("Transpose", o, perm=[0, 2, 1, 3])  # (B, n, H, dh)
        return b("Add", b("MatMul", b("Reshape", o, head_merge), W["o"]), bo)  # (B, n, d)

    def some() -> str:  # the kept query rows only, as the (B*T, d) rows
        T = b("Squeeze", b("Shape", x, start=1, end=2), c0)  # scalar
        ki = b("Cast", keep, to=TensorProto.INT64)  # (B, T)
        cnt = b("ReduceSum", ki, c1, keepdims=1)  # (B, 1): each sample's kept count
        n = b("Max", b("ReduceMax", cnt, keepdims=0), one)  # scalar: max(1, the largest kept count)
        n1 = b("Unsqueeze", n, c0)  # (1,)
        if partition == "topk":
            _, order = b("TopK", b("Cast", keep, to=TensorProto.FLOAT), n1, axis=1, largest=1, sorted=1,
                         outputs=2)  # (B, n): kept positions first
        else:
            # kept token t goes to slot (kept before t), skipped token t to (count + skipped before t).
            # The running counts are float32 (exact below 2^24): TensorRT before 10.8 takes CumSum on
            # floating-point tensors only.
            kf = b("Cast", keep, to=TensorProto.FLOAT)
            run_kept = b("Cast", b("CumSum", kf, one), to=TensorProto.INT64)
            run_skip = b("Cast", b("CumSum", b("Sub", b.const(1.0, np.float32), kf), one), to=TensorProto.INT64)
            slot_kept = b("Sub", run_kept, one)
            slot_skip = b("Add", cnt, b("Sub", run_skip, one))
            slot = b("Where", keep, slot_kept, slot_skip)  # (B, T): a permutation of 0..T-1 per row
            pos = b("Add", b("Mul", ki, b.const(0)), b("Range", b.const(0), T, one))  # (B, T)
            perm = b("ScatterElements", pos, slot, pos, axis=1)  # (B, T): perm[b, slot] = t
            order = b("Slice", perm, c0, n1, c1)  # (B, n): kept positions first
        B = b("Squeeze", b("Shape", x, start=0, end=1), c0)
        base = b("Range", b.const(0), b("Mul", B, T), T)  # (B,): the first flat row of each sample
        rows = b("Add", order, b("Unsqueeze", base, c1))  # (B, n) rows of the flat (B*T, .) tensors
        rows_d = b("Concat", cm1, d1, axis=0)  # [-1, d]
        flat = b("Reshape", x, rows_d)  # (B*T, d)
        hq = b("Gather", b("Reshape", hn, rows_d), rows, axis=0)  # (B, n, d)
        bias_flat = b("Reshape", bias, b("Concat", cm1, b("Shape", bias, start=3, end=4), axis=0))  # (B*T, S)

        def sample_bias(i1: str, j1: str, c: str) -> str:  # sample i's own c rows of the bias: (1, 1, c, S)
            own = b("Slice", rows, b("Concat", i1, c0, axis=0), b("Concat", j1, c, axis=0), b.const([0, 1]))  # (1, c)
            return b("Unsqueeze", b("Gather", bias_flat, own, axis=0), c1)
        upd = attend(hq, lambda: b("Unsqueeze", b("Gather", bias_flat, rows, axis=0), c1), sample_bias,
                     b("Reshape", cnt, cm1) if by_sample else None, n1)  # (B, n, d)
        gs = b("Unsqueeze", b("Gather", b("Reshape", _masked_gate(b, gate, keep), cm1), rows, axis=0), b.const([2]))  # (B, n, 1)
        new = b("Add", b("Gather", flat, rows, axis=0), b("Mul", upd, gs))  # (B, n, d)
        return b("ScatterND", flat, b("Unsqueeze", rows, b.const([2])), new)  # (B*T, d); indices (B, n, 1)

    def every() -> str:  # every query row, the update masked
        upd = attend(hn, lambda: bias, lambda i1, j1, c: b("Slice", bias, i1, j1, c0))  # (B, T, d)
        return b("Add", x, b("Mul", upd, b("Unsqueeze", _masked_gate(b, gate, keep), b.const([2]))))

    if variant == "sparse" and dispatch:
        # run-time dispatch on the decisions: no kept token runs no query side at all (a decode
        # step's skipped block); a call where some sample keeps most of its tokens (every token
        # kept included) runs it on all rows without gather and scatter (the gathered rows would be
        # nearly every row, plus the gathers of their rows of hn, x and the (T, S) bias)
        y = _as_x(b, _dispatch(b, keep, every, x, some, projections, share=DENSE_QUERY_SHARE), x)
    else:
        y = _as_x(b, some(), x) if variant == "sparse" else every()
    _name_output(b, y, "y")
    return _private(helper.make_function(
        DOMAIN, "ConditionalAttention", CA_INPUTS, ["y"], b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["num_heads"],
        doc_string=f"adaptex::conditional_attention, {variant} lowering (see docs/ops.md)",
    ))


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
                               masked_up_to: int | None = None, by_sample: bool = True,
                               heads: int | None = None) -> onnx.FunctionProto:
    """The body of adaptex.ElasticAttention: every head of a layer, each full or streaming.

    sparse: the (B*H) pairs of each mode gathered (NonZero over sa): FA pairs attend every visible
    key, SA pairs block-local (each block of Bq = min(window, T) queries against its own run of
    keys, via a (blocks, L) Gather, plus the sinks), and ScatterND (no reduction) puts both back.
    dispatch (ONNX Runtime): If nodes take a shorter path where one applies: a call whose pairs are
    all FA, or whose keys all lie within an SA query's sinks and window, attends every (B, H) pair
    over every visible key as it is (no reshape, gather or scatter); all SA, every pair
    block-local; only a mix gathers; and a call with SA pairs and at most `masked_up_to` scores a
    sample (H*T*S; default MIXED_CALL_MASKED_UP_TO, 0: never) attends every pair as it is, the SA
    pairs' keys outside their reach masked; with the default an encoder's call (causal_known False)
    also does where masking adds few scores over block-local attention
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
    Measured with 12 FA pairs of (512, 32), 1 thread: 4.3 ms against 6.5 ms for the floored MatMul +
    bias Add + Softmax + MatMul (0.74 at T = 128); with a padding mask the kernel gains only 10%, so
    padded calls keep the plain body. SA pairs stay out of it: the kernel's band mask sends its exp
    through subnormal floats (2.6x the unmasked kernel on the earlier CPU, 1.22x on the AMD EPYC with
    AVX-512 and still no faster than the chain there, examples/fused_mask_cost.py; a mask near -80
    is fast only while scores stay within a few units of each other), where block_local's floored
    Softmax does not.
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
    b = _Body("ea_")
    q, k, v, sa, key_mask = EA_INPUTS
    shared = dict(zip(ENCODER_SHARED, ENCODER_SHARED)) if heads and dispatch and causal_known is False else {}
    if shared and masked_up_to is not None:
        raise ValueError("an encoder body with `heads` takes the translation's masked test (ENCODER_SHARED); "
                         "masked_up_to is for a body that tests it itself")
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

    up_to = MIXED_CALL_MASKED_UP_TO if masked_up_to is None else masked_up_to

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
        if causal_known is False and masked_up_to is None:  # an encoder's call: also where masking adds few
            # scores over block-local attention (elastic_attention.call_runs_masked)
            B = b("Squeeze", b("Shape", q, start=0, end=1), b.const([0]))
            beyond = b("Max", b("Sub", S, b("Add", sink, b("Mul", window, b.const(2)))), c0)  # keys past a row
            large = b("And", b("Greater", B, c1), b("GreaterOrEqual", b("Mul", b("Mul", B, HT), S),
                                                     b.const(BY_SAMPLE_FROM)))
            excess = b("Mul", b("Mul", b("Where", large, c1, B), HT), beyond)  # a large call's: a sample's
            few = b("Or", few, b("LessOrEqual", excess, b.const(MASKED_EXCESS_UP_TO)))
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


# A decode step's mixed layer (some pairs FA, some SA) attends every pair over every key, the SA
# pairs' keys outside their sinks and window masked, while its cache holds at most this many floats
# (B*H*S*dh); past it, the pairs are gathered by mode and each reads only its own keys. Measured on
# elastic-charlm (docs/benchmarking.md#decode-steps): masking ran 0.92 of gathering after 511 cached
# tokens at B1 (65,536 floats); with the step's shared positions computed once (2026-12-04), 0.965
# after 2047 (2^18 floats), 0.971 at B2 after 2047 and 0.986 at B8 after 511 (2^19), about even at
# 2^21 (B8 after 2047 1.00, B16 after 1023 1.02) and 2^22 (B64 after 511 1.00).
MIXED_STEP_MASKED_UP_TO = 1 << 20


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
# hidden; empty, (2 B, 0, S), for a call past MIXED_CALL_MASKED_UP_TO) and each sample's first plane
# (B, 1: 2 b), and whether the call attends every pair masked (a bool scalar: the test of
# elastic_attention.call_runs_masked). lowerings.elastic_encoder_node_for computes them in the graph
# once for all the layers, where each layer's body had run about thirty small kernels for them.
ENCODER_SHARED = ["reach", "unpadded", "flat_mask", "planes", "first", "masked"]


# A decode step whose cache holds at most this many times sink + window keys runs the near-cache step
# program (export: dispatch.merge_decode_step with near_keys): every layer attends every key, an SA
# pair's keys outside its sinks and window masked, with no If and no count of its modes. Measured on
# elastic-charlm (sink + window = 68; docs/benchmarking.md#decode-steps), against the step program,
# both as sessions of their own: 0.93 at B1, B8 and 0.96 at B64 after 127 cached tokens; after 255,
# 0.99 at B1 but 1.07 at B8 and 1.15 at B64, where every key costs more than the Ifs (at B64 after
# 127 too once the runner read the programs' weights directly: NEAR_STEP_KEYS_CELLS).
NEAR_STEP_KEYS = 2
# ... while its batch x keys is at most this many times sink + window: at larger batches the masked
# keys' Softmax and the scaled score MatMul cost more than the step program's gathers and Ifs.
# Measured (2026-12-05, ninth session, elastic-charlm, `examples/compare_artifacts.py` with real
# routing, the near program's time 1.000): the step program 0.950 at B64 after 127 cached tokens
# (8,192 cells), 0.959 at B32 after 127 (4,096), 0.965 at B64 after 100 (6,464); 1.051 at B64
# after 63 (4,096), 1.046 at B16 after 127 (2,048) and 1.063 at B8. 64 x 68 = 4,352 cells keeps
# the near program to B64 after 67 and B32 after 135: B32 after 127 stays with it (4,096 cells, as
# many as B64 after 63, where the near program wins), so a cells bound alone cannot take both.
# An artifact exported without the softmax floor has no such bound: on a CPU whose Softmax takes
# masked scores at full speed the near program wins at every batch (2026-12-06, nineteenth session, an
# AMD EPYC with AVX-512, elastic-charlm, `examples/compare_artifacts.py`, the file with the bound at
# 1.000, a copy of it within [0.979, 1.017]): 0.924 at B64 after 127, 0.941 at B64 after 100, 0.913
# at B64 after 135, 0.894 at B128 after 127, 0.832 at B256 after 100.
NEAR_STEP_KEYS_CELLS = 64
# A step whose batch x keys (the attention mask's cells) is at most this many times sink + window runs
# the near-cache program too, whatever its cache (elastic-charlm: 408, B1 after up to 407 cached
# tokens, B2 after 203): there the step program's Ifs and mode counts cost more than the keys a
# masked SA pair reads in vain. Measured (2026-12-05, elastic-charlm, the two programs as the runner
# makes them, in the same rounds, one FA layer and five SA as its routers choose, the step program's
# time 1.000): 0.953 at B1 after 191 cached tokens, 0.988 after 255, 1.005 after 319, 1.028 after
# 383, 1.049 after 447, 1.097 after 511; 0.953 at B2 after 159, 0.975 and 0.982 after 191. (8,
# measured before the runner read the programs' weights directly: 0.927 after 255, 1.00 after 511
# and 767, and at B2 0.950 after 255, 1.03 after 511.)
NEAR_STEP_CELLS = 6
# ... or this many, in an artifact exported without the softmax floor (--softmax-floor off: for a CPU
# whose Softmax takes masked scores at full speed). Part of what the near program's masked keys cost
# above is Softmax's exp on them through subnormal floats (docs/benchmarking.md#decode-steps); where
# that is free, the near program wins over more keys.
# Measured (2026-12-06, nineteenth session, an AMD EPYC with AVX-512, elastic-charlm exported with the
# floor off, `examples/compare_artifacts.py`, the file with the step program at 1.000, a copy of it
# within [0.949, 1.041]): the near program 0.938 and 0.950 at B1 after 511 cached tokens (512 cells),
# 0.978 after 767, 0.991 after 1023; 0.920 at B2 after 255, 0.950 after 383, 0.985 after 511; 0.913
# at B4 after 191; 1.072 at B8 after 511 (4,096 cells). 12 x 68 = 816 cells keeps the wins.
NEAR_STEP_CELLS_UNFLOORED = 12


def elastic_step_function(head_dim: int | None = None, near: bool = False) -> onnx.FunctionProto:
    """adaptex.ElasticAttention for a call the exporter traced as a decode step (ONNX Runtime): one
    causal query per pair (T = 1) after a non-empty cache (docs/ops.md). A layer whose pairs are
    all FA attends every key; all SA, only the sinks and the window of the cache (a Gather of those
    positions, L <= sink + window); a mix, see MIXED_STEP_MASKED_UP_TO. The inputs after EA_INPUTS
    (STEP_SHARED) come from the graph, once for every layer: computed in the body, they ran once per
    layer, since ONNX Runtime's common-subexpression elimination does not run inside the decode-step
    If branch (exporter/targets/onnx/dispatch.py). It serves the decode-step program only: the general
    body takes every other call (exporter/targets/onnx/dispatch.py). head_dim: the calls' dh where
    tracing fixed it, so the score scale is a constant (else read from q's shape: four kernels a
    layer). near: the body of the near-cache step program (NEAR_STEP_KEYS): every pair over every
    key, masked."""
    b = _Body("eas_")
    q, k, v, sa, _ = EA_INPUTS
    keys, bias, bias_sa, bias_far = STEP_SHARED
    zero = b.const(0.0, np.float32)
    if head_dim:
        scale = b.const(1.0 / np.sqrt(head_dim), np.float32)
    else:
        scale = b("Reciprocal", b("Sqrt", b("Cast", b("Shape", q, start=3, end=4), to=TensorProto.FLOAT)))
    qs = b("Mul", q, scale)  # (B, H, 1, dh)

    def attend(qx: str, kx: str, vx: str, bx: str, perm=(0, 1, 3, 2)) -> str:
        scores = b("Add", b("MatMul", qx, b("Transpose", kx, perm=list(perm))), bx)
        return b("MatMul", b("Softmax", scores, axis=-1), vx)

    def every_sa() -> str:
        return attend(qs, b("Gather", k, keys, axis=2), b("Gather", v, keys, axis=2), bias_sa)

    def masked() -> str:  # every pair over every key, an SA pair's keys outside sinks and window hidden
        return attend(qs, k, v, b("Where", b("Unsqueeze", sa, b.const([2, 3])), bias_far, bias))  # (B, H, 1, S)

    def by_pairs() -> str:  # FA pairs over every key, SA pairs over their sinks and window
        cm1 = b.const([-1])
        H = b("Shape", q, start=1, end=2)
        dh1 = b("Shape", q, start=3, end=4)
        qf = b("Reshape", qs, b("Concat", cm1, b.const([1]), dh1, axis=0))  # (BH, 1, dh)
        modes = b("Reshape", sa, cm1)  # (BH,)
        out = b("Mul", qf, zero)
        for pick, kk, vv, bb in ((b("Not", modes), k, v, bias), (modes, None, None, bias_sa)):
            if kk is None:
                kk, vv = b("Gather", k, keys, axis=2), b("Gather", v, keys, axis=2)
            idx = b("Transpose", b("NonZero", pick), perm=[1, 0])  # (N, 1)
            rows = b("Squeeze", idx, b.const([1]))
            L1 = b("Shape", kk, start=2, end=3)
            kx, vx = (b("Gather", b("Reshape", t, b("Concat", cm1, L1, dh1, axis=0)), rows, axis=0) for t in (kk, vv))
            bx = b("Gather", b("Squeeze", bb, b.const([1])), b("Div", rows, H), axis=0)  # (N, 1, L): the pair's sample's
            out = b("ScatterND", out, idx, attend(b("Gather", qf, rows, axis=0), kx, vx, bx, perm=(0, 2, 1)))
        return b("Reshape", out, b("Shape", q))

    def mixed() -> str:
        small = b("LessOrEqual", b("Size", k), b.const(MIXED_STEP_MASKED_UP_TO))
        return b.if_(small, masked, by_pairs)

    if near:
        out = masked()
    else:  # every pair SA first: the common case where the routers were trained for a high SA share (one If)
        n_sa = b("ReduceSum", b("Cast", sa, to=TensorProto.INT64), keepdims=0)
        out = b.if_(b("Equal", n_sa, b("Size", sa)), every_sa,
                    lambda: b.if_(b("Equal", n_sa, b.const(0)), lambda: attend(qs, k, v, bias), mixed))
    b.nodes.append(helper.make_node("Identity", [out], ["o"]))
    return _private(helper.make_function(
        DOMAIN, "ElasticAttention", EA_INPUTS + STEP_SHARED, ["o"], b.nodes,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        attributes=["sink", "window", "causal"],
        doc_string="adaptex::elastic_attention, sparse lowering of a decode step (see docs/ops.md)",
    ))


def register_schema() -> None:
    """Register the node's schema with onnx (in this process only) so onnxscript can emit it.

    Models never depend on it: the body ships as a function, which is what runtimes read."""
    from onnx import defs

    if all(defs.has(n, DOMAIN) for n in ("BudgetedAttention", "ConditionalFFN", "ConditionalAttention",
                                         "ElasticAttention")):
        return
    FP = defs.OpSchema.FormalParameter
    float_in = {"x", "w_qkv", "b_qkv", "w_o", "b_o"}
    schema = defs.OpSchema(
        "BudgetedAttention", DOMAIN, OPSET_VERSION,
        doc="Multi-head self-attention computing only the top-k heads; see docs/ops.md.",
        inputs=[FP(n, "T" if n in float_in else ("B" if n == "key_mask" else "F")) for n in INPUTS],
        outputs=[FP("y", "T"), FP("k", "I"), FP("head_mask", "B")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"),
                          ("F", ["tensor(float)"], "routing stays fp32"),
                          ("B", ["tensor(bool)"], ""), ("I", ["tensor(int64)"], "")],
        attributes=[defs.OpSchema.Attribute("num_heads", defs.OpSchema.AttrType.INT, "H")],
    )
    for new in (schema, _cffn_schema(FP), _ca_schema(FP), _ea_schema(FP)):
        if not defs.has(new.name, DOMAIN):
            defs.register_schema(new)


def _cffn_schema(FP):
    from onnx import defs

    return (defs.OpSchema(
        "ConditionalFFN", DOMAIN, OPSET_VERSION,
        doc="Pre-norm FFN residual update for the kept tokens only; see docs/ops.md.",
        inputs=[FP(n, "B" if n == "keep" else ("F" if n == "gate" else "T")) for n in CFFN_INPUTS],
        outputs=[FP("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"),
                          ("F", ["tensor(float)"], "routing stays fp32"), ("B", ["tensor(bool)"], "")],
        attributes=[defs.OpSchema.Attribute("eps", defs.OpSchema.AttrType.FLOAT, "LayerNorm epsilon")],
    ))


def _ca_schema(FP):
    from onnx import defs

    return (defs.OpSchema(
        "ConditionalAttention", DOMAIN, OPSET_VERSION,
        doc="Self-attention update for the kept tokens' queries only (every token's keys); see docs/ops.md.",
        inputs=[FP(n, "B" if n == "keep" else ("F" if n in ("gate", "bias") else "T")) for n in CA_INPUTS],
        outputs=[FP("y", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"),
                          ("F", ["tensor(float)"], "routing and mask stay fp32"), ("B", ["tensor(bool)"], "")],
        attributes=[defs.OpSchema.Attribute("num_heads", defs.OpSchema.AttrType.INT, "H")],
    ))


def _ea_schema(FP):
    from onnx import defs

    return (defs.OpSchema(
        "ElasticAttention", DOMAIN, OPSET_VERSION,
        doc="Every head of a layer, each full or streaming (sinks + local window); see docs/ops.md.",
        inputs=[FP(n, "B" if n in ("sa", "key_mask") else "T") for n in EA_INPUTS]
        + [FP(n, {"keys": "I"}.get(n, "F"), "a decode step's (STEP_SHARED)",
              param_option=defs.OpSchema.FormalParameterOption.Optional) for n in STEP_SHARED]
        + [FP(n, {"planes": "F", "first": "I"}.get(n, "B"), "an encoder's (ENCODER_SHARED)",
              param_option=defs.OpSchema.FormalParameterOption.Optional) for n in ENCODER_SHARED],
        outputs=[FP("o", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "body precision"), ("B", ["tensor(bool)"], ""),
                          ("I", ["tensor(int64)"], ""), ("F", ["tensor(float)"], "the padding bias stays fp32")],
        attributes=[defs.OpSchema.Attribute(n, defs.OpSchema.AttrType.INT, n) for n in ("sink", "window", "causal")],
    ))
