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
