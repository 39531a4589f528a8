"""Graph passes on the main graph of an ONNX artifact, for ONNX Runtime's speed (never its results).

layernorm_rows: ONNX Runtime fuses a residual Add feeding a LayerNormalization into one
SkipLayerNormalization node. On its CPU execution provider that kernel is several times slower than
the Add and the LayerNormalization it replaces: measured with ONNX Runtime 1.32 on one thread at
[1, 512, 384], 0.99 ms against 0.17 ms (docs/benchmarking.md); twelve of them cost all-MiniLM-L6-v2
about 10 ms at T = 512. The fusion only matches a 3-D input, so the pass normalises the rows of a
2-D view: Reshape to [-1, D], LayerNormalization, Reshape back to the input's shape. The values are
the same (LayerNormalization over the last axis); a Reshape is a view in ONNX Runtime.

Only where the fusion would happen: ONNX Runtime fuses an Add whose output has one consumer, the
LayerNormalization, and is no graph output (onnxruntime/core/optimizer/skip_layer_norm_fusion.cc,
CheckFirstAdd). A pre-norm decoder's residual Add also feeds the next residual, so it never fuses
there, and rewriting it would only add three nodes (about 0.1 ms of a 2 ms decode step of
elastic-charlm, 13 LayerNormalizations, one of which fuses).

skip_layernorm: the other way round, for a decode-step graph (a few token rows a call), where the
kernel count is what costs: each residual Add (and the bias Add of the projection before it) and
the LayerNormalization it feeds become one com.microsoft.SkipLayerNormalization, whose fourth
output is the residual sum the next block reads, as ONNX Runtime's transformer optimizer does for
the dense yardstick graph (`dense+ortopt`). Only where both summands have the same shape.

shared_subexpressions: for a graph that will run as an If branch. At load, ONNX Runtime inlines a
main graph's function calls and then merges the nodes that compute the same value from the same
inputs (its common-subexpression elimination), but inside an If branch it does neither merge: each
call's body computes again what another call's already did. The pass inlines the calls and merges
them at export instead (onnx.inliner, onnx_ir's CommonSubexpressionEliminationPass): in
tsa-charlm's dense branch, the masked gate that a layer's attention and FFN bodies both make from
the router's keep and gate (a Where and an Unsqueeze each) is made once, 10 kernels fewer a call
(docs/benchmarking.md#never-slower-than-dense).

softmax_floor: a masked score (NEG, -1e30) makes ONNX Runtime's Softmax run at a fraction of its
speed. Its exp (MLAS) clamps the input near -104 and scales the result by a power of two, which
passes through subnormal floats, and x86 arithmetic on subnormals is slow: a causal (1, 4, 128, 128)
Softmax took 172 us where the same call with no masked score took 31, and 31 again with ONNX
Runtime's `session.set_denormal_as_zero` (ONNX Runtime 1.32, 1 thread; examples/softmax_floor_cost.py
times the three). Masking with -87 or anything below was as slow, with -80 not (one run over masked
values from -20 to -inf, 2026-12-05). The pass raises every score to at least the
row's largest minus SOFTMAX_FLOOR (80): Softmax(Max(x, ReduceMax(x) - 80)). A masked key then weighs
at most e^-80 (1.8e-35) of the largest instead of 0, below what float32 resolves beside it (its
epsilon is 1.2e-7), and no exp input goes below -80. Three kernels a Softmax, on (B, H, T, 1) but
one: 0.28 of the Softmax alone at T = 128 and 0.34 at T = 512 (B1, 4 heads), 0.56 at T = 32. A row
whose every key is masked (a padding query's, which nothing real reads) comes out uniform over its
keys, as the eager reference's masked_fill gives it. Main graph, branches and function bodies; a
Softmax over the last axis only; the floor is a float32 constant, as the ONNX target's graphs are
float32 (PRECISIONS; a float16 graph would fail to load, not run wrong). Whether it pays depends on
the CPU: on an AMD EPYC with AVX-512 the plain Softmax took 0.22 ms and the floored 0.42 at T = 512
(runtimes/cpu.py); `adaptex export --softmax-floor off` leaves it out. Not in a decode-step graph
or a decoder's dense branch of --dense-rows, which serve small calls (a step's one query row has
nothing masked but padding, and the floor is three kernels more a layer); a decoder's one graph,
which serves its prefills and its steps, gets it (charlm-dense at B1, T = 512: 1.465 of the floored
dense graph without it).

masks_once: Where(c, Where(c, x, 0), 0) is Where(c, x, 0). TSA's router hands each block a gate it
has already masked by keep (Where(keep, 1 - p, 0)), and each conditional op's dense body masks the
gate again (the op's contract takes any gate); once the calls are inlined the second Where reads the
first and goes (tsa-charlm's dense branch: 5 kernels a call).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _axis(node: onnx.NodeProto) -> int:
    for a in node.attribute:
        if a.name == "axis":
            return a.i
    return -1


def subgraphs(node: onnx.NodeProto):
    """The graphs a node holds (If branches, Loop and Scan bodies)."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def reads(nodes) -> list[str]:
    """Every value name `nodes` read, once per read: their subgraphs' reads of outer values and the
    values a subgraph hands straight through as an output included."""
    out = []
    for n in nodes:
        out += [i for i in n.input if i]
        for g in subgraphs(n):
            out += reads(g.node) + [o.name for o in g.output]
    return out


def _producers_readers(g: onnx.GraphProto) -> tuple[dict, dict[str, int]]:
    """The node making each value of `g`, and how many times each value is read (subgraphs' reads of
    outer values and the graph's outputs included)."""
    readers: dict[str, int] = {}
    for v in reads(g.node) + [o.name for o in g.output]:
        readers[v] = readers.get(v, 0) + 1
    return {o: n for n in g.node for o in n.output}, readers


def rename_reads(nodes, rename: dict) -> None:
    """Rename the inputs of `nodes` and the outer reads of their subgraphs (a subgraph value of the
    same name as a renamed one would shadow it; the exporters never reuse a main-graph name there)."""
    for node in nodes:
        node.input[:] = [rename.get(n, n) for n in node.input]
        for g in subgraphs(node):
            rename_reads(g.node, rename)
            for o in g.output:  # a branch may hand an outer value straight through
                o.name = rename.get(o.name, o.name)


def renamed(proto, name: str):
    """A copy of a named proto (an initializer, a value's type) under `name`."""
    copy = type(proto)()
    copy.CopyFrom(proto)
    copy.name = name
    return copy


def rename_outputs(nodes, rename: dict) -> None:
    """Rename the values `nodes` make (their subgraphs' too)."""
    for n in nodes:
        n.output[:] = [rename.get(o, o) for o in n.output]
        for g in subgraphs(n):
            rename_outputs(g.node, rename)
            for o in g.output:
                o.name = rename.get(o.name, o.name)


def layernorm_rows(proto: onnx.ModelProto) -> int:
    """Rewrite, in place, every LayerNormalization over the last axis whose input is an Add that it
    alone reads (ONNX Runtime's fusion pattern) and whose scale is a 1-D initializer; returns how many."""
    g = proto.graph
    producers, readers = _producers_readers(g)
    scales = {i.name: list(i.dims) for i in g.initializer}
    taken = {o for n in g.node for o in n.output} | {i.name for i in g.initializer} | {i.name for i in g.input}
    out, count = [], 0
    for node in g.node:
        dims = scales.get(node.input[1]) if len(node.input) > 1 else None
        prod = producers.get(node.input[0])
        if not (node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and _axis(node) == -1
                and dims is not None and len(dims) == 1 and prod is not None and prod.op_type == "Add"
                and readers.get(node.input[0]) == 1
                and len([o for o in node.output if o]) == 1):
            out.append(node)
            continue
        count += 1
        stem = f"{node.name or 'layernorm'}_rows{count}"
        while any(n.startswith(stem) for n in taken):
            stem += "_"
        x, y = node.input[0], node.output[0]
        rows_shape = numpy_helper.from_array(np.array([-1, dims[0]], dtype=np.int64), f"{stem}_2d")
        g.initializer.append(rows_shape)
        out += [helper.make_node("Shape", [x], [f"{stem}_shape"], name=f"{stem}_Shape"),
                helper.make_node("Reshape", [x, rows_shape.name], [f"{stem}_in"], name=f"{stem}_Reshape_in")]
        ln = onnx.NodeProto()
        ln.CopyFrom(node)
        ln.input[0] = f"{stem}_in"
        ln.output[0] = f"{stem}_out"
        out += [ln, helper.make_node("Reshape", [f"{stem}_out", f"{stem}_shape"], [y], name=f"{stem}_Reshape_out")]
        taken |= {f"{stem}_shape", f"{stem}_in", f"{stem}_out", rows_shape.name}
    del g.node[:]
    g.node.extend(out)
    return count


MS_DOMAIN = "com.microsoft"


OP_NODE = "adaptex|"  # the name of an adaptex op body's node starts so (name_op_nodes)


def name_op_nodes(proto: onnx.ModelProto) -> bool:
    """Name, in place, every node of `proto`'s adaptex functions, their If branches' too,
    `adaptex|<function>|<index>[.<branch>|<index>...]`. A name survives inlining (ONNX Runtime's at
    load keeps it, onnx.inliner's appends a suffix), so a profile can tell the ops' kernels from the
    rest of the graph (runtimes.profile.profile_onnx); a fusion that makes a node afresh (BiasGelu,
    FusedMatMul) names it anew. Returns whether `proto` has such a function."""
    def name(nodes, prefix: str) -> None:
        for i, node in enumerate(nodes):
            node.name = f"{prefix}|{i}"
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    name(a.g.node, f"{prefix}|{i}.{a.name}")

    ours = [f for f in proto.functions if f.domain.startswith("adaptex")]
    for f in ours:
        name(f.node, f"{OP_NODE}{f.name}")
    _name_shared_inputs(proto.graph)
    return bool(ours)


def _name_shared_inputs(graph: onnx.GraphProto) -> None:
    """Name as ElasticAttention's, in `graph` and its subgraphs, the nodes that compute only what its
    calls read past their first five inputs (STEP_SHARED, ENCODER_SHARED: the ops' work, computed
    once in the graph rather than in every body)."""
    from adaptex.exporter.targets.onnx.bodies import EA_INPUTS

    readers: dict[str, list] = {}
    for node in graph.node:
        for i, x in enumerate(node.input):
            readers.setdefault(x, []).append((node, i))
        for g in subgraphs(node):
            _name_shared_inputs(g)
            for x in reads(g.node) + [o.name for o in g.output]:  # its subgraphs' reads of outer values
                readers.setdefault(x, []).append((node, -1))
    outputs = {o.name for o in graph.output}
    ours: set[int] = set()
    for node in reversed(graph.node):  # readers come after their producers
        uses = [r for o in node.output for r in readers.get(o, [])]
        if uses and not outputs.intersection(node.output) and all(
                (r.op_type == "ElasticAttention" and r.domain.startswith("adaptex") and i >= len(EA_INPUTS))
                or id(r) in ours for r, i in uses):
            ours.add(id(node))
            node.name = f"{OP_NODE}ElasticAttention|shared|{node.name}"


def shared_subexpressions(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` with its local functions inlined and its graph's common subexpressions merged (see the
    module docstring): the same values, fewer nodes. The inlined nodes keep the names that mark them
    as an op's (name_op_nodes)."""
    import onnx.inliner
    from onnxscript import ir
    from onnxscript.ir.passes.common import CommonSubexpressionEliminationPass, RemoveUnusedNodesPass

    named = onnx.ModelProto()
    named.CopyFrom(proto)
    name_op_nodes(named)
    model = ir.serde.deserialize_model(onnx.inliner.inline_local_functions(named))
    CommonSubexpressionEliminationPass()(model)
    RemoveUnusedNodesPass()(model)
    return ir.serde.serialize_model(model)


def _zero_scalar(name: str, constants: dict) -> bool:
    t = constants.get(name)
    return t is not None and t.dims == [] and numpy_helper.to_array(t).item() == 0


def masks_once(proto: onnx.ModelProto) -> int:
    """Drop, in place, each Where(c, m, 0) of the main graph whose m is Where(c, x, 0) (the same
    condition; each 0 a scalar): its readers read m. Returns how many it dropped."""
    g = proto.graph
    constants = {t.name: t for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.attribute) == 1 and n.attribute[0].name == "value":
            constants[n.output[0]] = n.attribute[0].t
    producers = {o: n for n in g.node for o in n.output}
    outputs = {o.name for o in g.output}

    def masking(node) -> bool:
        return node is not None and node.op_type == "Where" and node.domain in ("", "ai.onnx") \
            and _zero_scalar(node.input[2], constants)

    rename, zeros = {}, set()
    for node in g.node:
        inner = producers.get(node.input[1]) if masking(node) else None
        if masking(inner) and inner.input[0] == node.input[0] and node.output[0] not in outputs:
            rename[node.output[0]] = rename.get(node.input[1], node.input[1])
            zeros.add(node.input[2])
    if rename:
        rename_reads(g.node, rename)
        still = set(reads([n for n in g.node if n.output[0] not in rename]))
        gone = set(rename) | (zeros - still)  # the dropped Wheres, and the zeros none reads now
        for field, name in ((g.node, lambda n: n.output[0]), (g.initializer, lambda t: t.name),
                            (g.value_info, lambda vi: vi.name)):
            kept = [x for x in field if name(x) not in gone]
            del field[:]
            field.extend(kept)
    return len(rename)


def _shapes(proto: onnx.ModelProto) -> dict[str, tuple]:
    """Inferred shapes of the main graph's values: a tuple of dim_value or dim_param per axis."""
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
    return out


def skip_layernorm(proto: onnx.ModelProto) -> int:
    """Fuse, in place, each LayerNormalization over the last axis of a residual Add(a, b) whose
    summands have the same known shape into SkipLayerNormalization(input, skip, gamma, beta[, bias]);
    where a summand is MatMul + Add of a 1-D initializer (a projection's bias), the bias goes into
    the fused node too. The sum stays available to the Add's other readers (output 3). Returns how
    many it fused."""
    g = proto.graph
    producers, readers = _producers_readers(g)
    inits = {i.name: list(i.dims) for i in g.initializer}
    shapes = _shapes(proto)

    def same_shape(a: str, b: str) -> bool:
        sa, sb = shapes.get(a), shapes.get(b)
        return sa is not None and sa == sb and None not in sa and len(sa) == 3

    drop, replace, count = set(), {}, 0
    for node in g.node:
        add = producers.get(node.input[0]) if node.input else None
        if not (node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and _axis(node) == -1
                and len(node.input) == 3 and len(inits.get(node.input[1], [])) == 1
                and add is not None and add.op_type == "Add" and add.domain in ("", "ai.onnx")
                and id(add) not in drop and id(add) not in replace and len([o for o in node.output if o]) == 1
                and same_shape(*add.input)):
            continue
        x, skip, bias = add.input[0], add.input[1], None
        for a, other in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
            lin = producers.get(a)
            if (lin is not None and lin.op_type == "Add" and readers.get(a) == 1 and id(lin) not in drop
                    and len(inits.get(lin.input[1], [])) == 1 and producers.get(lin.input[0]) is not None
                    and producers[lin.input[0]].op_type == "MatMul"):
                x, skip, bias = lin.input[0], other, lin.input[1]
                drop.add(id(lin))
                break
        count += 1
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        summed = add.output[0] if readers.get(add.output[0], 0) > 1 else ""
        fused = helper.make_node("SkipLayerNormalization", [x, skip, node.input[1], node.input[2]] + ([bias] if bias else []),
                                 [node.output[0], "", "", summed], name=f"{node.name or 'ln'}_skip{count}",
                                 domain=MS_DOMAIN, epsilon=eps)
        drop.add(id(node))  # in the Add's place, where its inputs are all made and before any reader of either
        replace[id(add)] = fused
    if not count:
        return 0
    out = [replace.get(id(n), n) for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(out)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return count


SOFTMAX_FLOOR = 80.0  # e^-80 = 1.8e-35 is a normal float32; from about -87 on, exp's result is subnormal


def _floored(nodes, opset: int) -> tuple[list, int]:
    """`nodes` with every last-axis Softmax given the floor (softmax_floor), subgraphs included."""
    out, count = [], 0
    for node in nodes:
        for g in subgraphs(node):
            kept, n = _floored(g.node, opset)
            del g.node[:]
            g.node.extend(kept)
            count += n
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx") or _axis(node) != -1:
            out.append(node)
            continue
        x, tag = node.input[0], f"{node.output[0]}.floor"
        axes = [helper.make_node("Constant", [], [f"{tag}.axes"], value=numpy_helper.from_array(
            np.array([-1], dtype=np.int64)), name=f"{tag}.axes")] if opset >= 18 else []
        reduce = helper.make_node("ReduceMax", [x] + ([f"{tag}.axes"] if axes else []), [f"{tag}.max"],
                                  name=f"{tag}.ReduceMax", keepdims=1, **({} if axes else {"axes": [-1]}))
        out += axes + [
            reduce,
            helper.make_node("Constant", [], [f"{tag}.by"], value=numpy_helper.from_array(
                np.array(SOFTMAX_FLOOR, dtype=np.float32)), name=f"{tag}.by"),
            helper.make_node("Sub", [f"{tag}.max", f"{tag}.by"], [f"{tag}.low"], name=f"{tag}.Sub"),
            helper.make_node("Max", [x, f"{tag}.low"], [f"{tag}.x"], name=f"{tag}.Max"),
        ]
        node.input[0] = f"{tag}.x"
        out.append(node)
        count += 1
    return out, count


def softmax_floor(proto: onnx.ModelProto) -> int:
    """Give every last-axis Softmax of `proto` (main graph, subgraphs, function bodies) the
    floor, in place: Softmax(Max(x, ReduceMax(x) - SOFTMAX_FLOOR)). Returns how many it rewrote.
    Why: the module docstring."""
    def opset_of(imports) -> int:
        return next((o.version for o in imports if o.domain in ("", "ai.onnx")), 0)

    count = 0
    for body, opset in [(proto.graph, opset_of(proto.opset_import))] + \
            [(f, opset_of(f.opset_import) or opset_of(proto.opset_import)) for f in proto.functions]:
        kept, n = _floored(body.node, opset)
        del body.node[:]
        body.node.extend(kept)
        count += n
    return count


def artifact_passes(proto: onnx.ModelProto, by_sample: bool = True, floor: bool = True, policy=None) -> int:
    """The passes every ONNX Runtime artifact gets (not a decode-step graph's), in place, and the
    `+rows` dense candidates too (exporter/counterparts.py): layernorm_rows; unless by_sample is
    False (a graph whose calls never reach its threshold, where its If would only cost),
    attention_by_sample; unless floor is False (a decoder's dense branch, which serves small calls),
    softmax_floor.
    policy: ONNX Runtime's thresholds (default: graphs.ops.policy.DEFAULT).
    Returns how many rewrites they made."""
    from adaptex.exporter.targets.onnx.passes_by_sample import attention_by_sample
    from adaptex.graphs.ops.policy import DEFAULT

    return layernorm_rows(proto) + (attention_by_sample(proto, policy or DEFAULT) if by_sample else 0) + \
        (softmax_floor(proto) if floor else 0)
