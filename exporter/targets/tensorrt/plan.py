"""What a TensorRT engine build is made of, decided without TensorRT (and tested on CPU):

- which ONNX nodes compute routing (`mark_routing`), and so which layers and tensors the builder
  pins to fp32 in an fp16 engine (`pin_plan`: only those with a float input or output; a layer's
  precision must be one of its input or output types, NvInfer.h, and TensorRT#3570 shows the error
  an int or bool layer gives under OBEY_PRECISION_CONSTRAINTS);
- the optimization profile (`profile`): its min/opt/max size of every named axis, with defaults and
  one-line errors for sizes that cannot work;
- each input's concrete shapes for those sizes (`input_shapes`): axis names and sums of them
  ('past_sequence + sequence') are parsed, never evaluated.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import onnx

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.graphs.nn import routing_class_names
from adaptex.graphs.ops.facts import routing_inputs

ROUTE_MARK = "adaptex_route"
BODY_INPUTS = {"BudgetedAttention": fx.INPUTS, "ConditionalFFN": fx.CFFN_INPUTS,
               "ConditionalAttention": fx.CA_INPUTS, "ElasticAttention": fx.EA_INPUTS}
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


# --- routing ------------------------------------------------------------------------------------------

def _classes(node: onnx.NodeProto) -> str:
    return next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.class_hierarchy"), "")


def _graph_routing(graph, sources: set[str], sinks: set[str]) -> set[int]:
    """Indices of the nodes on a path from a `sources` value to a `sinks` value (of every node fed by
    `sources`, when `sinks` is empty). Paths do not pass through adaptex nodes: a layer's routing
    ends at its op, and the next layer's routing starts at its own router."""
    nodes = list(graph.node)
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for v in n.input:
            consumers.setdefault(v, []).append(i)
    fwd, todo = set(), list(sources)
    while todo:
        for i in consumers.get(todo.pop(), []):
            if i not in fwd and nodes[i].domain != fx.DOMAIN:
                fwd.add(i)
                todo.extend(nodes[i].output)
    if not sinks:
        return fwd
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    bwd, todo = set(), list(sinks)
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in bwd or nodes[i].domain == fx.DOMAIN:
            continue
        bwd.add(i)
        todo.extend(nodes[i].input)
    return fwd & bwd


def mark_routing(proto: onnx.ModelProto) -> list[str]:
    """Name every routing node with ROUTE_MARK, in the main graph and in the function bodies; returns
    the main graph's routing value names.

    Main graph: the nodes traced inside a routing layer (graphs.nn.ROUTING_LAYERS: the routers, the
    budget's softmax, the keep and gate, the head-mode choice), and every node on a path from those
    to an adaptex node's routing input or a decisions.* output. Function bodies: the nodes fed by the
    routing inputs that do not read the token stream or the weights."""
    g = proto.graph
    nodes = list(g.node)
    layers = routing_class_names()
    in_layer = [n.domain != fx.DOMAIN and any(c in _classes(n) for c in layers) for n in nodes]
    layer_outs = {o for n, r in zip(nodes, in_layer) if r for o in n.output}
    sinks = {o.name for o in g.output if o.name.startswith("decisions.")}
    routing = routing_inputs()  # the routing inputs of each adaptex node, as the ops declare them
    formals = {f.name: list(f.input) for f in proto.functions if f.domain == fx.DOMAIN} | BODY_INPUTS
    for n in nodes:
        names = formals.get(n.op_type, []) if n.domain == fx.DOMAIN else []
        sinks.update(n.input[pos] for pos, name in enumerate(names)
                     if name in routing.get(n.op_type, ()) and pos < len(n.input))
    marked = {i for i, r in enumerate(in_layer) if r} | _graph_routing(g, layer_outs, sinks)
    values = []
    for i in sorted(marked):
        n = nodes[i]
        n.name = f"{ROUTE_MARK}/{n.name or f'{n.op_type}_{i}'}"
        values.extend(n.output)
    for f in proto.functions:
        formal = formals.get(f.name, [])
        sources = {f.input[i] for i, n in enumerate(formal) if n in routing.get(f.name, ()) and i < len(f.input)}
        body = _graph_routing(f, set(f.input) - sources, set())  # reads x or the weights
        marked = _graph_routing(f, sources, set()) - body
        for i, n in enumerate(f.node):
            n.name = f"{ROUTE_MARK}/{n.op_type}_{i}" if i in marked else f"{n.op_type}_{i}"
    return values


@dataclass(frozen=True)
class PinPlan:
    """What an fp16 build pins to fp32: the routing nodes that touch a float value (layers named
    after them), and the float routing tensors (so a helper layer the parser creates without the
    node's name is still pinned when it produces one). Integer and bool routing is left alone."""
    nodes: frozenset
    tensors: frozenset
    skipped: frozenset  # routing nodes with no float input or output (never pinned)


def value_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Every value's element type in the main graph (after shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    types = {}
    for vi in list(inferred.graph.input) + list(inferred.graph.output) + list(inferred.graph.value_info):
        types[vi.name] = vi.type.tensor_type.elem_type
    for init in inferred.graph.initializer:
        types[init.name] = init.data_type
    for n in inferred.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    types[n.output[0]] = a.t.data_type
    return types


def should_pin(name: str, inputs: list[tuple[str, bool]], outputs: list[tuple[str, bool]], plan: PinPlan) -> bool:
    """Whether an fp16 build pins a layer to fp32: it is routing (named after a planned node, carrying
    ROUTE_MARK as a function body's routing layer does, or producing a planned routing tensor) and it
    has a float input or output. inputs/outputs: (tensor name, is float). The builder and the CPU
    tests both decide through this one function."""
    routing = ROUTE_MARK in name or any(name.startswith(n) for n in plan.nodes) or \
        any(t in plan.tensors for t, _ in outputs)
    return routing and any(is_float for _, is_float in inputs + outputs)


def simulate_pinning(proto: onnx.ModelProto, plan: PinPlan) -> tuple[list[str], list[str]]:
    """(pinned, left alone) routing layers of the network the parser would build, approximated by the
    model with its local functions inlined (a layer per node, named after it): what an fp16 build of
    this file pins, decided without TensorRT."""
    import onnx.inliner

    inlined = onnx.inliner.inline_local_functions(proto)
    types = value_types(inlined)
    pinned, left = [], []
    for n in inlined.graph.node:
        ins = [(v, types.get(v) in FLOAT_TYPES) for v in n.input if v]
        outs = [(v, types.get(v) in FLOAT_TYPES) for v in n.output if v]
        if n.op_type in ("Constant", "Shape"):
            continue
        if should_pin(n.name, ins, outs, plan):
            pinned.append(n.name)
        elif ROUTE_MARK in n.name:
            left.append(n.name)
    return pinned, left


def pin_plan(proto: onnx.ModelProto) -> PinPlan:
    """The pinning plan of a TensorRT-bound ONNX whose routing mark_routing has named."""
    types = value_types(proto)
    nodes, tensors, skipped = set(), set(), set()
    for n in proto.graph.node:
        if not n.name.startswith(ROUTE_MARK):
            continue
        floats = [v for v in list(n.input) + list(n.output) if v and types.get(v) in FLOAT_TYPES]
        if floats:
            nodes.add(n.name)
            tensors.update(v for v in n.output if types.get(v) in FLOAT_TYPES)
        else:
            skipped.add(n.name)
    return PinPlan(frozenset(nodes), frozenset(tensors), frozenset(skipped))


# --- shapes -------------------------------------------------------------------------------------------

def dynamic_axes(inputs: dict) -> list[str]:
    """The named axes of an artifact's inputs (sums such as 'past_sequence + sequence' are not axes)."""
    out = []
    for spec in inputs.values():
        for d in spec["shape"]:
            if isinstance(d, str) and d.isidentifier() and d not in out:
                out.append(d)
    return out


def parse_shapes(text: str | None, flag: str, axes: list[str]) -> dict[str, int]:
    """'batch=1,sequence=128' -> {'batch': 1, 'sequence': 128}; a one-line error names the flag."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in axes or not value.strip().isdigit():
            raise ExportError(f"{flag} {text!r}: expected AXIS=N[,AXIS=N] with AXIS one of {', '.join(axes)} "
                              f"(e.g. {flag} {axes[0]}=1)")
        out[name] = int(value)
    return out


def profile(meta: dict, min_s: dict, opt_s: dict, max_s: dict) -> dict[str, dict[str, int]]:
    """The optimization profile over an artifact's named axes: {'min'|'opt'|'max': {axis: size}}.
    Defaults: batch 1/1/64; past_sequence 0/0/L-1; any other axis 1/min(128, L)/L, with L the
    model's maximum sequence (512 when the model states none: pass --max-shapes for more)."""
    axes = dynamic_axes(meta["inputs"])
    L = int(meta.get("max_sequence") or 512)
    prof = {"min": {}, "opt": {}, "max": {}}
    for a in axes:
        lo, mid, hi = {"batch": (1, 1, 64), "past_sequence": (0, 0, L - 1)}.get(a, (1, min(128, L), L))
        prof["min"][a], prof["opt"][a], prof["max"][a] = lo, mid, hi
    for key, given in (("min", min_s), ("opt", opt_s), ("max", max_s)):
        for axis, v in given.items():
            if axis not in axes:
                raise ExportError(f"--{key}-shapes: this model has no axis {axis!r}; its axes are {', '.join(axes)}")
            prof[key][axis] = v
    for axis in axes:
        lo, mid, hi = prof["min"][axis], prof["opt"][axis], prof["max"][axis]
        floor = 0 if axis == "past_sequence" else 1
        if not floor <= lo <= mid <= hi:
            raise ExportError(f"{axis}: need {floor} <= min <= opt <= max, got {lo}, {mid}, {hi}; "
                              "fix --min-shapes/--opt-shapes/--max-shapes")
    if "past_sequence" in axes:
        if prof["max"]["past_sequence"] > L - 1:
            raise ExportError(f"--max-shapes: past_sequence {prof['max']['past_sequence']} leaves no room for a new "
                              f"token within the model's maximum of {L}; use at most {L - 1}")
        total = prof["opt"]["sequence"] + prof["opt"]["past_sequence"]
        if total > L:
            raise ExportError(f"--opt-shapes: sequence + past_sequence = {total} exceeds the model's maximum of {L}; "
                              "lower it")
    elif "sequence" in axes and prof["max"]["sequence"] > L and meta.get("max_sequence"):
        raise ExportError(f"--max-shapes: sequence {prof['max']['sequence']} exceeds the model's maximum of {L}; "
                          "lower it")
    return prof


_TERM = re.compile(r"^\s*(?:([A-Za-z_][A-Za-z0-9_]*)|(\d+))\s*$")


def axis_size(dim: int | str, sizes: dict[str, int], where: str) -> int:
    """A dimension's size: an int, an axis name, or a sum of names and ints ('past_sequence +
    sequence'); anything else is an ExportError naming the axis. Parsed, never evaluated."""
    if isinstance(dim, int) and not isinstance(dim, bool):
        return dim
    total = 0
    for term in str(dim).split("+"):
        m = _TERM.match(term)
        if m is None:
            raise ExportError(f"{where}: axis {dim!r} is neither a size, an axis name nor a sum of them; "
                              "re-export the model with adaptex")
        name, number = m.groups()
        if name is not None and name not in sizes:
            raise ExportError(f"{where}: axis {name!r} has no size in the optimization profile (it sizes "
                              f"{', '.join(sizes) or 'nothing'}); pass it in --min/--opt/--max-shapes")
        total += sizes[name] if name is not None else int(number)
    return total


def input_shapes(meta: dict, sizes: dict[str, int]) -> dict[str, tuple]:
    """Each network input's concrete shape for the profile's axis sizes. A sum of axes (a decoder's
    mask, 'past_sequence + sequence') is the sum at each of min, opt and max, so the profile is
    self-consistent: one box serves prefill (sequence up to L, no past) and decode (one token, past
    up to L - 1), and its max corner (2L - 1) is a shape no valid input reaches; the runner refuses a
    step whose past plus new tokens exceed the cache bound before TensorRT sees it."""
    return {name: tuple(axis_size(d, sizes, f"input {name}") for d in spec["shape"])
            for name, spec in meta["inputs"].items()}
