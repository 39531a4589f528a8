"""The adaptex op bodies of a quantized artifact (quantize.py): one specialised overload per op body.

An op's weights are its inputs, and its body first lays them out (a QKV matrix viewed per head as
[H, d, 3hd], an FFN matrix transposed). That weight-only part (the *cone*: the nodes that read only
weights and constants) is evaluated here for each call, and its results (the *boundary*) become the
specialised body's inputs. A boundary tensor [..., K, N] that reaches a MatMul as its right operand,
directly or through Gathers that select along its leading axes (heads), is stored int8 with one scale
per leading index and column ([..., 1, N]); the Gathers read the int8 tensor and its scales side by
side, and the MatMul runs on integers. A specialised call keeps its op's name in the domain
`adaptex.quantized` (its inputs differ from the op's schema in `adaptex`).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx.passes import subgraphs
from adaptex.exporter.targets.onnx.quantize import int8_columns


def _walk(nodes):
    """Every node of `nodes` and of their subgraphs, depth first."""
    for n in nodes:
        yield n
        for g in subgraphs(n):
            yield from _walk(g.node)


def _sub_outputs(nodes) -> set[str]:
    out = set()
    for n in nodes:
        for g in subgraphs(n):
            out |= {o.name for o in g.output} | _sub_outputs(g.node)
    return out


DOMAIN = "adaptex.quantized"
# ops that select part of a tensor: never evaluated ahead (a body's per-head slices of a weight, taken
# by constant indices, would each be stored beside the whole weight)
_SELECTING = {"Gather", "GatherElements", "GatherND", "Slice", "Split"}


class _Spec:
    """One op body's split into its weight-only cone and the rest, for calls whose inputs at
    `positions` are initializers."""

    def __init__(self, f: onnx.FunctionProto, positions: tuple[int, ...], overload: str):
        self.f, self.positions, self.overload = f, positions, overload
        sources = [f.input[i] for i in positions]
        self.const, self.cone = set(), set(sources)
        self.evaluated = []  # the nodes that compute the cone (and the constants it reads), in order
        self.rest = self._split(f.node)
        read = {i for n in _walk(self.rest) for i in n.input} | _sub_outputs(self.rest) | set(f.output)
        ordered = sources + [o for n in self.evaluated for o in n.output if o in self.cone]
        self.boundary = [v for v in dict.fromkeys(ordered) if v in read]
        self.quantized: dict[str, str] | None = None  # name -> mode, decided at the first call (needs ranks)

    def _split(self, nodes) -> list[onnx.NodeProto]:
        """`nodes` without the cone (copies; subgraphs' cone nodes hoisted into self.evaluated too)."""
        rest = []
        for n in nodes:
            ins = [i for i in n.input if i]
            if not any(True for _ in subgraphs(n)) and all(i in self.const or i in self.cone for i in ins):
                if any(i in self.cone for i in ins) and n.op_type not in _SELECTING:
                    self.evaluated.append(n)
                    self.cone.update(o for o in n.output if o)
                    continue
                if not any(i in self.cone for i in ins):
                    self.evaluated.append(n)  # constant-only: stays in the body, and the evaluation reads it
                    self.const.update(o for o in n.output if o)
            m = onnx.NodeProto()
            m.CopyFrom(n)
            for a in m.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    kept = self._split(g.node)
                    del g.node[:]
                    g.node.extend(kept)
            rest.append(m)
        return rest

    def decide(self, values: dict[str, np.ndarray], frozen: set[str]) -> None:
        modes = {v: quantizable(v, values[v], self.rest) for v in self.boundary if v not in frozen}
        self.quantized = {v: m for v, m in modes.items() if m}


def _reads(name: str, nodes) -> list[tuple[onnx.NodeProto, int]]:
    return [(n, i) for n in _walk(nodes) for i, x in enumerate(n.input) if x == name]


def _into_matmul(name: str, nodes, reshaped: bool = False) -> str | None:
    """How a gathered tensor reaches its MatMuls: "heads" (as it is, the right operand), "columns"
    (through a Reshape, which merges the heads into the contraction axis: then only one scale per
    column fits), or None (any other read)."""
    reads = _reads(name, nodes)
    if not reads or name in _sub_outputs(nodes):
        return None
    modes = set()
    for n, i in reads:
        if n.op_type == "MatMul" and i == 1:
            modes.add("columns" if reshaped else "heads")
        elif n.op_type == "Reshape" and i == 0 and not reshaped:
            modes.add(_into_matmul(n.output[0], nodes, reshaped=True))
        else:
            return None
    return None if None in modes else ("columns" if "columns" in modes else "heads")


def quantizable(name: str, value: np.ndarray, nodes) -> str | None:
    """Whether every read of `name` is a MatMul's right operand, directly, through Gathers along its
    leading axes or through a Reshape that keeps its last axis: "heads" (one scale per leading index
    and column fits: [..., 1, N]), "columns" (one scale per column: [N]) or None."""
    if value.dtype != np.float32 or value.ndim < 2 or value.size < 2 or name in _sub_outputs(nodes):
        return None
    reads = _reads(name, nodes)
    if not reads:
        return None
    modes = set()
    for n, i in reads:
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        axis = axis + value.ndim if axis < 0 else axis
        if n.op_type == "Gather" and i == 0 and axis < value.ndim - 2:
            modes.add(_into_matmul(n.output[0], nodes))
        else:
            modes.add(_into_matmul(name, nodes) if (n.op_type, i) in (("MatMul", 1), ("Reshape", 0)) else None)
    return None if None in modes else ("columns" if "columns" in modes else "heads")


class Bodies:
    """The op-body side of a quantize pass (`owner`: quantize._Pass)."""

    def __init__(self, owner):
        self.p = owner
        self.functions = {(f.domain, f.name, f.overload): f for f in owner.proto.functions}
        self.specs: dict[tuple, _Spec] = {}
        self.values: dict[tuple, list[str]] = {}  # (call's initializers, boundary name) -> initializer names

    def call(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        f = self.functions.get((node.domain, node.op_type, node.overload))
        if f is None:
            return None
        positions = tuple(i for i, x in enumerate(node.input) if x in self.p.inits)
        if not any(self.p.weight(node.input[i]) is not None for i in positions):
            return None
        key = (node.domain, node.op_type, node.overload, positions)
        spec = self.specs.get(key)
        if spec is None:
            base = node.overload or ""
            n_same = sum(1 for k in self.specs if k[:3] == key[:3])
            overload = f"{base}.{self.p.scheme.name}" if base else self.p.scheme.name
            spec = self.specs[key] = _Spec(f, positions, overload + (f".{n_same}" if n_same else ""))
        values = self._evaluate(spec, node)
        if spec.quantized is None:
            frozen = {f.input[i] for i in positions if node.input[i] in self.p.routers}
            spec.decide(values, frozen)
        feeds = [x for i, x in enumerate(node.input) if i not in positions]
        sources = tuple(node.input[i] for i in positions)
        for v in spec.boundary:
            cached = self.values.get((sources, v, spec.overload))
            if cached is None:
                stem = f"{node.name or node.op_type}.{v}"
                if v in spec.quantized:
                    w = values[v]
                    if spec.quantized[v] == "heads":
                        q, s = int8_columns(w)
                    else:  # one scale per column, over every head
                        q, s = int8_columns(w, axis=tuple(range(w.ndim - 1)))
                        s = s.reshape(-1)
                    cached = [self.p.add(self.p.name(f"{stem}.int8"), q), self.p.add(self.p.name(f"{stem}.scale"), s)]
                    self.p.counts["op_body_tensors"] += 1
                else:
                    cached = [self.p.add(self.p.name(stem), values[v])]
                self.values[(sources, v, spec.overload)] = cached
            feeds += cached
        call = helper.make_node(node.op_type, feeds, list(node.output), name=node.name, domain=DOMAIN)
        call.attribute.extend(node.attribute)
        call.metadata_props.extend(node.metadata_props)
        call.overload = spec.overload
        return [call]

    def _evaluate(self, spec: _Spec, node: onnx.NodeProto) -> dict[str, np.ndarray]:
        """The boundary tensors of `spec`'s cone for this call's initializers."""
        from onnx.reference import ReferenceEvaluator

        f = spec.f
        attrs = {a.name: a for a in node.attribute}
        defaults = {a.name: a for a in f.attribute_proto}
        nodes = []
        for n in spec.evaluated:
            m = onnx.NodeProto()
            m.CopyFrom(n)
            del m.attribute[:]
            for a in n.attribute:
                if a.ref_attr_name:
                    given = attrs.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
                    if given is None:
                        continue
                    b = onnx.AttributeProto()
                    b.CopyFrom(given)
                    b.name = a.name
                    m.attribute.append(b)
                else:
                    m.attribute.append(a)
            nodes.append(m)
        inits = []
        for i in spec.positions:
            t = onnx.TensorProto()
            t.CopyFrom(self.p.inits[node.input[i]])
            t.name = f.input[i]
            inits.append(t)
        outs = [helper.make_tensor_value_info(v, TensorProto.UNDEFINED, None) for v in spec.boundary]
        graph = helper.make_graph(nodes, "cone", [], outs, initializer=inits)
        model = helper.make_model(graph, opset_imports=list(f.opset_import))
        try:
            got = ReferenceEvaluator(model).run(None, {})
        except Exception as e:
            raise ExportError(f"quantizing {node.op_type}: its weight layout could not be evaluated "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); export without --quantize "
                              "and report this") from e
        return {v: np.asarray(x) for v, x in zip(spec.boundary, got)}

    def finish(self) -> None:
        """Add the specialised bodies; drop the fp32 bodies no call reads any more."""
        made = []
        for spec in self.specs.values():
            f = spec.f
            g = onnx.FunctionProto()
            g.domain, g.name, g.overload = DOMAIN, f.name, spec.overload
            ins = [x for i, x in enumerate(f.input) if i not in spec.positions]
            pairs = {}
            for v in spec.boundary:
                if v in spec.quantized:
                    pairs[v] = (f"{v}.int8", f"{v}.scale")
                    ins += list(pairs[v])
                else:
                    ins.append(v)
            g.input.extend(ins)
            g.output.extend(f.output)
            g.attribute.extend(f.attribute)
            g.attribute_proto.extend(f.attribute_proto)
            g.opset_import.extend(f.opset_import)
            g.node.extend(self._rewrite(spec.rest, pairs, {v for v, m in spec.quantized.items() if m == "heads"}))
            made.append(g)
        called = set()
        for g in self._all_graphs():
            called |= {(n.domain, n.op_type, n.overload) for n in _walk(g.node)}
        for f in made:
            called |= {(n.domain, n.op_type, n.overload) for n in _walk(f.node)}
        keep = [f for f in self.p.proto.functions if (f.domain, f.name, f.overload) in called]
        del self.p.proto.functions[:]
        self.p.proto.functions.extend(keep + made)
        if made and not any(o.domain == DOMAIN for o in self.p.proto.opset_import):
            self.p.proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))

    def _all_graphs(self):
        yield self.p.proto.graph

    def _rewrite(self, nodes, pairs: dict[str, tuple[str, str]], heads: set[str]) -> list[onnx.NodeProto]:
        """`nodes` with the quantized tensors (`pairs`: name -> its int8 tensor and scales; `heads`: those
        whose scales are per head and column) read in int8 and their MatMuls on integers."""
        out = []
        for n in nodes:
            if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in pairs:
                q, s = pairs[n.input[1]]
                out += self.p.int8_matmul(n.input[0], q, s, n.output[0], f"{n.name or n.output[0]}.int8", fused=False)
                continue
            if n.op_type in ("Gather", "Reshape") and n.input[0] in pairs:
                (q, s), o = pairs[n.input[0]], n.output[0]
                # a Gather selects heads of the int8 tensor and, per head and column, of its scales; one
                # scale per column ([N]) stays as it is
                per_head = n.op_type == "Gather" and n.input[0] in heads
                pairs[o] = (f"{o}.int8", f"{o}.scale" if per_head else s)
                for src, dst in ((q, pairs[o][0]),) + (((s, pairs[o][1]),) if per_head else ()):
                    g = helper.make_node(n.op_type, [src] + list(n.input[1:]), [dst], name=f"{n.name or o}.{dst}")
                    g.attribute.extend(n.attribute)
                    out.append(g)
                    if per_head:
                        heads.add(o)
                continue
            m = onnx.NodeProto()
            m.CopyFrom(n)
            for a in m.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    rewritten = self._rewrite(a.g.node, pairs, heads)
                    del a.g.node[:]
                    a.g.node.extend(rewritten)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        rewritten = self._rewrite(sub.node, pairs, heads)
                        del sub.node[:]
                        sub.node.extend(rewritten)
            out.append(m)
        return out
