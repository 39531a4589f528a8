"""What keeps an ONNX artifact right in a conforming runtime other than the one it was tuned for.

if_outputs_copied: every If output that a node reads passes through a copy, Expand(v, Shape(v)), before anything
reads it. OpenVINO 2026.4's CPU plugin knows an If's output shape only after the taken branch has
run, and then resizes the output's buffer; a consumer that works in place on that buffer (the
residual Add after an adaptex op, whose sum two MatMuls and a later Add read) keeps the buffer of
the previous call. So the first call larger than every call before it computes from memory it never
wrote: budgetformer-graded's logits came out 17.9 off, or NaN, at B1 T = 128 after a B1 T = 8
call, and right on the same call repeated (docs/openvino.md#the-if-output-buffer). A copy into a
buffer of its own, sized when the copy runs, breaks the sharing. In ONNX Runtime an Expand to the
value's own shape is one memcpy of the op's output, next to the op's own work.
"""
from __future__ import annotations

import onnx
from onnx import helper

COPY_SUFFIX = ".if_out"  # the If's own output, read only by its copy


def _copy_outputs(nodes) -> int:
    """Rewrite `nodes` (a repeated NodeProto field) so each If output that a node of theirs reads is
    read through a copy. An If output that only leaves the graph (a program's outputs at the top of
    an artifact, a branch's result) has a buffer of the caller's: nothing works in place on it."""
    read = {name for node in nodes for name in node.input}
    out, done = [], 0
    for node in nodes:
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                done += _copy_outputs(g.node)
        out.append(node)
        if node.op_type != "If":
            continue
        for i, name in enumerate(node.output):
            if not name or name not in read or name.endswith(COPY_SUFFIX):
                continue
            raw = name + COPY_SUFFIX
            node.output[i] = raw
            out.append(helper.make_node("Shape", [raw], [name + ".if_shape"], name=name + ".if_shape"))
            out.append(helper.make_node("Expand", [raw, name + ".if_shape"], [name], name=name + ".if_copy"))
            done += 1
    del nodes[:]
    nodes.extend(out)
    return done


def if_outputs_copied(proto: onnx.ModelProto) -> int:
    """Copy every If output (main graph, function bodies, branches); returns how many."""
    done = _copy_outputs(proto.graph.node)
    for f in proto.functions:
        done += _copy_outputs(f.node)
    return done
