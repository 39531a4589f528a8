"""Run-time dispatch at the top of an artifact's graph (ONNX Runtime): one If over two graphs of the
same weights, nested where a graph is itself such an If. Its uses:

- dense dispatch (`merge`, `--dense-rows N`): the sparse and the dense lowering of one trace; the
  dense graph runs the small calls (below); a decoder's decode steps among them run the dense
  lowering without the softmax floor, one If further out (`merge_dense_step`);
- the large-call graph (`merge_large_call`, a decoder's): the lowering with attention by sample, for
  the calls that reach its threshold, beside the general graph without those Ifs (in the sparse
  branch of dense dispatch where there is one);
- the short-call graphs (`merge_short_call`, an elastic decoder's): prefills within, or a little
  past, the streaming heads' reach;
- the decode-step graph (`merge_decode_step`, `--decode-graph`, an elastic decoder's default): the
  model traced a second time for a decode step (one new token after a non-empty cache: no router,
  the ops' step bodies, SkipLayerNormalization; graphs.nn.record.traced_decode_step), which runs
  those calls, and the general graph, which runs every other. The If costs what ONNX Runtime does
  not share inside a branch: its common-subexpression elimination does not merge the Constant
  nodes that each inlined op body makes (nor what they feed) in a subgraph, as it does in the main
  graph, so what every layer's body would compute alike (the positions a step's SA pairs read) is
  computed in the step graph instead, once (fx.STEP_SHARED; docs/benchmarking.md#decode-steps).

Dense dispatch in detail:

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
initializers of that branch when the session loads (a tensor of at most COPIED_UP_TO elements is
copied into the branch instead). An If whose branch reads main-graph
initializers directly pays for them on every call: tsa-charlm's dense graph as a branch cost 46 to
53 us more a B1 decode step read directly, 5 to 7 us folded; elastic-charlm's 88 to 145 us against
18 to 52 us (ONNX Runtime 1.32, 1 thread; examples/if_branch_cost.py,
docs/benchmarking.md#never-slower-than-dense). The price is memory: a loaded session holds a copy
of the weights per branch (tsa-charlm: 71 MB peak RSS against the sparse artifact's 41); the file
holds one.

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
from adaptex.exporter.targets.onnx.passes import (masks_once, reads, rename_outputs, rename_reads, renamed,
                                                  shared_subexpressions, subgraphs)

DENSE_OVERLOAD = "dense"
STEP_OVERLOAD = "step"
NEAR_OVERLOAD = "near"
SHORT_OVERLOAD = "short"
MASKED_OVERLOAD = "masked"
LARGE_OVERLOAD = "large"
RESERVED = "dispatch."  # prefix of the merged graph's own values and of the branches' renamed values
# A main-graph initializer of at most this many elements (an axis list, a shape, a scalar) is copied
# into each branch that reads it rather than folded there: ONNX Runtime's fusions that want a
# constant input (GatherSliceToSplitFusion: the Slices of a split projection into one Split) run
# before the folding and do not see a folded one (elastic-charlm's short-call graph at B1, T = 32:
# 12 kernels more, about 4% of the call, with every initializer folded)
COPIED_UP_TO = 64


def _local_weights(nodes: list, initializers, tag: str) -> tuple[list, list]:
    """Point the reads of the main graph's `initializers` in `nodes` (subgraphs included) at branch
    values `dispatch.<tag>.w.<name>`, each made by Reshape to one axis and Reshape back: ONNX Runtime
    folds the pair into an initializer of the branch at load (see the module docstring); one of at
    most COPIED_UP_TO elements is copied into the branch instead. Returns the fold nodes and the
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
        if int(np.prod(w.dims)) <= COPIED_UP_TO:
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
           domain: str, local_weights: bool = True, initializers=None) -> onnx.GraphProto:
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
    fold, own = _local_weights(nodes, inits, tag) if local_weights else ([], [])
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
              other_local: bool = True) -> onnx.ModelProto:
    """One model whose graph is an If on `cond` (made by `cond_nodes`) over `then`'s graph (its
    adaptex calls and bodies given the overload `overload`; None: the calls keep `other`'s bodies,
    which must be then's) and `other`'s, with `initializers` in the main graph (what both branches
    read, `then_initializers` those then's graph reads).
    other_local=False: `other`'s graph reads the main graph's weights as it is (a merged model whose
    own branches fold their copies: ONNX Runtime folds them from two scopes up too)."""
    outputs = list(other.graph.output)
    then_g = branch(then.graph, tags[0], outputs, overload, domain, initializers=then_initializers)
    else_g = branch(other.graph, tags[1], outputs, None, domain, local_weights=other_local,
                    initializers=other.graph.initializer)
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


def _rows_at_most(rows_input: str, limit: str, prefix: str) -> tuple[list, str]:
    """Nodes that test whether a call's token rows (the product of `rows_input`'s first two axes:
    batch x sequence) are at most the value `limit`, and that bool's name (`<prefix>small`)."""
    shape, rows, small = f"{prefix}batch_sequence", f"{prefix}rows", f"{prefix}small"
    return [helper.make_node("Shape", [rows_input], [shape], name=f"{prefix}Shape", start=0, end=2),
            helper.make_node("ReduceProd", [shape], [rows], name=f"{prefix}ReduceProd", keepdims=0),
            helper.make_node("LessOrEqual", [rows, limit], [small], name=f"{prefix}LessOrEqual")], small


def merge(sparse: onnx.ModelProto, dense: onnx.ModelProto, *, rows_input: str, dense_rows: int,
          domain: str = "adaptex") -> onnx.ModelProto:
    """One model that runs `dense`'s graph when rows(rows_input) <= dense_rows and `sparse`'s
    otherwise, where rows is the product of rows_input's first two axes (batch x sequence). Both
    must be lowerings of one trace: the same inputs, outputs and initializers. `sparse` may be a
    merged model itself (merge_large_call's): its If then sits in the sparse branch."""
    gs, gd = sparse.graph, dense.graph
    if isinstance(dense_rows, bool) or not isinstance(dense_rows, int) or dense_rows < 1:
        raise ExportError(f"dense dispatch: dense_rows must be a whole number of at least 1, got {dense_rows!r}")
    _same_io(gd, gs, "dense and sparse lowerings")
    # a merged sparse model keeps in its main graph only what its branches read from there: the
    # small tensors each branch copied (COPIED_UP_TO) come from the dense lowering's
    stored = _digest(t for t in gs.initializer if not t.name.startswith(RESERVED))
    own = _digest(gd.initializer)
    copied = [t for t in gd.initializer if t.name not in stored and np.prod(t.dims) <= COPIED_UP_TO] \
        if _dispatches(sparse) else []
    if stored != {k: v for k, v in own.items() if k not in {t.name for t in copied}}:
        raise ExportError("the sparse and dense lowerings differ in their weights; export one variant")
    vi = next((v for v in gs.input if v.name == rows_input), None)
    if vi is None:
        raise ExportError(f"dense dispatch: {rows_input!r} is not an input of the graph")
    if len(vi.type.tensor_type.shape.dim) < 2:
        raise ExportError(f"dense dispatch: input {rows_input!r} has fewer than two axes (batch, sequence); "
                          "export without dense_rows")
    limit = numpy_helper.from_array(np.array(dense_rows, dtype=np.int64), f"{RESERVED}dense_rows")
    cond_nodes, small = _rows_at_most(rows_input, limit.name, RESERVED)
    # the dense branch's calls inlined, their common work merged and the gate masked once
    # (passes.shared_subexpressions, passes.masks_once)
    dense = shared_subexpressions(dense)
    masks_once(dense)
    return _if_model(dense, sparse, tags=("dense", "sparse"), overload=DENSE_OVERLOAD,
                     cond_nodes=cond_nodes, cond=small, initializers=list(gs.initializer) + copied + [limit],
                     then_initializers=list(gs.initializer) + copied, domain=domain, other_local=not _dispatches(sparse))


def merge_dense_step(step: onnx.ModelProto, merged: onnx.ModelProto, *, rows_input: str, dense_rows: int,
                     domain: str = "adaptex") -> onnx.ModelProto:
    """One model that runs `step`'s graph (a decoder's dense lowering without passes.softmax_floor)
    for a call of one new token (axis 1 of `rows_input`) and at most `dense_rows` token rows, and
    `merged` (merge's model: the dense lowering with the floor for the other calls of at most
    `dense_rows` rows, the sparse one above) for every other call. A step scores one query row a
    sample, where nothing but padding is masked, so the floor's three kernels a layer only cost it;
    a short prompt's causal mask sends an unfloored Softmax through subnormal floats
    (docs/benchmarking.md#never-slower-than-dense). `step` is another lowering of the trace `merged`
    was lowered from: its weights are stored once."""
    _same_io(step.graph, merged.graph, "dense step and dense lowerings")
    step = shared_subexpressions(step)  # as merge does the dense branch's
    masks_once(step)
    step_model, inits, read = _share_weights(step, merged.graph, "dense_step")
    prefix = f"{RESERVED}dense_step_"  # the If's own values (not "dense_step.": the branch's)
    limit, one = (numpy_helper.from_array(np.array(v, dtype=np.int64), f"{prefix}{n}")
                  for v, n in ((dense_rows, "rows_limit"), (1, "one")))
    new_nodes, new = _squeezed_axis(rows_input, 1, "dense_step_new")
    rows_nodes, small = _rows_at_most(rows_input, limit.name, prefix)
    cond_nodes = new_nodes + rows_nodes + [
        helper.make_node("Equal", [new, one.name], [f"{prefix}one_new"], name=f"{prefix}Equal"),
        helper.make_node("And", [small, f"{prefix}one_new"], [f"{prefix}is_step"], name=f"{prefix}And"),
    ]
    return _if_model(step_model, merged, tags=("dense_step", "general"), overload=DENSE_OVERLOAD,
                     cond_nodes=cond_nodes, cond=f"{prefix}is_step", initializers=inits + [limit, one],
                     then_initializers=read, domain=domain, other_local=False)


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


def _has_inputs(graph: onnx.GraphProto, what: str, wanted) -> None:
    """Refuse a graph without each (name, rank) input of `wanted` (rank at least)."""
    for name, axes in wanted:
        vi = next((v for v in graph.input if v.name == name), None)
        if vi is None or len(vi.type.tensor_type.shape.dim) < axes:
            raise ExportError(f"{what} dispatch: the graph has no input {name!r} of rank {axes} or more")


def _squeezed_axis(name: str, axis: int, tag: str) -> tuple[list, str]:
    """Nodes that read the length of `name`'s axis `axis` as a scalar, and that scalar's name."""
    one, out = f"{RESERVED}{tag}.1", f"{RESERVED}{tag}"
    return [helper.make_node("Shape", [name], [one], name=f"{RESERVED}Shape_{tag}", start=axis, end=axis + 1),
            helper.make_node("Squeeze", [one], [out], name=f"{RESERVED}Squeeze_{tag}")], out


def merge_decode_step(step: onnx.ModelProto, general: onnx.ModelProto, *, ids_input: str, past_input: str,
                      keys: tuple[str, int] | tuple[str, int, int] | tuple[str, int, int, int] | None = None,
                      domain: str = "adaptex") -> onnx.ModelProto:
    """One model that runs `step`'s graph (a decoder's decode-step program: one new token after a
    non-empty cache) for such calls, `general`'s for every other: the If reads the new tokens of
    `ids_input` (axis 1) and the cached ones of `past_input` (axis 2). keys=(input, n[, cells[,
    capped]]): the near-cache step program, for steps whose `input` (the attention mask) has at most
    n columns (and at most `capped` batch x columns), or at most `cells` batch x columns; `general`
    is then the model with the other steps' program. The two are traces of one model: an initializer
    of the step graph equal to one of the general graph's (a weight) is stored once; one that shares
    a name but not its values (a trace's constant) is renamed.
    `general` may itself be a merged model (merge_short_call, or this function's): its branches then
    keep their own copies of the weights, folded from the main graph's."""
    tag, overload = ("near", NEAR_OVERLOAD) if keys else ("step", STEP_OVERLOAD)
    gs, gg = step.graph, general.graph
    _same_io(gs, gg, "decode-step and general graphs")
    _has_inputs(gg, "decode-step", ((ids_input, 2), (past_input, 3)) + (((keys[0], 2),) if keys else ()))
    step_model, inits, read = _share_weights(step, gg, tag)
    sub = "near_" if keys else ""  # the near-cache If's own values: dispatch.near_*
    prefix = f"{RESERVED}{sub}"
    one, zero = (numpy_helper.from_array(np.array(v, dtype=np.int64), f"{prefix}{n}") for v, n in ((1, "one"), (0, "zero")))
    is_step = f"{prefix}is_step"
    new_nodes, new = _squeezed_axis(ids_input, 1, f"{sub}new")
    cached_nodes, cached = _squeezed_axis(past_input, 2, f"{sub}cached")
    cond_nodes = new_nodes + cached_nodes + [
        helper.make_node("Equal", [new, one.name], [f"{prefix}one_new"], name=f"{prefix}Equal"),
        helper.make_node("Greater", [cached, zero.name], [f"{prefix}has_cache"], name=f"{prefix}Greater"),
        helper.make_node("And", [f"{prefix}one_new", f"{prefix}has_cache"], [is_step], name=f"{prefix}And"),
    ]
    limits = []
    if keys:
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in keys[1:]):
            raise ExportError(f"near-cache step dispatch: the key and cell counts must be whole numbers of at "
                              f"least 1, got {keys[1:]!r}")
        limit = numpy_helper.from_array(np.array(keys[1], dtype=np.int64), f"{prefix}limit")
        key_nodes, n_keys = _squeezed_axis(keys[0], 1, f"{sub}keys")
        few = f"{prefix}few_keys"
        cond_nodes += key_nodes + [helper.make_node("LessOrEqual", [n_keys, limit.name], [few],
                                                    name=f"{prefix}LessOrEqual")]
        limits = [limit]
        if len(keys) > 2:  # or few cells: batch x keys
            cells = numpy_helper.from_array(np.array(keys[2], dtype=np.int64), f"{prefix}cells_limit")
            cond_nodes += [
                helper.make_node("Shape", [keys[0]], [f"{prefix}batch_keys"], name=f"{prefix}Shape_cells", start=0,
                                 end=2),
                helper.make_node("ReduceProd", [f"{prefix}batch_keys"], [f"{prefix}cells"],
                                 name=f"{prefix}ReduceProd_cells", keepdims=0),
                helper.make_node("LessOrEqual", [f"{prefix}cells", cells.name], [f"{prefix}few_cells"],
                                 name=f"{prefix}LessOrEqual_cells"),
            ]
            limits = [limit, cells]
            if len(keys) > 3:  # the key count's rule only up to `capped` cells
                capped = numpy_helper.from_array(np.array(keys[3], dtype=np.int64), f"{prefix}keys_cells_limit")
                cond_nodes += [
                    helper.make_node("LessOrEqual", [f"{prefix}cells", capped.name], [f"{prefix}not_many_cells"],
                                     name=f"{prefix}LessOrEqual_keys_cells"),
                    helper.make_node("And", [few, f"{prefix}not_many_cells"], [f"{prefix}few_keys_capped"],
                                     name=f"{prefix}And_keys_cells")]
                few, limits = f"{prefix}few_keys_capped", limits + [capped]
            cond_nodes.append(helper.make_node("Or", [few, f"{prefix}few_cells"], [f"{prefix}few_keys_or_cells"],
                                               name=f"{prefix}Or_cells"))
            few = f"{prefix}few_keys_or_cells"
        cond_nodes.append(helper.make_node("And", [is_step, few], [f"{prefix}near_step"], name=f"{prefix}And_near"))
        is_step = f"{prefix}near_step"
    return _if_model(step_model, general, tags=(tag, "general"), overload=overload, cond_nodes=cond_nodes,
                     cond=is_step, initializers=inits + [one, zero] + limits, then_initializers=read, domain=domain,
                     other_local=not _dispatches(general))


def merge_short_call(short: onnx.ModelProto, general: onnx.ModelProto, *, keys_input: str, cache_input: str,
                     max_keys: int, domain: str = "adaptex", masked: bool = False,
                     large: dict | None = None, excess: dict | None = None) -> onnx.ModelProto:
    """One model that runs `short`'s graph (a decoder's short-call program: a prefill where every
    head attends as dense attention does, which streaming attention equals where every key lies
    within its sinks and window) for prefills of at most `max_keys` keys (the length of
    `keys_input`'s axis 1, the attention mask, at most max_keys, and `cache_input`'s axis 2, the
    cache, empty), and `general`'s for every other call. Weights stored once, as in
    merge_decode_step. masked: `short` is the masked short-call program (its streaming heads' keys
    beyond their reach masked, for the prefills a little longer); its If's own values are then
    dispatch.masked_*, and the short-call program's If goes on top of this model.
    large (with masked): {"heads", "from_scores"}: `short` is the masked program lowered with
    passes.attention_by_sample, run only where its layers' Ifs attend a sample at a time, batch > 1
    and batch x keys x keys x heads >= from_scores (a prefill: its new tokens are its keys); its
    values are dispatch.masked_large_*, and the masked program's If (merged with `general` before)
    holds the other masked calls.
    excess (with masked): {"heads", "beyond", "up_to"}: prefills of more than max_keys keys also run
    `short` where batch x heads x keys x max(0, keys - beyond) <= up_to (the scores that masking adds
    over block-local attention: graphs.ops.elastic_attention.call_runs_masked), the batch 1 where
    `large` (whose calls attend a sample at a time)."""
    gs, gg = short.graph, general.graph
    what = ("masked short-call (large)" if large else "masked short-call") if masked else "short-call"
    if (large is not None or excess is not None) and not masked:
        raise ExportError("short-call dispatch: `large` and `excess` are for the masked short-call program")
    if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
        raise ExportError(f"{what} dispatch: max_keys must be a whole number of at least 1, got {max_keys!r}")
    _same_io(gs, gg, f"{what} and general graphs")
    _has_inputs(gg, what, ((keys_input, 2), (cache_input, 3)))
    tag = ("masked_large" if large else "masked") if masked else "short"
    short_model, inits, read = _share_weights(short, gg, tag)
    sub = f"{tag}_" if masked else ""  # the masked Ifs' own values: dispatch.masked_*, dispatch.masked_large_*
    prefix = f"{RESERVED}{sub}"
    limit = numpy_helper.from_array(np.array(max_keys, dtype=np.int64), f"{prefix}short_keys")
    none = numpy_helper.from_array(np.array(0, dtype=np.int64), f"{prefix}no_cache")
    key_nodes, keys = _squeezed_axis(keys_input, 1, f"{sub}keys")
    cache_nodes, cached = _squeezed_axis(cache_input, 2, f"{sub}prefill_cache")
    within = f"{prefix}within_reach"
    few = f"{prefix}few_keys"
    cond_nodes = key_nodes + cache_nodes + [
        helper.make_node("LessOrEqual", [keys, limit.name], [few], name=f"{prefix}LessOrEqual_keys"),
        helper.make_node("Equal", [cached, none.name], [f"{prefix}no_cache_yet"], name=f"{prefix}Equal_cache")]
    consts = [limit, none]
    batch_nodes, batch = _squeezed_axis(keys_input, 0, f"{sub}batch")  # added where a condition reads it
    if excess is not None:
        excess_nodes, excess_consts = _excess_cond(None if large else batch, keys, excess, prefix)
        cond_nodes += ([] if large else batch_nodes) + excess_nodes + [
            helper.make_node("Or", [few, f"{prefix}few_excess"], [f"{prefix}few_keys_or_excess"],
                             name=f"{prefix}Or_excess")]
        few, consts = f"{prefix}few_keys_or_excess", consts + excess_consts
    cond_nodes.append(helper.make_node("And", [few, f"{prefix}no_cache_yet"], [within], name=f"{prefix}And_within"))
    if large is not None:
        large_nodes, large_consts = _large_call_cond(batch, keys, keys, large, prefix, f"{prefix}large")
        cond_nodes += batch_nodes + large_nodes + [
            helper.make_node("And", [within, f"{prefix}large"], [f"{prefix}call"], name=f"{prefix}And_call")]
        within, consts = f"{prefix}call", consts + large_consts
    overload = (tag if large else MASKED_OVERLOAD) if masked else SHORT_OVERLOAD
    return _if_model(short_model, general, tags=(tag, "long"), overload=overload,
                     cond_nodes=cond_nodes, cond=within, initializers=inits + consts, then_initializers=read,
                     domain=domain, other_local=not _dispatches(general))


def _excess_cond(batch: str | None, keys: str, excess: dict, prefix: str) -> tuple[list, list]:
    """Nodes computing `prefix`few_excess = batch x heads x keys x max(0, keys - beyond) <= up_to
    (excess's values; without `batch`, a sample's) from scalars, and their constants."""
    for what in ("heads", "beyond", "up_to"):
        n = excess.get(what)
        if isinstance(n, bool) or not isinstance(n, int) or n < (0 if what == "beyond" else 1):
            raise ExportError(f"masked short-call dispatch: excess {what} must be a whole number of at least "
                              f"{0 if what == 'beyond' else 1}, got {n!r}")
    zero, beyond, heads, up_to = (numpy_helper.from_array(np.array(v, dtype=np.int64), f"{prefix}excess_{n}")
                                  for n, v in (("zero", 0), ("beyond", excess["beyond"]),
                                               ("heads", excess["heads"]), ("up_to", excess["up_to"])))
    p = f"{prefix}excess"
    nodes = [helper.make_node("Sub", [keys, beyond.name], [f"{p}_keys_less_beyond"], name=f"{p}_Sub"),
             helper.make_node("Max", [f"{p}_keys_less_beyond", zero.name], [f"{p}_keys_past_row"], name=f"{p}_Max"),
             helper.make_node("Mul", [keys, f"{p}_keys_past_row"], [f"{p}_cells"], name=f"{p}_Mul_cells"),
             helper.make_node("Mul", [f"{p}_cells", heads.name], [f"{p}_scores"], name=f"{p}_Mul_heads")]
    scores = f"{p}_scores"
    if batch is not None:
        nodes.append(helper.make_node("Mul", [scores, batch], [f"{p}_call"], name=f"{p}_Mul_batch"))
        scores = f"{p}_call"
    nodes.append(helper.make_node("LessOrEqual", [scores, up_to.name], [f"{prefix}few_excess"],
                                  name=f"{p}_LessOrEqual"))
    return nodes, [zero, beyond, heads, up_to]


def _large_call_cond(batch: str, new: str, keys: str, large: dict, prefix: str, out: str) -> tuple[list, list]:
    """Nodes computing `out` = batch > 1 and batch x new x keys x large["heads"] >= large["from_scores"]
    (the condition bodies.large_batch computes in each layer, where every layer has that many
    heads) from scalars, and their constants (their values named `prefix`...)."""
    for what in ("heads", "from_scores"):
        n = large.get(what)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ExportError(f"large-call dispatch: {what} must be a whole number of at least 1, got {n!r}")
    one, limit, per_head = (numpy_helper.from_array(np.array(v, dtype=np.int64), f"{prefix}{n}")
                            for v, n in ((1, "one"), (large["from_scores"], "from_scores"), (large["heads"], "heads")))
    nodes = [
        helper.make_node("Mul", [batch, new], [f"{prefix}rows"], name=f"{prefix}Mul_rows"),
        helper.make_node("Mul", [f"{prefix}rows", keys], [f"{prefix}cells"], name=f"{prefix}Mul_cells"),
        helper.make_node("Mul", [f"{prefix}cells", per_head.name], [f"{prefix}scores"], name=f"{prefix}Mul_scores"),
        helper.make_node("GreaterOrEqual", [f"{prefix}scores", limit.name], [f"{prefix}many"],
                         name=f"{prefix}GreaterOrEqual"),
        helper.make_node("Greater", [batch, one.name], [f"{prefix}batched"], name=f"{prefix}Greater"),
        helper.make_node("And", [f"{prefix}batched", f"{prefix}many"], [out], name=f"{prefix}And"),
    ]
    return nodes, [one, limit, per_head]


def merge_large_call(large: onnx.ModelProto, general: onnx.ModelProto, *, ids_input: str, keys_input: str,
                     heads: int, from_scores: int, domain: str = "adaptex") -> onnx.ModelProto:
    """One model that runs `large`'s graph (the same lowering with passes.attention_by_sample: each
    attention behind an If that runs it a sample at a time when the call is large) for calls whose
    attention is that large, and `general`'s (the attention batched, no If a layer) for every other:
    batch > 1 and batch x new tokens x keys x `heads` >= `from_scores`, the new tokens read from
    `ids_input`'s axis 1 and the keys from `keys_input`'s (the attention mask). That is the
    condition each layer's If evaluates (bodies.large_batch) where every layer has `heads` heads,
    so the large program's layers all attend by sample and the general program is what their Ifs'
    other branch holds: the same outputs, and a decode step or a short prompt pays no If a layer
    (a decoder's main graph, which serves both: docs/benchmarking.md#large-calls). Both lowerings of
    one trace: the same weights, stored once. Where the op bodies differ (the general program's
    without their own by-sample Ifs), the large program's calls read theirs as the overload
    LARGE_OVERLOAD."""
    gl, gg = large.graph, general.graph
    prefix = f"{RESERVED}large_"
    batch_nodes, batch = _squeezed_axis(ids_input, 0, "large_batch")
    new_nodes, new = _squeezed_axis(ids_input, 1, "large_new")
    key_nodes, keys = _squeezed_axis(keys_input, 1, "large_keys")
    large_call = f"{prefix}call"
    large_nodes, consts = _large_call_cond(batch, new, keys, {"heads": heads, "from_scores": from_scores}, prefix,
                                           large_call)
    _same_io(gl, gg, "large-call and general graphs")
    _has_inputs(gg, "large-call", ((ids_input, 2), (keys_input, 2)))
    if _digest(gl.initializer) != _digest(gg.initializer):
        raise ExportError("the large-call and general lowerings differ in their weights; export one of them")
    return _if_model(large, general, tags=("large", "general"),
                     overload=None if _same_bodies(large, general) else LARGE_OVERLOAD,
                     cond_nodes=batch_nodes + new_nodes + key_nodes + large_nodes, cond=large_call,
                     initializers=list(gg.initializer) + consts, then_initializers=gl.initializer, domain=domain)


def _dispatches(proto: onnx.ModelProto) -> bool:
    """Whether `proto`'s graph is a merged model (its top a dispatch If)."""
    return any(n.op_type == "If" and n.name == f"{RESERVED}If" for n in proto.graph.node)


__all__ = ["merge", "merge_dense_step", "merge_decode_step", "merge_short_call", "merge_large_call",
           "DENSE_OVERLOAD", "STEP_OVERLOAD", "NEAR_OVERLOAD", "SHORT_OVERLOAD",
           "MASKED_OVERLOAD"]
