"""What an fp16 Core ML package keeps in fp32, found in the traced graph.

Routing always stays fp32 (an fp16 p <= 0.5 would flip keep for every p within 2^-12 of the
threshold, an fp16 floor(s*H) lands on the other side of an integer near the boundary): every FX
node traced inside a routing layer (graphs.nn.ROUTING_LAYERS), renamed with the `route_` prefix.
A model's contract adds roles (graphs.family.Contract.coreml_fp32_roles):
- classifier_tail: the final norm and everything downstream (pooling, head MLP): O(B*d^2) against
  the body's O(B*T*d^2), and an fp16 head rounds logits of ~20 at 2^-11 relative on its own;
- pooling_tail: downstream of the last LayerNorm (masked mean, L2 norm) and the mask side of the
  mean: a sum over T tokens is where fp16 rounds most;
- residual_stream: a decoder's embeddings, residual adds and LayerNorms (mixed precision: matmuls,
  attention and FFN bodies fp16), and the conditional ops' residual parts: the trained residual
  stream reaches |h| ~ 30, and an fp16 h before each LayerNorm compounds over the blocks.
"""
from __future__ import annotations

import numpy as np

from adaptex.exporter.trace import adaptex_nodes, module_path, op_name
from adaptex.graphs.nn import ConditionalBlock, class_name, routing_class_names

# MIL ops whose name (or an output's name) starts with one of these stay fp32 in an fp16 package
FP32_PREFIXES = ("route_", "resid_")
# normalisation statistics stay fp32 in every fp16 package: a LayerNorm's sum of squares over 256
# channels passes 65504 once its input reaches |x| ~ 16, and the Neural Engine's reductions are
# reported to overflow at that boundary (runtimes/fp16.py); shipped budgetformer-graded's fp16 package
# flipped 113 decisions under fp16 accumulation before this
FP32_OP_TYPES = ("layer_norm", "batch_norm", "instance_norm", "l2_norm", "reduce_l2_norm", "rms_norm")


def _types(node) -> list[str]:
    """The qualified class names of the modules a traced node was called in, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for _, t in stack.values():
        out.append(t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}")
    return out


def routing_node_names(ep) -> set[str]:
    """Every call_function node traced inside a routing layer, except the adaptex op itself and the
    unpacking of its outputs (the op's body is not routing)."""
    import operator

    routing = set(routing_class_names())
    ops = {n for n in adaptex_nodes(ep)}
    names = set()
    for n in ep.graph.nodes:
        if n.op != "call_function" or n in ops or (n.target is operator.getitem and n.args[0] in ops):
            continue
        if routing.intersection(_types(n)):
            names.add(n.name)
    return names


def _last_layer_norm(ep):
    import torch

    norms = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.layer_norm.default]
    return norms[-1] if norms else None


def _downstream(start) -> set[str]:
    names, todo = set(), list(start)
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.name not in names:
            names.add(n.name)
            todo.extend(n.users)
    return names


def classifier_tail(ep) -> set[str]:
    """The final norm and everything downstream of it (pooling, head MLP)."""
    last = _last_layer_norm(ep)
    return _downstream([last]) if last is not None else set()


def pooling_tail(ep) -> set[str]:
    """Everything downstream of the last LayerNorm, and the attention-mask side of the mean (mask as
    float, token count, clamp): the walk back from the tail stops at the LayerNorm."""
    last = _last_layer_norm(ep)
    if last is None:
        return set()
    names = _downstream(list(last.users))
    todo = [a for n in ep.graph.nodes if n.name in names for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n is not last and n.name not in names:
            names.add(n.name)
            todo.extend(n.all_input_nodes)
    return names


def residual_stream(ep) -> set[str]:
    """A decoder's embeddings, residual adds (B, T, d) outside the attention and FFN bodies, position
    rows, and the LayerNorms of its blocks and the final one."""
    import torch

    names = set()
    block = class_name(ConditionalBlock)
    last = _last_layer_norm(ep)
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        types, path, val = _types(n), module_path(n), n.meta.get("val")
        inner = types[-1] if types else ""
        if n.target == torch.ops.aten.layer_norm.default and (path.endswith((".ln1", ".ln2")) or n is last):
            names.add(n.name)
        elif n.target == torch.ops.aten.embedding.default and not set(routing_class_names()).intersection(types):
            names.add(n.name)
        elif (inner == block or len(types) <= 2) and n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.index.Tensor) \
                and getattr(val, "ndim", 0) >= 2 and getattr(val, "dtype", None) == torch.float32:
            names.add(n.name)  # (B, T, d) residual adds and the embedding add; the (T, d) position rows
    for n in ep.graph.nodes:  # the position rows' unsqueeze before the embedding add
        if n.op == "call_function" and n.target == torch.ops.aten.unsqueeze.default and any(
                a.name in names and a.target == torch.ops.aten.index.Tensor for a in n.all_input_nodes):
            names.add(n.name)
    return names


def conditional_residual_ops(ep) -> set[str]:
    """The MIL op names the adaptex ops' translations give the parts they keep fp32 in an fp16 body
    (each op's `coreml_fp32_parts`, graphs/ops/<op>.py: the conditional ops' kept rows, layer_norm,
    residual add and scatter back, beside the decoder's residual stream)."""
    from adaptex.graphs.ops.facts import OP_FACTS

    out = set()
    for n in adaptex_nodes(ep):
        facts = OP_FACTS.get(op_name(n))
        if facts is not None:
            out |= {f"{n.name}{s}" for s in facts.coreml_fp32_parts}
    return out


def prefix_nodes(ep, names: set[str], prefix: str) -> set[str]:
    """Rename the FX nodes `names` to <prefix><name>: coremltools names each MIL op after its FX node,
    uniquifying clashes with a suffix (a router's squeeze_1 became squeeze_1_1 next to the squeeze_1
    of an attention's unbind), so the fp16 op selector matches them by the prefix, which no suffix
    can break. Graph outputs keep their names (the signature refers to them); those are returned."""
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outputs = {a.name for a in out_node.all_input_nodes}
    for n in list(ep.graph.nodes):
        if n.op == "call_function" and n.name in names and n.name not in outputs:
            n._rename(prefix + n.name)
    ep.graph_module.recompile()
    return names & outputs


def bool_ops_as_logical(ep) -> None:
    """torch.export writes `a & b` / `a | b` on bool tensors as aten.__and__ / aten.__or__, which
    coremltools 9 does not look up (it registers them as "and" / "or"): the same ops as
    aten.logical_and / logical_or, which it converts."""
    import torch

    swap = {torch.ops.aten.__and__.Tensor: torch.ops.aten.logical_and.default,
            torch.ops.aten.__or__.Tensor: torch.ops.aten.logical_or.default}
    changed = False
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target in swap and all(
                getattr(a.meta.get("val"), "dtype", None) == torch.bool for a in n.all_input_nodes):
            n.target = swap[n.target]
            changed = True
    if changed:
        ep.graph_module.recompile()


FP16_MAX = 65504.0


def saturate_fp16_constants(ep, keep: set[str]) -> int:
    """Clamp the finite float constants of the ops an fp16 package computes in fp16 (every call not
    in `keep` or named with an FP32_PREFIXES prefix) to fp16's range, ±65504: cast as they are, they
    become ±inf, and Hugging Face's additive mask `(1 - mask) * torch.finfo(float32).min` then gives
    0 * -inf = NaN on every real token. Saturated, the mask is -65504 on padding, which a softmax
    still takes to 0. Infinities stay (-inf fills are exact in fp16). Returns how many changed."""
    def clamp(a):
        if isinstance(a, float) and np.isfinite(a) and abs(a) > FP16_MAX:
            return float(np.copysign(FP16_MAX, a)), 1
        if isinstance(a, (list, tuple)):
            parts = [clamp(b) for b in a]
            return type(a)(p for p, _ in parts), sum(c for _, c in parts)
        return a, 0

    changed = 0
    for n in ep.graph.nodes:
        if n.op != "call_function" or n.name in keep or n.name.startswith(FP32_PREFIXES):
            continue
        args, c1 = clamp(tuple(n.args))
        kwargs = {}
        c2 = 0
        for k, v in n.kwargs.items():
            kwargs[k], c = clamp(v)
            c2 += c
        if c1 or c2:
            n.args, n.kwargs = args, kwargs
            changed += c1 + c2
    if changed:
        ep.graph_module.recompile()
    return changed


def keep_fp32(ep, contract, adaptive: bool = True) -> tuple[set[str], bool]:
    """(the FX/MIL names an fp16 package keeps fp32, whether ops between kept ops stay fp32 too) for
    a model's contract; adaptive=False (stock counterparts) keeps only the tails."""
    roles = contract.coreml_fp32_roles
    keep = set()
    if adaptive:
        keep |= prefix_nodes(ep, routing_node_names(ep), "route_")
    if "classifier_tail" in roles:
        keep |= classifier_tail(ep)
    if "pooling_tail" in roles:
        keep |= pooling_tail(ep)
    if "residual_stream" in roles and adaptive:
        keep |= prefix_nodes(ep, residual_stream(ep), "resid_") | conditional_residual_ops(ep)
    # keep_between (pooling tails): an op fed only by kept ops and read only by kept ops stays fp32
    # too; it catches translations that name neither op nor result after the FX node (aten.clamp's
    # clip_0 inside a router or the tail)
    return keep, "pooling_tail" in roles


def output_dtype(dtype: str):
    """Every float output is fp32 even in an fp16 package (left to coremltools an fp16 body's outputs
    are fp16, which rounds logits in the tens by up to 8e-3 and the fp32 routing's s to 3 digits);
    integers are int32, bools float32 0/1 (Core ML has no bool features)."""
    return np.int32 if dtype.startswith(("int", "uint")) else np.float32
