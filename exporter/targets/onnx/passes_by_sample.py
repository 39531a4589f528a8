"""attention_by_sample: a large batch's attention (softmax(q k^T + bias) v over (B, H, T, S) scores
of at least policy.by_sample_from floats (graphs/ops/policy.py), B > 1) runs a sample at a time in a
Loop, behind an If on the call's size: each sample's scores stay in cache between the kernels that
read them. The ONNX artifacts' bodies do the same (bodies.by_sample); the dense candidates get the
pass too, so it is no adaptive win. The If costs a call that stays batched, so an artifact leaves
the pass out where its calls are small (a decoder's main graph, which serves decode steps; see
export()).
"""
from __future__ import annotations

import onnx

from adaptex.exporter.targets.onnx.passes import _axis, _producers_readers, _shapes, subgraphs
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy

_ELEMENTWISE = ("Add", "Sub", "Mul", "Div")


def attention_by_sample(proto: onnx.ModelProto, policy: OrtPolicy = DEFAULT) -> int:
    """Rewrite, in place, each main-graph attention MatMul(q, k^T) -> [Add, Sub, Mul or Div with
    another operand]... -> Softmax(last axis) -> MatMul(., v) over 4-D tensors, each value read only
    by the next, into If(bodies.large_batch) -> a Loop over axis 0 (a sample a time) | the nodes as
    they were. A Transpose that makes k^T and is read only by the MatMul goes with them (so ONNX
    Runtime still fuses it into the MatMul). A 4-D operand whose first axis may be 1 (a mask shared by
    the batch) is broadcast; one that a Gather (axis 0) or GatherND (batch_dims 0) makes, read only
    by the chain, with indices whose first axis is the batch (elastic decoders' masked short-call
    program: each head's bias plane picked by its mode, _per_sample_gather), goes with them too, and
    the Loop gathers a sample's planes by its own indices: the (B, H, T, S) tensor is never made.
    Returns how many it rewrote."""
    from adaptex.exporter.targets.onnx.bodies.builder import _Body, _name_output
    from adaptex.exporter.targets.onnx.bodies.by_sample import large_batch

    g = proto.graph
    shapes = _shapes(proto)
    producers, readers = _producers_readers(g)
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def rank4(v: str) -> bool:
        return len(shapes.get(v) or ()) == 4

    def only(v: str):  # the node that alone reads v, or None
        c = consumers.get(v, [])
        return c[0] if readers.get(v) == 1 and len(c) == 1 else None

    def chain_of(sm):  # (the chain's nodes in order, q, the keys value and its key axis) or None
        m2 = only(sm.output[0])
        if not (m2 is not None and m2.op_type == "MatMul" and m2.input[0] == sm.output[0] and rank4(m2.input[1])):
            return None
        nodes, cur = [sm, m2], sm.input[0]
        for _ in range(4):
            p = producers.get(cur)
            if p is None or only(cur) is not nodes[0] or p.domain not in ("", "ai.onnx"):
                return None
            nodes.insert(0, p)
            if p.op_type == "MatMul":
                break
            if p.op_type not in _ELEMENTWISE:
                return None
            ins = [i for i in p.input if producers.get(i) is not None and readers.get(i) == 1
                   and producers[i].op_type in ("MatMul",) + _ELEMENTWISE]
            if not ins:
                return None
            cur = next((i for i in ins if producers[i].op_type == "MatMul"), ins[0])  # the scores, not a mask
        else:
            return None
        m1 = nodes[0]
        if m1.op_type != "MatMul" or not (rank4(m1.input[0]) and rank4(m1.input[1])):
            return None
        keys, axis = m1.input[1], 3
        t = producers.get(keys)
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None) if t is not None else None
        if t is not None and t.op_type == "Transpose" and only(keys) is m1 and perm and perm[0] == 0 and rank4(t.input[0]):
            nodes.insert(0, t)
            keys, axis = t.input[0], perm[3]
        return nodes, m1.input[0], keys, axis

    taken = {o for n in g.node for o in n.output} | {i.name for i in g.initializer} | {i.name for i in g.input}
    infos = {vi.name: vi for vi in g.value_info}
    rewritten, drop, inner, count = {}, set(), set(), 0
    for sm in list(g.node):
        if sm.op_type != "Softmax" or sm.domain not in ("", "ai.onnx") or not rank4(sm.output[0]) or _axis(sm) not in (-1, 3):
            continue
        found = chain_of(sm)
        if found is None or any(id(n) in drop for n in found[0]):
            continue
        nodes, q, keys, axis = found
        gathers = {id(p) for p in (_per_sample_gather(v, nodes, producers, only, shapes, shapes[q][0])
                                   for n in nodes for v in n.input if rank4(v)) if p is not None}
        nodes = [n for n in g.node if id(n) in gathers] + nodes  # in graph order, before the chain
        count += 1
        stem = f"by_sample{count}_"
        while any(n.startswith(stem) for n in taken):
            stem = "_" + stem
        made = {o for n in nodes for o in n.output}
        operands = list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in made))
        out = nodes[-1].output[0]
        b = _Body(stem, policy)

        whole = {x for n in nodes if id(n) in gathers for x in n.input}  # a gather's data and indices

        def one(i: str) -> str:  # sample i of every 4-D operand (the first axis of a mask may be 1)
            i1 = b("Unsqueeze", i, b.const([0]))
            rename = {}
            for v in operands:
                if not rank4(v) or v in whole:
                    continue
                s0 = shapes[v][0]
                at = i1 if s0 is not None and s0 == shapes[q][0] and s0 != 1 else \
                    b("Min", i1, b("Sub", b("Shape", v, start=0, end=1), b.const([1])))
                rename[v] = b("Slice", v, at, b("Add", at, b.const([1])), b.const([0]))
            for n in nodes:
                c = onnx.NodeProto()
                c.CopyFrom(n)
                c.name = f"{stem}{n.name}" if n.name else ""
                if id(n) in gathers:  # the sample's own indices: its (1, ...) planes
                    rename[n.input[1]] = b("Slice", n.input[1], i1, b("Add", i1, b.const([1])), b.const([0]))
                c.input[:] = [rename.get(x, x) for x in n.input]
                for k, o in enumerate(n.output):
                    rename[o] = c.output[k] = f"{stem}{o}"
                b.nodes.append(c)
            return b("Squeeze", rename[out], b.const([0]))

        def batched() -> str:
            b.nodes.extend(nodes[:-1])
            last = onnx.NodeProto()
            last.CopyFrom(nodes[-1])
            last.output[0] = f"{stem}batched"
            b.nodes.append(last)
            return last.output[0]

        result = b.if_(large_batch(b, q, keys, axis), lambda: b.loop_(b("Squeeze", b("Shape", q, start=0, end=1),
                                                                        b.const([0])), one), batched)
        _name_output(b, result, out)
        # the moved values' shapes go with them (ONNX Runtime's fusions check shapes in a branch too)
        next(a.g for a in b.nodes[-1].attribute if a.name == "else_branch").value_info.extend(
            infos[o] for n in nodes for o in n.output if o != out and o in infos)
        inner |= made - {out}
        drop |= {id(n) for n in nodes}
        rewritten[id(nodes[-1])] = b.nodes
        taken |= {o for n in b.nodes for o in n.output}
    if not count:
        return 0
    new = []
    for n in g.node:
        if id(n) in rewritten:
            new += rewritten[id(n)]
        elif id(n) not in drop:
            new.append(n)
    kept_info = [vi for vi in g.value_info if vi.name not in inner]
    del g.node[:]
    g.node.extend(new)
    del g.value_info[:]
    g.value_info.extend(kept_info)
    return count


def _per_sample_gather(v: str, chain: list, producers: dict, only, shapes: dict, batch):
    """The node that makes `v`, an operand of an attention chain, where a by-sample Loop can make
    sample i's slice of it by gathering with sample i's indices: a Gather on axis 0 or a GatherND
    with batch_dims 0, read only by the chain, whose indices' first axis is the batch (the same
    dimension as q's, a symbol or a number other than 1) and, for GatherND, whose index tuples pick
    along the data's first axis only, its data and indices read by no node of the chain (the Loop
    reads them whole); None otherwise."""
    p = producers.get(v)
    if p is None or p.domain not in ("", "ai.onnx") or p.op_type not in ("Gather", "GatherND") \
            or not any(only(v) is n for n in chain) or any(x in n.input for n in chain for x in p.input):
        return None
    attrs = {a.name: a.i for a in p.attribute}
    idx = shapes.get(p.input[1]) or ()
    if attrs.get("axis" if p.op_type == "Gather" else "batch_dims", 0) != 0 or len(idx) < 2:
        return None
    if p.op_type == "GatherND" and idx[-1] != 1:
        return None
    return p if batch is not None and batch != 1 and idx[0] == batch else None


def by_sample_ifs(nodes) -> int:
    """How many of `nodes` are attention_by_sample's Ifs (a Loop over the samples in the then branch)."""
    return sum(n.op_type == "If" and any(a.name == "then_branch" and a.g.node and a.g.node[-1].op_type == "Loop"
                                         for a in n.attribute) for n in nodes)


def attends_by_sample(proto: onnx.ModelProto) -> bool:
    """Whether `proto` attends a sample at a time anywhere for a large call: an attention_by_sample
    If in its main graph, or bodies.by_sample's in an op body (inside the body's own Ifs too)."""
    def walk(nodes) -> bool:
        return by_sample_ifs(nodes) > 0 or any(walk(g.node) for n in nodes for g in subgraphs(n))
    return walk(proto.graph.node) or any(walk(f.node) for f in proto.functions)
