"""Run-time dispatch at the top of an artifact's graph (ONNX Runtime): one If over two graphs of the
same weights, nested where a graph is itself such an If, so that an artifact holds several programs.
Which one a call runs is a decision list of guards (exporter/targets/onnx/guards.py): each merge
builds its If's condition from the guard it is given, and the exporter stores the guards in the
metadata, where the runner, parity and bench read them. Its uses:

- dense dispatch (`merge`, `--dense-rows N`): the sparse and the dense lowering of one trace; the
  dense graph runs the calls of at most N token rows, where the adaptive bodies' run-time decisions
  cost more than the work they skip; a decoder's decode steps among them run the dense lowering
  without the softmax floor, one If further out (`merge_dense_step`);
- the large-call graph (`merge_large_call`, a decoder's): the lowering with attention by sample, for
  the calls that reach its threshold, beside the general graph without those Ifs;
- the short-call graphs (`merge_short_call`, an elastic decoder's): prefills within, or a little
  past, the streaming heads' reach;
- the decode-step graph (`merge_decode_step`, `--decode-graph`, an elastic decoder's default): the
  model traced a second time for a decode step (one new token after a non-empty cache), with the
  ops' step bodies. ONNX Runtime's common-subexpression elimination does not merge what the
  inlined op bodies make alike inside a branch, so what every layer's body would compute alike
  (the positions a step's SA pairs read) is computed in the step graph instead, once
  (fx.STEP_SHARED).

The weights are stored once, as initializers of the main graph, and each branch reads them through
a pair of Reshapes (to one axis and back) that ONNX Runtime's constant folding turns into
initializers of that branch when the session loads (a tensor of at most policy.copied_up_to
elements is copied into the branch instead): an If whose branch reads main-graph initializers
directly pays for them on every call. The price is memory: a loaded session holds a copy of the
weights per branch; the file holds one. The runner does not pay it: it runs each program as a
session of its own (programs.program).

Both branches compute the same outputs, decisions included, to the parity tolerance of the two
variants (each is checked against the eager reference by `adaptex check`). The dense branch holds
its op calls inlined and its common subexpressions merged (passes.shared_subexpressions: ONNX
Runtime does neither inside a branch), so the artifact's functions are the sparse lowering's; a
gate the router has masked already is not masked again there (passes.masks_once).
"""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import helper, numpy_helper

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx import guards
from adaptex.exporter.targets.onnx.guards import Guard
from adaptex.exporter.targets.onnx.passes import (masks_once, reads, rename_outputs, rename_reads, renamed,
                                                  shared_subexpressions, subgraphs)
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy

DENSE_OVERLOAD = "dense"
STEP_OVERLOAD = "step"
SHORT_OVERLOAD = "short"
MASKED_OVERLOAD = "masked"
LARGE_OVERLOAD = "large"
RESERVED = "dispatch."  # prefix of the merged graph's own values and of the branches' renamed values


def _local_weights(nodes: list, initializers, tag: str, copied_up_to: int) -> tuple[list, list]:
    """Point the reads of the main graph's `initializers` in `nodes` (subgraphs included) at branch
    values `dispatch.<tag>.w.<name>`, each made by Reshape to one axis and Reshape back: ONNX Runtime
    folds the pair into an initializer of the branch at load (see the module docstring); one of at
    most `copied_up_to` elements (policy.copied_up_to) is copied into the branch instead. Returns the
    fold nodes and the
    branch's own initializers (the shapes and the copies). Empty tensors are read as they are."""
    read = set(reads(nodes))
    weights = [w for w in initializers if w.name in read and 0 not in w.dims]
    if not weights:
        return [], []
    local = {w.name: f"{RESERVED}{tag}.w.{w.name}" for w in weights}
    rename_reads(nodes, local)
    flat = numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{RESERVED}{tag}.one_axis")
    inits, fold = [flat], []
    for w in weights:
        if int(np.prod(w.dims)) <= copied_up_to:
            inits.append(renamed(w, local[w.name]))
            continue
        shape = numpy_helper.from_array(np.array(w.dims, dtype=np.int64), f"{RESERVED}{tag}.shape.{w.name}")
        inits.append(shape)
        fold += [helper.make_node("Reshape", [w.name, flat.name], [f"{local[w.name]}.flat"],
                                  name=f"{RESERVED}{tag}.fold.{w.name}.flat"),
                 helper.make_node("Reshape", [f"{local[w.name]}.flat", shape.name], [local[w.name]],
                                  name=f"{RESERVED}{tag}.fold.{w.name}")]
    return fold, inits


def _overload(tag: str | None, current: str) -> str:
    """A call's overload in a branch tagged `tag`: the tag, before the one it had (a body
    specialised to its head count, `heads8`, is `step_heads8` in the branch tagged step)."""
    return current if tag is None else (f"{tag}_{current}" if current else tag)


def _point_calls(nodes, overload: str | None, domain: str) -> None:
    """Point the adaptex calls among `nodes` (subgraphs included) at `overload`."""
    for node in nodes:
        if node.domain == domain:
            node.overload = _overload(overload, node.overload)
        for g in subgraphs(node):
            _point_calls(g.node, overload, domain)


def branch(graph: onnx.GraphProto, tag: str, outputs: list[onnx.ValueInfoProto], overload: str | None,
           domain: str, local_weights: bool = True, initializers=None,
           copied_up_to: int = DEFAULT.copied_up_to) -> onnx.GraphProto:
    """`graph`'s nodes as an If branch: every value its nodes produce renamed `dispatch.<tag>.<name>`
    (the If's outputs take the graph's output names), reads of inputs unchanged, reads of
    initializers (the main graph's: `graph`'s own unless given) through the branch's fold nodes
    (_local_weights; local_weights=False reads them from the main graph, which
    examples/if_branch_cost.py times), the adaptex calls pointed at `overload`."""
    nodes = [onnx.NodeProto() for _ in graph.node]
    for copy, node in zip(nodes, graph.node):
        copy.CopyFrom(node)
    rename = {o: f"{RESERVED}{tag}.{o}" for n in nodes for o in n.output if o}
    for i, node in enumerate(nodes):  # node names too: ORT's profiler then shows which branch ran
        node.name = f"{RESERVED}{tag}.{node.name or f'{node.op_type}_{i}'}"
        node.output[:] = [rename.get(o, o) for o in node.output]
    _point_calls(nodes, overload, domain)
    rename_reads(nodes, rename)
    outs = []
    for vi in outputs:
        name = rename.get(vi.name)
        if name is None:  # an output that is an input or an initializer: a branch must produce it
            name = f"{RESERVED}{tag}.{vi.name}"
            nodes.append(helper.make_node("Identity", [vi.name], [name]))
        outs.append(helper.make_tensor_value_info(name, vi.type.tensor_type.elem_type, None))
    inits = graph.initializer if initializers is None else initializers
    fold, own = _local_weights(nodes, inits, tag, copied_up_to) if local_weights else ([], [])
    return helper.make_graph(fold + nodes, f"{RESERVED}{tag}", [], outs, initializer=own,
                             value_info=_renamed_shapes(graph.value_info, rename))


def _renamed_shapes(value_info, rename: dict) -> list[onnx.ValueInfoProto]:
    """The exporter's shapes of the values a branch makes, under their branch names. ONNX Runtime's
    fusions that check a shape (GatherSliceToSplitFusion: the Slices of a split projection into one
    Split) do not fire in a branch that carries none: tsa-charlm's dense branch kept 13 Slices where
    its graph alone runs 6 Splits."""
    return [renamed(vi, rename[vi.name]) for vi in value_info if vi.name in rename]


def _produced(nodes) -> list[str]:
    """Every value `nodes` make, their subgraphs' included."""
    out = []
    for n in nodes:
        out += [o for o in n.output if o]
        for g in subgraphs(n):
            out += _produced(g.node)
    return out


def _digest(inits) -> dict:
    return {i.name: hashlib.sha256(i.SerializeToString()).hexdigest() for i in inits}


def _content(t: onnx.TensorProto) -> str:
    """A digest of a tensor's type, shape and values, whatever its name."""
    return hashlib.sha256(renamed(t, "").SerializeToString()).hexdigest()


def _same_io(a: onnx.GraphProto, b: onnx.GraphProto, what: str) -> None:
    for side, x, y in (("inputs", a.input, b.input), ("outputs", a.output, b.output)):
        if [v.name for v in x] != [v.name for v in y]:
            raise ExportError(f"the {what} differ in their {side}; export one of them alone")
    taken = [n for n in [v.name for v in a.input] + [i.name for i in a.initializer] if n.startswith(RESERVED)]
    if taken:
        raise ExportError(f"dispatch: the graph already has a value named {taken[0]!r}")


def _same_bodies(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """Whether two lowerings carry the same function bodies."""
    return sorted(f.SerializeToString() for f in a.functions) == sorted(f.SerializeToString() for f in b.functions)


def _if_model(then: onnx.ModelProto, other: onnx.ModelProto, *, tags: tuple[str, str], overload: str | None,
              cond_nodes: list, cond: str, initializers: list, then_initializers: list, domain: str,
              other_local: bool = True, policy: OrtPolicy = DEFAULT) -> onnx.ModelProto:
    """One model whose graph is an If on `cond` (made by `cond_nodes`) over `then`'s graph (its
    adaptex calls and bodies given the overload `overload`; None: the calls keep `other`'s bodies,
    which must be then's) and `other`'s, with `initializers` in the main graph (what both branches
    read, `then_initializers` those then's graph reads).
    other_local=False: `other`'s graph reads the main graph's weights as it is (a merged model whose
    own branches fold their copies: ONNX Runtime folds them from two scopes up too)."""
    outputs = list(other.graph.output)
    then_g = branch(then.graph, tags[0], outputs, overload, domain, initializers=then_initializers,
                    copied_up_to=policy.copied_up_to)
    else_g = branch(other.graph, tags[1], outputs, None, domain, local_weights=other_local,
                    initializers=other.graph.initializer, copied_up_to=policy.copied_up_to)
    nodes = cond_nodes + [helper.make_node("If", [cond], [o.name for o in outputs], name=f"{RESERVED}If",
                                           then_branch=then_g, else_branch=else_g)]
    read = set(reads(nodes))  # a small initializer every branch copied is read by none (ORT would warn)
    graph = helper.make_graph(nodes, other.graph.name, list(other.graph.input), outputs,
                              initializer=[t for t in initializers if t.name in read])
    graph.doc_string = other.graph.doc_string
    if overload is None and not _same_bodies(then, other):
        raise ExportError(f"the {tags[0]} and {tags[1]} lowerings differ in their op bodies; export one of them")
    model = helper.make_model(graph, opset_imports=list(other.opset_import), ir_version=other.ir_version)
    known = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in then.opset_import if o.domain not in known)
    model.functions.extend(other.functions)
    for f in then.functions if overload is not None else ():  # None: the calls keep other's bodies
        copy = onnx.FunctionProto()
        copy.CopyFrom(f)
        if f.domain == domain:
            copy.overload = _overload(overload, f.overload)
        model.functions.append(copy)
    return model


def _share_weights(then: onnx.ModelProto, other: onnx.GraphProto, tag: str) -> tuple[onnx.ModelProto, list, list]:
    """`then` (another trace of the model `other` was traced from) with its initializers equal to
    one of `other`'s (a weight) read from that one: returns (then with its reads renamed, the
    initializers of both, stored once, those `then` reads). An initializer that shares a name but
    not its values (a trace's constant) with one of `other`'s, or its name with a value `other`
    makes (a constant the exporter folded, named as its values are: it would sit in the main graph
    above that value's branch), is renamed `dispatch.<tag>.c.<name>`."""
    gt = then.graph
    by_content = {_content(t): t.name for t in other.initializer}
    names = {t.name for t in other.initializer}
    graph = onnx.GraphProto()
    graph.CopyFrom(gt)
    # a value the graph makes under a name of `other`'s initializers would shadow that
    # initializer in the branch: such values take a reserved name first (none is an output)
    outputs = {o.name for o in gt.output}
    shadow = {v: f"{RESERVED}{tag}.v.{v}" for v in _produced(graph.node) if v in names and v not in outputs}
    if shadow:
        rename_outputs(graph.node, shadow)
        rename_reads(graph.node, shadow)
    inits, rename, made = list(other.initializer), {}, set(_produced(other.node))
    for t in gt.initializer:
        same = by_content.get(_content(t))
        if same is not None:
            rename[t.name] = same
            continue
        if t.name in names or t.name in made:
            rename[t.name] = f"{RESERVED}{tag}.c.{t.name}"
        copy = renamed(t, rename.get(t.name, t.name))
        inits.append(copy)
        names.add(copy.name)
    rename_reads(graph.node, rename)
    model = onnx.ModelProto()
    model.CopyFrom(then)
    model.graph.CopyFrom(graph)
    read = {rename.get(t.name, t.name) for t in gt.initializer}
    return model, inits, [t for t in inits if t.name in read]


def _condition(graph: onnx.GraphProto, guard: Guard, tag: str, what: str) -> tuple[list, list, str]:
    """The nodes computing `guard` in the main graph, their constants and the bool's name (values
    named dispatch.guard.<tag>.*); refuses a graph without an input the guard reads, of enough axes."""
    need: dict[str, int] = {}

    def walk(g) -> None:
        for p in getattr(g, "parts", ()):
            walk(p)
        for a in getattr(g, "axes", ()):
            need[a.input] = max(need.get(a.input, 0), a.axis + 1)
    walk(guard)
    for name, axes in need.items():
        vi = next((v for v in graph.input if v.name == name), None)
        if vi is None or len(vi.type.tensor_type.shape.dim) < axes:
            raise ExportError(f"{what} dispatch: the graph has no input {name!r} of rank {axes} or more")
    return guards.nodes(guard, f"{RESERVED}guard.{tag}.")


def merge(sparse: onnx.ModelProto, dense: onnx.ModelProto, *, guard: Guard, domain: str = "adaptex",
          policy: OrtPolicy = DEFAULT) -> onnx.ModelProto:
    """One model that runs `dense`'s graph where `guard` holds (guards.rows_at_most: the calls of at
    most dense_rows token rows) and `sparse`'s otherwise. Both must be lowerings of one trace: the
    same inputs, outputs and initializers. `sparse` may be a merged model itself
    (merge_large_call's): its If then sits in the sparse branch."""
    gs, gd = sparse.graph, dense.graph
    _same_io(gd, gs, "dense and sparse lowerings")
    # a merged sparse model keeps in its main graph only what its branches read from there: the
    # small tensors each branch copied (policy.copied_up_to) come from the dense lowering's
    stored = _digest(t for t in gs.initializer if not t.name.startswith(RESERVED))
    own = _digest(gd.initializer)
    copied = [t for t in gd.initializer if t.name not in stored and np.prod(t.dims) <= policy.copied_up_to] \
        if _dispatches(sparse) else []
    if stored != {k: v for k, v in own.items() if k not in {t.name for t in copied}}:
        raise ExportError("the sparse and dense lowerings differ in their weights; export one variant")
    cond_nodes, consts, cond = _condition(gs, guard, "dense", "dense")
    # the dense branch's calls inlined, their common work merged and the gate masked once
    # (passes.shared_subexpressions, passes.masks_once)
    dense = shared_subexpressions(dense)
    masks_once(dense)
    return _if_model(dense, sparse, tags=("dense", "sparse"), overload=DENSE_OVERLOAD,
                     cond_nodes=cond_nodes, cond=cond, initializers=list(gs.initializer) + copied + consts,
                     then_initializers=list(gs.initializer) + copied, domain=domain,
                     other_local=not _dispatches(sparse), policy=policy)


def merge_dense_step(step: onnx.ModelProto, merged: onnx.ModelProto, *, guard: Guard, domain: str = "adaptex",
                     policy: OrtPolicy = DEFAULT) -> onnx.ModelProto:
    """One model that runs `step`'s graph (a decoder's dense lowering without passes.softmax_floor)
    where `guard` holds (one new token and at most dense_rows token rows), and `merged` (merge's
    model: the dense lowering with the floor for the other small calls, the sparse one above) for
    every other call. A step scores one query row a sample, where nothing but padding is masked, so
    the floor's three kernels a layer only cost it. `step` is another lowering of the trace
    `merged` was lowered from: its weights are stored once."""
    _same_io(step.graph, merged.graph, "dense step and dense lowerings")
    step = shared_subexpressions(step)  # as merge does the dense branch's
    masks_once(step)
    step_model, inits, read = _share_weights(step, merged.graph, "dense_step")
    cond_nodes, consts, cond = _condition(merged.graph, guard, "dense_step", "dense step")
    return _if_model(step_model, merged, tags=("dense_step", "general"), overload=DENSE_OVERLOAD,
                     cond_nodes=cond_nodes, cond=cond, initializers=inits + consts,
                     then_initializers=read, domain=domain, other_local=False, policy=policy)


def merge_decode_step(step: onnx.ModelProto, general: onnx.ModelProto, *, guard: Guard, domain: str = "adaptex",
                      policy: OrtPolicy = DEFAULT) -> onnx.ModelProto:
    """One model that runs `step`'s graph (a decoder's decode-step program) where `guard` holds
    (guards.decode_step: one new token after a non-empty cache), `general`'s for every other call.
    The two are traces of one model: an initializer of the step graph equal to one of the general
    graph's (a weight) is stored once; one that shares a name but not its values (a trace's
    constant) is renamed. `general` may itself be a merged model (merge_short_call's): its
    branches then keep their own copies of the weights, folded from the main graph's."""
    gs, gg = step.graph, general.graph
    _same_io(gs, gg, "decode-step and general graphs")
    step_model, inits, read = _share_weights(step, gg, "step")
    cond_nodes, consts, cond = _condition(gg, guard, "step", "decode-step")
    return _if_model(step_model, general, tags=("step", "general"), overload=STEP_OVERLOAD,
                     cond_nodes=cond_nodes, cond=cond, initializers=inits + consts,
                     then_initializers=read, domain=domain, other_local=not _dispatches(general), policy=policy)


SHORT_TAGS = {"short": SHORT_OVERLOAD, "masked": MASKED_OVERLOAD, "masked_large": "masked_large"}


def merge_short_call(short: onnx.ModelProto, general: onnx.ModelProto, *, guard: Guard, tag: str = "short",
                     domain: str = "adaptex", policy: OrtPolicy = DEFAULT) -> onnx.ModelProto:
    """One model that runs `short`'s graph where `guard` holds, `general`'s for every other call.
    tag "short": a decoder's short-call program (a prefill within the streaming heads' reach, where
    every head attends as dense attention does); "masked": its masked short-call program (the
    streaming heads' keys beyond their reach masked, for the prefills a little longer);
    "masked_large": the masked program lowered with passes.attention_by_sample, for its large
    batches. Weights stored once, as in merge_decode_step."""
    if tag not in SHORT_TAGS:
        raise ExportError(f"short-call dispatch: tag {tag!r} is not one of {', '.join(SHORT_TAGS)}")
    what = {"short": "short-call", "masked": "masked short-call", "masked_large": "masked short-call (large)"}[tag]
    gs, gg = short.graph, general.graph
    _same_io(gs, gg, f"{what} and general graphs")
    short_model, inits, read = _share_weights(short, gg, tag)
    cond_nodes, consts, cond = _condition(gg, guard, tag, what)
    return _if_model(short_model, general, tags=(tag, "long"), overload=SHORT_TAGS[tag],
                     cond_nodes=cond_nodes, cond=cond, initializers=inits + consts, then_initializers=read,
                     domain=domain, other_local=not _dispatches(general), policy=policy)


def merge_large_call(large: onnx.ModelProto, general: onnx.ModelProto, *, guard: Guard, domain: str = "adaptex",
                     policy: OrtPolicy = DEFAULT) -> onnx.ModelProto:
    """One model that runs `large`'s graph (the same lowering with passes.attention_by_sample: each
    attention behind an If that runs it a sample at a time when the call is large) where `guard`
    holds (guards.large_call: the condition each layer's If evaluates where every layer has that
    many heads, so the large program's layers all attend by sample), and `general`'s (the attention
    batched, no If a layer) for every other call: a decode step or a short prompt pays no If a
    layer. Both lowerings of one trace: the same weights, stored once. Where the op bodies differ
    (the general program's without their own by-sample Ifs), the large program's calls read theirs
    as the overload LARGE_OVERLOAD."""
    gl, gg = large.graph, general.graph
    _same_io(gl, gg, "large-call and general graphs")
    cond_nodes, consts, cond = _condition(gg, guard, "large", "large-call")
    if _digest(gl.initializer) != _digest(gg.initializer):
        raise ExportError("the large-call and general lowerings differ in their weights; export one of them")
    return _if_model(large, general, tags=("large", "general"),
                     overload=None if _same_bodies(large, general) else LARGE_OVERLOAD,
                     cond_nodes=cond_nodes, cond=cond, initializers=list(gg.initializer) + consts,
                     then_initializers=gl.initializer, domain=domain, policy=policy)


def _dispatches(proto: onnx.ModelProto) -> bool:
    """Whether `proto`'s graph is a merged model (its top a dispatch If)."""
    return any(n.op_type == "If" and n.name == f"{RESERVED}If" for n in proto.graph.node)


__all__ = ["merge", "merge_dense_step", "merge_decode_step", "merge_short_call", "merge_large_call",
           "DENSE_OVERLOAD", "STEP_OVERLOAD", "SHORT_OVERLOAD",
           "MASKED_OVERLOAD"]
