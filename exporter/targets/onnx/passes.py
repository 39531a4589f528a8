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


def rename_reads(nodes, rename: dict) -> None:
    """Rename the inputs of `nodes` and the outer reads of their subgraphs (a subgraph value of the
    same name as a renamed one would shadow it; the exporters never reuse a main-graph name there)."""
    for node in nodes:
        node.input[:] = [rename.get(n, n) for n in node.input]
        for g in subgraphs(node):
            rename_reads(g.node, rename)
            for o in g.output:  # a branch may hand an outer value straight through
                o.name = rename.get(o.name, o.name)


def layernorm_rows(proto: onnx.ModelProto) -> int:
    """Rewrite, in place, every LayerNormalization over the last axis whose input is an Add that it
    alone reads (ONNX Runtime's fusion pattern) and whose scale is a 1-D initializer; returns how many."""
    g = proto.graph
    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for v in reads(g.node) + [o.name for o in g.output]:
        readers[v] = readers.get(v, 0) + 1
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
    rest of the graph (runtimes.bench.profile_onnx); a fusion that makes a node afresh (BiasGelu,
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
    return bool(ours)


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
    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for v in reads(g.node) + [o.name for o in g.output]:
        readers[v] = readers.get(v, 0) + 1
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
