"""A bf16 OpenVINO artifact whose routing runs in f32.

OpenVINO's CPU plugin runs a layer in f32 under the bf16 inference precision hint when the layer
carries the `precise` runtime attribute (DisablePrecisionConversion). Two things stand between that
and a router:
- Set from Python, the attribute is a plain string the plugin ignores; only the IR's reader makes
  it the typed attribute. So it is written into the .xml (`keep_routing_f32`).
- The plugin folds a MatMul with constant weights and the Add of a constant bias after it into one
  FullyConnected layer, and that layer loses the attribute: a router's Linear ran in bf16 with every
  node of it marked (OpenVINO 2026.4.1). A layer without a bias keeps it. So each routing Linear
  carries its bias in its weights before conversion (`biases_in_weights`): x·W + b = [x, 1]·[W; b],
  one more input column of ones, and no Add left to fold.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from adaptex.exporter.targets.tensorrt.plan import ROUTE_MARK

PRECISE = "precise"  # the IR name of OpenVINO's DisablePrecisionConversion runtime attribute


def _uses(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Value name -> the indices of the nodes that read it."""
    uses: dict[str, list[int]] = {}
    for i, n in enumerate(graph.node):
        for v in n.input:
            uses.setdefault(v, []).append(i)
    return uses


def _linears(graph: onnx.GraphProto, inits: dict, uses: dict) -> list[tuple[int, int | None, np.ndarray, np.ndarray]]:
    """The routing Linears with constant weights and bias: (node index, index of its bias Add or
    None for a Gemm, W as (in, out), b as (out,))."""
    outputs = {o.name for o in graph.output}
    found = []
    for i, n in enumerate(graph.node):
        if ROUTE_MARK not in n.name or len(n.input) < 2 or n.input[1] not in inits:
            continue
        w = numpy_helper.to_array(inits[n.input[1]])
        if w.ndim != 2 or w.dtype != np.float32:
            continue
        if n.op_type == "Gemm" and len(n.input) == 3 and n.input[2] in inits:
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
                continue
            b = numpy_helper.to_array(inits[n.input[2]])
            w = w.T if a.get("transB", 0) else w
            if b.size in (1, w.shape[1]):
                found.append((i, None, w, np.broadcast_to(b.reshape(-1), (w.shape[1],)).astype(np.float32)))
        elif n.op_type == "MatMul" and n.output[0] not in outputs and len(uses.get(n.output[0], [])) == 1:
            j = uses[n.output[0]][0]
            add = graph.node[j]
            bias = [v for v in add.input if v != n.output[0]]
            if add.op_type == "Add" and len(bias) == 1 and bias[0] in inits:
                b = numpy_helper.to_array(inits[bias[0]])
                if b.size == w.shape[1] and b.dtype == np.float32:
                    found.append((i, j, w, b.reshape(-1)))
    return found


def _scaled(graph: onnx.GraphProto, out: str, uses: dict, inits: dict) -> tuple[int, float] | None:
    """The Div or Mul by a constant scalar that alone reads `out` (a router's temperature): its
    node index and the factor it applies, which the weights can carry instead."""
    if len(uses.get(out, [])) != 1 or out in {o.name for o in graph.output}:
        return None
    j = uses[out][0]
    n = graph.node[j]
    if n.op_type not in ("Div", "Mul") or len(n.input) != 2 or n.input[0] != out or n.input[1] not in inits:
        return None
    c = numpy_helper.to_array(inits[n.input[1]])
    if c.size != 1 or not np.isfinite(c).all() or float(c.reshape(-1)[0]) == 0.0:
        return None
    v = float(c.reshape(-1)[0])
    return j, (1.0 / v if n.op_type == "Div" else v)


def biases_in_weights(proto: onnx.ModelProto) -> int:
    """Rewrite each routing Linear (a Gemm, or a MatMul and its bias Add, with constant weights) of
    the main graph as one MatMul of [x, 1] by [W; b], a division or multiplication by a constant
    that follows it folded in too (the plugin folds that into the layer as well, and the layer loses
    its mark the same way); returns how many."""
    g = proto.graph
    inits, uses = {i.name: i for i in g.initializer}, _uses(g)
    found = _linears(g, inits, uses)
    if not found:
        return 0
    replace, drop = {}, set()
    for i, j, w, b in found:
        out = g.node[i].output[0] if j is None else g.node[j].output[0]
        last = j
        scale = _scaled(g, out, uses, inits)
        if scale is not None:
            last, factor = scale
            w, b = w * np.float32(factor), b * np.float32(factor)
            drop.add(last)
        drop.update({j} if j is not None else set())
        replace[i] = (last, w, b)
    one = f"{ROUTE_MARK}/one"
    g.initializer.extend([numpy_helper.from_array(np.ones((1,), np.float32), one),
                          numpy_helper.from_array(np.array([0], np.int64), f"{ROUTE_MARK}/zero"),
                          numpy_helper.from_array(np.array([-1], np.int64), f"{ROUTE_MARK}/minus_one"),
                          numpy_helper.from_array(np.array([1], np.int64), f"{ROUTE_MARK}/one_i64")])
    nodes = []
    for i, n in enumerate(g.node):
        if i in drop:
            continue
        if i not in replace:
            nodes.append(n)
            continue
        last, w, b = replace[i]
        out = n.output[0] if last is None else g.node[last].output[0]
        p = f"{ROUTE_MARK}/{n.name.removeprefix(ROUTE_MARK + '/')}.bias_in_weights"
        wb = f"{p}.weights"
        g.initializer.append(numpy_helper.from_array(np.concatenate([w, b[None, :]]).astype(np.float32), wb))
        x = n.input[0]
        nodes += [helper.make_node("Shape", [x], [f"{p}.shape"], name=f"{p}/shape"),
                  helper.make_node("Slice", [f"{p}.shape", f"{ROUTE_MARK}/zero", f"{ROUTE_MARK}/minus_one"],
                                   [f"{p}.lead"], name=f"{p}/lead"),
                  helper.make_node("Concat", [f"{p}.lead", f"{ROUTE_MARK}/one_i64"], [f"{p}.ones_shape"], axis=0,
                                   name=f"{p}/ones_shape"),
                  helper.make_node("Expand", [one, f"{p}.ones_shape"], [f"{p}.ones"], name=f"{p}/ones"),
                  helper.make_node("Concat", [x, f"{p}.ones"], [f"{p}.x1"], axis=-1, name=f"{p}/x1"),
                  helper.make_node("MatMul", [f"{p}.x1", wb], [out], name=f"{p}/matmul")]
    del g.node[:]
    g.node.extend(nodes)
    return len(found)


def keep_routing_f32(xml: Path) -> int:
    """Mark every routing layer of an IR (named with ROUTE_MARK) with the `precise` attribute, which
    the CPU plugin honours under the bf16 hint by running it in f32; returns how many were marked."""
    tree = ET.parse(xml)
    marked = 0
    for layer in tree.getroot().iter("layer"):
        if ROUTE_MARK not in layer.get("name", ""):
            continue
        info = layer.find("rt_info")
        if info is None:
            info = ET.Element("rt_info")
            layer.insert(0, info)
        if not any(a.get("name") == PRECISE for a in info.findall("attribute")):
            ET.SubElement(info, "attribute", {"name": PRECISE, "version": "0"})
            marked += 1
    tree.write(xml, encoding="utf-8", xml_declaration=True)
    return marked
