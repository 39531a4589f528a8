"""Tracing: a model and its contract -> a torch.export ExportedProgram whose adaptive parts are single
`adaptex::` nodes, with dynamic axes and the decisions as named outputs (graphs/family.py)."""
from __future__ import annotations

import warnings

import torch

import adaptex.graphs  # noqa: F401  (registers the adaptex ops)
from adaptex.exporter.errors import ExportError
from adaptex.graphs.family import Contract
from adaptex.graphs.nn.record import traced_control_flow


def trace(model: torch.nn.Module, contract: Contract | None = None, mode: str = "hard",
          float_bools: bool = False, control_flow: bool = False, step: bool = False,
          short: bool = False, masked: bool = False) -> torch.export.ExportedProgram:
    """torch.export the model in inference mode (contract: default, its shipped family's). float_bools:
    bool inputs as float32 0/1 (Core ML has no bool features; the layers read them back with .bool()).
    control_flow: layers may skip work behind a torch.cond (an ONNX `If`; graphs.nn.traced_control_flow).
    step: a decoder's decode-step program (one new token after a non-empty cache; the contract's
    step shapes), which serves those calls only. short: a decoder's short-call program (prefills of
    at most the contract's short_call_keys() tokens), likewise;
    with masked, its masked short-call program (at most masked_call_keys() tokens)."""
    if contract is None:
        from adaptex.graphs.family import family_contract

        contract = family_contract(model)
    if step and not contract.decoder:
        raise ExportError("a decode-step program is a decoder's (a model with a KV cache); this model has none")
    if short and contract.short_call_keys() is None:
        raise ExportError("this model has no short-call program (an elastic decoder's: calls within its streaming "
                          "heads' sinks and window)")
    if masked and (not short or contract.masked_call_keys() is None):
        raise ExportError("this model has no masked short-call program (an elastic decoder's, where its general "
                          "body attends a prefill masked beyond the streaming heads' reach)")
    model.eval()
    program = "masked" if masked else "short" if short else "step" if step else None
    # the model shapes these calls' traces itself (an elastic decoder: no router at a step, dense attention
    # within the reach); for the others a program is the general trace at the program's shapes
    wrapper = contract.wrapper(model, mode, program if program in contract.traced_programs else None)
    shapes = {"step": True} if step else {}
    example = contract.example_inputs(mode, **shapes)
    if float_bools:
        example = tuple(t.float() if t.dtype == torch.bool else t for t in example)
    try:
        with torch.no_grad(), warnings.catch_warnings(), traced_control_flow(control_flow):
            warnings.simplefilter("ignore")
            return torch.export.export(wrapper, example, dynamic_shapes=contract.dynamic_shapes(mode, **shapes))
    except Exception as e:  # torch.export raises many types; the first line is the useful one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.export failed in mode {mode!r}: {first}") from e


def adaptex_nodes(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The adaptex:: custom-op nodes of a traced graph."""
    return [n for n in ep.graph.nodes
            if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "adaptex"]


def op_name(node: torch.fx.Node) -> str:
    """'adaptex::budgeted_attention' for a node of that op."""
    return node.target.name()


def module_path(node: torch.fx.Node) -> str:
    """The module path of the innermost module a traced node was called in ('' at the top)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] for v in stack.values()][-1] if stack else ""


# the arguments of the adaptex ops that carry the key padding (1 = a real token), by schema name
MASK_ARGUMENTS = ("key_mask", "bias")


def mask_inputs(ep: torch.export.ExportedProgram, names: list[str]) -> set[str]:
    """The user inputs (by `names`, in the graph's order) that reach an adaptex op's key mask: the
    inputs whose padding an adaptive layer reads (export's validation pads their tails)."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user = {placeholders[p]: name for p, name in zip(ep.graph_signature.user_inputs, names)}
    found, seen = set(), set()
    todo = [a for node in adaptex_nodes(ep)
            for arg, a in zip(node.target._schema.arguments, node.args)
            if arg.name in MASK_ARGUMENTS and isinstance(a, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in user:
            found.add(user[n])
        todo += n.all_input_nodes
    return found


_NP_DTYPES = {torch.int64: "int64", torch.int32: "int32", torch.float32: "float32", torch.float16: "float16",
              torch.bool: "bool", torch.bfloat16: "bfloat16", torch.int8: "int8", torch.uint8: "uint8"}


def _declared_names(contract: Contract, mode: str) -> dict[tuple[int, int], str]:
    """(input index, axis) -> axis name, from the contract's named Dims and declared axis names."""
    dyn = contract.dynamic_shapes(mode)
    specs = dyn[0] if isinstance(dyn, tuple) and len(dyn) == 1 and isinstance(dyn[0], (tuple, list)) else dyn
    if isinstance(specs, dict):
        specs = list(specs.values())
    names = {}
    inputs = contract.input_names(mode)
    for i, spec in enumerate(specs or ()):
        for axis, dim in (spec or {}).items():
            dim_name = getattr(dim, "__name__", None)
            if dim_name and dim is not torch.export.Dim.AUTO:
                names[(i, axis)] = dim_name
    for name, axes in contract.axis_names(mode).items():  # e.g. a decoder's mask: past + new
        for axis, axis_name in axes.items():
            names[(inputs.index(name), axis)] = axis_name
    return names


def io_specs(ep: torch.export.ExportedProgram, contract: Contract, mode: str = "hard") -> tuple[dict, dict]:
    """The artifact's inputs and outputs by name: numpy dtype and shape, each dynamic axis named (an
    output's as an expression of the inputs' axes, e.g. 'past_sequence + sequence'); an input that
    reaches an adaptex op's key mask is marked "mask": true."""
    import sympy

    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user = [nodes[n] for n in ep.graph_signature.user_inputs]
    example = tuple(n.meta["val"] for n in user)
    inputs_named = contract.input_names(mode)
    declared = _declared_names(contract, mode)
    axis_names, subs = {}, {}
    for i, t in enumerate(example):  # one name per traced symbol: shared axes share their name
        for axis, size in enumerate(t.shape):
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                continue
            expr = size.node.expr
            if (i, axis) in declared:
                name = declared[(i, axis)]
            elif isinstance(expr, sympy.Symbol) and expr in subs:
                name = str(subs[expr])
            elif isinstance(expr, sympy.Symbol):
                name = ("batch" if axis == 0 else "sequence" if axis == 1 else f"{inputs_named[i]}_{axis}") \
                    if i == 0 else f"{inputs_named[i]}_{axis}"
            else:
                continue  # an expression of other axes (named below)
            axis_names[(i, axis)] = name
            if isinstance(expr, sympy.Symbol) and name.isidentifier():
                subs.setdefault(expr, sympy.Symbol(name))
    for i, t in enumerate(example):  # an input axis the trace tied to others (a decoder's mask: past + new)
        for axis, size in enumerate(t.shape):
            if isinstance(size, torch.SymInt) and (i, axis) not in axis_names and not size.node.expr.is_number:
                axis_names[(i, axis)] = str(size.node.expr.subs(subs))

    def shape(val, i=None) -> list:
        out = []
        for axis, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_number:  # a size tracing fixed
                out.append(int(size.node.expr))
            elif isinstance(size, torch.SymInt):
                out.append(axis_names.get((i, axis)) if i is not None and (i, axis) in axis_names
                           else str(size.node.expr.subs(subs)))
            else:
                out.append(int(size))
        return out

    masks = mask_inputs(ep, contract.input_names(mode))
    inputs = {name: {"dtype": _NP_DTYPES.get(n.meta["val"].dtype, str(n.meta["val"].dtype)),
                     "shape": shape(n.meta["val"], i), **({"mask": True} if name in masks else {})}
              for i, (name, n) in enumerate(zip(contract.input_names(mode), user))}
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    vals = [a.meta["val"] for a in out_node.args[0]]
    outputs = {name: {"dtype": _NP_DTYPES.get(v.dtype, str(v.dtype)), "shape": shape(v)}
               for name, v in zip(contract.output_names(mode), vals)}
    return inputs, outputs
