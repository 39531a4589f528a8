"""Reading an artifact's programs: which branches of its top-level dispatch Ifs a call takes, and the
program those branches hold, as a model of its own (exporter/targets/onnx/dispatch.py merges them)."""
from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx.dispatch import RESERVED
from adaptex.exporter.targets.onnx.passes import reads, rename_outputs, rename_reads, renamed
from adaptex.graphs.ops.elastic_attention import masked_excess


def taken(shapes: dict, *, decode_step: dict | None = None, short_call: dict | None = None,
          dense: dict | None = None, large_call: dict | None = None) -> tuple[bool, ...]:
    """The branches an artifact's top-level Ifs take for a call whose inputs have `shapes` (name ->
    shape), outermost first (True: the then branch): the conditions merge_decode_step,
    merge_short_call, merge and merge_large_call build into the graph, evaluated on the shapes, in
    the order export() nests the merges (the near-cache step's If outermost, then the decode step's,
    the short call's, the masked short call's by sample and the masked short call's; a decoder's
    dense step's, the dense dispatch's, then the large call's in its sparse branch; short-call
    dispatch never with either).
    decode_step, short_call, dense, large_call: the artifact's metadata entries of those names
    ("dispatch" for dense), or None where it has none."""
    path = []
    if decode_step:
        step = shapes[decode_step["new_tokens_input"]][1] == 1 and shapes[decode_step["cache_input"]][2] > 0
        if decode_step.get("near_keys"):  # the near-cache step program's If, outermost
            batch, keys = shapes[decode_step["keys_input"]][:2]
            cells, capped = decode_step.get("near_cells"), decode_step.get("near_keys_cells")
            few_keys = keys <= decode_step["near_keys"] and (not capped or batch * keys <= capped)
            path.append(bool(step and (few_keys or (cells and batch * keys <= cells))))
            if path[-1]:
                return tuple(path)
        path.append(bool(step))
        if step:
            return tuple(path)
    if short_call:
        batch, keys = shapes[short_call["keys_input"]][:2]
        prefill = shapes[short_call["cache_input"]][2] == 0
        path.append(bool(keys <= short_call["max_keys"] and prefill))
        if not path[-1] and short_call.get("masked_keys"):  # the masked short-call programs' Ifs, inside
            excess = short_call.get("masked_excess")

            def masked(b: int) -> bool:  # _excess_cond's condition, beside the key count's
                few = keys <= short_call["masked_keys"] or (
                    excess is not None and masked_excess(b, excess["heads"], keys, excess["beyond"]) <= excess["up_to"])
                return bool(few and prefill)

            if short_call.get("masked_large_call"):  # attention by sample, outside the plain one's If
                path.append(masked(1) and _large(batch, keys, keys, short_call["masked_large_call"]))
                if path[-1]:
                    return tuple(path)
            path.append(masked(batch))
        return tuple(path)
    if dense:
        rows = shapes[dense["rows_input"]]
        small = rows[0] * rows[1] <= dense["dense_rows"]
        if dense.get("step_graph"):  # merge_dense_step's If, outside the dense dispatch's
            path.append(bool(small and rows[1] == 1))
            if path[-1]:
                return tuple(path)
        path.append(bool(small))
        if path[-1]:
            return tuple(path)
    if large_call:
        (batch, new), keys = shapes[large_call["ids_input"]][:2], shapes[large_call["keys_input"]][1]
        path.append(_large(batch, new, keys, large_call))
    return tuple(path)


def _large(batch: int, new: int, keys: int, large: dict) -> bool:
    """_large_call_cond's condition on the call's sizes."""
    return bool(batch > 1 and batch * new * keys * large["heads"] >= large["from_scores"])


def program(proto: onnx.ModelProto, path: tuple[bool, ...]) -> onnx.ModelProto:
    """The graph that a call taking `path` (taken()) runs in `proto` (a merged artifact), as a model
    of its own: the chosen branch of each top-level If, outermost first, becomes the main graph, its
    values that were the Ifs' outputs take the graph's output names, and the main graph's
    initializers it reads (its weights' fold nodes included) stay initializers. The same inputs,
    outputs and functions, no metadata. ONNX Runtime runs a branch's nodes slower than the same
    nodes in a main graph (B1 decode steps of elastic-charlm: 1.07 to 1.10x in the Ifs; of
    tsa-charlm's dense branch 1.03 to 1.08x; docs/benchmarking.md#one-session-per-program), so
    runtimes.onnxruntime runs each program as a session of its own. The program reuses (and
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
    where a folded copy comes later (charlm-dense's general program at a B1 step after 511: 1.024
    of the graph alone with the pairs, about even without)."""
    fold = [n for n in nodes if n.op_type == "Reshape" and n.name.startswith(RESERVED) and ".fold." in n.name]
    first = {n.output[0]: n for n in fold}
    weight = {n.output[0]: first[n.input[0]].input[0] for n in fold if n.input[0] in first}
    if not weight:
        return nodes
    gone = {id(n) for n in fold}
    kept = [n for n in nodes if id(n) not in gone]
    rename_reads(kept, weight)
    return kept


def short_keys_of(proto: onnx.ModelProto) -> int | None:
    """The key count at or below which `proto` runs its short-call graph, or None (none)."""
    for i in proto.graph.initializer:
        if i.name == f"{RESERVED}short_keys":
            return int(numpy_helper.to_array(i))
    return None


def dense_rows_of(proto: onnx.ModelProto) -> int | None:
    """The row count at or below which `proto` runs its dense graph, or None (no dispatch)."""
    for i in proto.graph.initializer:
        if i.name == f"{RESERVED}dense_rows":
            return int(numpy_helper.to_array(i))
    return None
