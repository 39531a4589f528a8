"""An artifact's programs, each as a model of its own: the branches of its top-level dispatch Ifs
(exporter/targets/onnx/dispatch.py merges them; guards.py says which one a call takes)."""
from __future__ import annotations

import onnx
from onnx import helper

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx.dispatch import RESERVED
from adaptex.exporter.targets.onnx.passes import reads, rename_outputs, rename_reads, renamed


def path_of(index: int, count: int) -> tuple[bool, ...]:
    """The branches, outermost first (True: then), that lead to program `index` of `count` (the
    metadata's decision list: program i is the then branch of the i-th If, the last the else of all)."""
    return (False,) * index + ((True,) if index < count - 1 else ())


def program(proto: onnx.ModelProto, path: tuple[bool, ...]) -> onnx.ModelProto:
    """The graph that a call taking `path` (path_of) runs in `proto` (a merged artifact), as a model
    of its own: the chosen branch of each top-level If, outermost first, becomes the main graph, its
    values that were the Ifs' outputs take the graph's output names, and the main graph's
    initializers it reads (its weights' fold nodes included) stay initializers. The same inputs,
    outputs and functions, no metadata. ONNX Runtime runs a branch's nodes slower than the same
    nodes in a main graph, so runtimes.onnxruntime runs each program as a session of its own. The program reuses (and
    renames) `proto`'s nodes: read the file again for another."""
    g = proto.graph
    nodes, value_info, inits = list(g.node), list(g.value_info), list(g.initializer)
    target = {o.name: o.name for o in g.output}  # a value of the current level -> the graph output it is
    for then in path:
        node = next((n for n in nodes if n.op_type == "If" and n.name.endswith(f"{RESERVED}If")), None)
        if node is None:
            raise ExportError("this ONNX model has no run-time dispatch If where its metadata says; export it again")
        sub = next(a.g for a in node.attribute if a.name == ("then_branch" if then else "else_branch"))
        target = {s.name: target[o] for s, o in zip(sub.output, node.output)}
        nodes, value_info, inits = list(sub.node), value_info + list(sub.value_info), inits + list(sub.initializer)
    nodes = _unfolded(nodes)
    produced = {o for n in nodes for o in n.output}
    rename = {k: v for k, v in target.items() if k in produced}
    rename_outputs(nodes, rename)
    rename_reads(nodes, rename)
    for k, v in target.items():  # one value that is two outputs, or an outer value handed through
        if rename.get(k) != v:
            nodes.append(helper.make_node("Identity", [rename.get(k, k)], [v], name=f"{RESERVED}output.{v}"))
    read = set(reads(nodes))
    outputs = {o.name for o in g.output}
    graph = helper.make_graph(nodes, g.name, list(g.input), list(g.output),
                              initializer=[t for t in inits if t.name in read],
                              value_info=[renamed(v, rename.get(v.name, v.name)) for v in value_info
                                          if rename.get(v.name, v.name) not in outputs])
    model = helper.make_model(graph, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    model.functions.extend(proto.functions)
    return model


def _unfolded(nodes: list) -> list:
    """`nodes` (a branch's, now a main graph's) reading the weights the branch folded
    (_local_weights' Reshape pairs) from the initializers themselves, the fold nodes gone: in a main
    graph ONNX Runtime sees a weight as a constant from the start (its fusions and MatMul packing),
    where a folded copy comes later."""
    fold = [n for n in nodes if n.op_type == "Reshape" and n.name.startswith(RESERVED) and ".fold." in n.name]
    first = {n.output[0]: n for n in fold}
    weight = {n.output[0]: first[n.input[0]].input[0] for n in fold if n.input[0] in first}
    if not weight:
        return nodes
    gone = {id(n) for n in fold}
    kept = [n for n in nodes if id(n) not in gone]
    rename_reads(kept, weight)
    return kept
