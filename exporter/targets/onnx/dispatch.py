"""Run-time dense dispatch (ONNX Runtime): one artifact holding the sparse and the dense lowering of
the same weights, with an If at the top of the graph that runs the dense graph for small calls.

Where a call has few token rows (a decode step, a short prompt), the adaptive bodies' run-time
decisions and the kernels that act on them (the If nodes on the keep mask, gathers, scatters) cost
more than the work they skip: the dense variant, which runs the same routers and multiplies the
skipped updates by zero, is then the faster graph (docs/benchmarking.md). The merged graph reads
the rows of this call (the product of the first two axes of the rows input: the batch times the
sequence), and runs

    rows <= dense_rows: the dense lowering's graph (the then branch)
    otherwise:          the sparse lowering's graph (the else branch)

The weights are stored once, as initializers of the main graph, and each branch reads them through
a pair of Reshapes (to one axis and back) that ONNX Runtime's constant folding turns into
initializers of that branch when the session loads. An If whose branch reads main-graph
initializers directly pays for them on every call: tsa-charlm's dense graph as a branch cost 46 to
53 us more a B1 decode step read directly, 5 to 7 us folded; elastic-charlm's 88 to 145 us against
18 to 52 us (ONNX Runtime 1.32, 1 thread; examples/if_branch_cost.py,
docs/benchmarking.md#never-slower-than-dense). The price is memory: a loaded session holds a copy
of the weights per branch (tsa-charlm: 71 MB peak RSS against the sparse artifact's 41); the file
holds one.

Both branches compute the same outputs, decisions included, to the parity tolerance of the two
variants (each is checked against the eager reference by `adaptex check`). The dense branch's op
calls point at the `dense` overload of each adaptex function.
"""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import helper, numpy_helper

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx.passes import reads, subgraphs

DENSE_OVERLOAD = "dense"
RESERVED = "dispatch."  # prefix of the merged graph's own values and of the branches' renamed values


def _rename_reads(nodes, rename: dict) -> None:
    """Rename the inputs of `nodes` and the outer reads of their subgraphs (a subgraph value of the
    same name as a renamed one would shadow it; the exporters never reuse a main-graph name there)."""
    for node in nodes:
        node.input[:] = [rename.get(n, n) for n in node.input]
        for g in subgraphs(node):
            _rename_reads(g.node, rename)
            for o in g.output:  # a branch may hand an outer value straight through
                o.name = rename.get(o.name, o.name)


def _local_weights(nodes: list, graph: onnx.GraphProto, tag: str) -> tuple[list, list]:
    """Point the reads of `graph`'s initializers in `nodes` (subgraphs included) at branch values
    `dispatch.<tag>.w.<name>`, each made by Reshape to one axis and Reshape back: ONNX Runtime folds
    the pair into an initializer of the branch at load (see the module docstring). Returns the fold
    nodes and the branch's own initializers (the shapes). Empty tensors are read as they are."""
    read = set(reads(nodes))
    weights = [w for w in graph.initializer if w.name in read and 0 not in w.dims]
    if not weights:
        return [], []
    local = {w.name: f"{RESERVED}{tag}.w.{w.name}" for w in weights}
    _rename_reads(nodes, local)
    flat = numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{RESERVED}{tag}.one_axis")
    inits, fold = [flat], []
    for w in weights:
        shape = numpy_helper.from_array(np.array(w.dims, dtype=np.int64), f"{RESERVED}{tag}.shape.{w.name}")
        inits.append(shape)
        fold += [helper.make_node("Reshape", [w.name, flat.name], [f"{local[w.name]}.flat"],
                                  name=f"{RESERVED}{tag}.fold.{w.name}.flat"),
                 helper.make_node("Reshape", [f"{local[w.name]}.flat", shape.name], [local[w.name]],
                                  name=f"{RESERVED}{tag}.fold.{w.name}")]
    return fold, inits


def branch(graph: onnx.GraphProto, tag: str, outputs: list[onnx.ValueInfoProto], overload: str | None,
           domain: str, local_weights: bool = True) -> onnx.GraphProto:
    """`graph`'s nodes as an If branch: every value its nodes produce renamed `dispatch.<tag>.<name>`
    (the If's outputs take the graph's output names), reads of inputs unchanged, reads of
    initializers through the branch's fold nodes (_local_weights; local_weights=False reads them
    from the main graph, which examples/if_branch_cost.py times), the adaptex calls pointed at
    `overload`."""
    nodes = [onnx.NodeProto() for _ in graph.node]
    for copy, node in zip(nodes, graph.node):
        copy.CopyFrom(node)
    rename = {o: f"{RESERVED}{tag}.{o}" for n in nodes for o in n.output if o}
    for i, node in enumerate(nodes):  # node names too: ORT's profiler then shows which branch ran
        node.name = f"{RESERVED}{tag}.{node.name or f'{node.op_type}_{i}'}"
        node.output[:] = [rename.get(o, o) for o in node.output]
        if overload is not None and node.domain == domain:
            node.overload = overload
    _rename_reads(nodes, rename)
    outs = []
    for vi in outputs:
        name = rename.get(vi.name)
        if name is None:  # an output that is an input or an initializer: a branch must produce it
            name = f"{RESERVED}{tag}.{vi.name}"
            nodes.append(helper.make_node("Identity", [vi.name], [name]))
        outs.append(helper.make_tensor_value_info(name, vi.type.tensor_type.elem_type, None))
    fold, inits = _local_weights(nodes, graph, tag) if local_weights else ([], [])
    return helper.make_graph(fold + nodes, f"{RESERVED}{tag}", [], outs, initializer=inits)


def _digest(inits) -> dict:
    return {i.name: hashlib.sha256(i.SerializeToString()).hexdigest() for i in inits}


def merge(sparse: onnx.ModelProto, dense: onnx.ModelProto, *, rows_input: str, dense_rows: int,
          domain: str = "adaptex") -> onnx.ModelProto:
    """One model that runs `dense`'s graph when rows(rows_input) <= dense_rows and `sparse`'s
    otherwise, where rows is the product of rows_input's first two axes (batch x sequence). Both
    must be lowerings of one trace: the same inputs, outputs and initializers."""
    gs, gd = sparse.graph, dense.graph
    if isinstance(dense_rows, bool) or not isinstance(dense_rows, int) or dense_rows < 1:
        raise ExportError(f"dense dispatch: dense_rows must be a whole number of at least 1, got {dense_rows!r}")
    for what, a, b in (("inputs", gs.input, gd.input), ("outputs", gs.output, gd.output)):
        if [v.name for v in a] != [v.name for v in b]:
            raise ExportError(f"the sparse and dense lowerings differ in their {what}; export one variant")
    if _digest(gs.initializer) != _digest(gd.initializer):
        raise ExportError("the sparse and dense lowerings differ in their weights; export one variant")
    vi = next((v for v in gs.input if v.name == rows_input), None)
    if vi is None:
        raise ExportError(f"dense dispatch: {rows_input!r} is not an input of the graph")
    if len(vi.type.tensor_type.shape.dim) < 2:
        raise ExportError(f"dense dispatch: input {rows_input!r} has fewer than two axes (batch, sequence); "
                          "export without dense_rows")
    taken = [n for n in [v.name for v in gs.input] + [i.name for i in gs.initializer] if n.startswith(RESERVED)]
    if taken:
        raise ExportError(f"dense dispatch: the graph already has a value named {taken[0]!r}")

    outputs = list(gs.output)
    then_g = branch(gd, "dense", outputs, DENSE_OVERLOAD, domain)
    else_g = branch(gs, "sparse", outputs, None, domain)
    rows = f"{RESERVED}rows"
    limit = numpy_helper.from_array(np.array(dense_rows, dtype=np.int64), f"{RESERVED}dense_rows")
    small = f"{RESERVED}small"
    shape = f"{RESERVED}batch_sequence"
    nodes = [
        helper.make_node("Shape", [rows_input], [shape], name=f"{RESERVED}Shape", start=0, end=2),
        helper.make_node("ReduceProd", [shape], [rows], name=f"{RESERVED}ReduceProd", keepdims=0),
        helper.make_node("LessOrEqual", [rows, limit.name], [small], name=f"{RESERVED}LessOrEqual"),
        helper.make_node("If", [small], [o.name for o in outputs], name=f"{RESERVED}If",
                         then_branch=then_g, else_branch=else_g),
    ]
    graph = helper.make_graph(nodes, gs.name, list(gs.input), outputs,
                              initializer=list(gs.initializer) + [limit])
    graph.doc_string = gs.doc_string
    model = helper.make_model(graph, opset_imports=list(sparse.opset_import), ir_version=sparse.ir_version)
    known = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in dense.opset_import if o.domain not in known)
    model.functions.extend(sparse.functions)
    for f in dense.functions:
        copy = onnx.FunctionProto()
        copy.CopyFrom(f)
        if f.domain == domain:
            if f.overload:
                raise ExportError(f"dense dispatch: the dense body of {f.name} already has an overload")
            copy.overload = DENSE_OVERLOAD
        model.functions.append(copy)
    return model


def dense_rows_of(proto: onnx.ModelProto) -> int | None:
    """The row count at or below which `proto` runs its dense graph, or None (no dispatch)."""
    for i in proto.graph.initializer:
        if i.name == f"{RESERVED}dense_rows":
            return int(numpy_helper.to_array(i))
    return None


__all__ = ["merge", "dense_rows_of", "DENSE_OVERLOAD"]
