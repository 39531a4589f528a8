"""An op's facts, declared once where the op is registered (graphs/ops/<op>.py) and read by every
layer that needs them: which inputs carry routing (TensorRT pins what computes them to fp32), which
parts of its Core ML translation stay fp32 in an fp16 body, which decisions its layer records, of
what kind, and the margin within which parity excuses a flipped decision of each kind.

    FACTS = register(OpFacts(op="adaptex::my_op", function="MyOp", routing_inputs=("gate",),
                             decisions={"keep": "keep"},
                             margins={"keep": Margin(1e-4, 1e-2, "|p - threshold|")}))
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Margin:
    """A decision kind's margin: a flip is excused only when the reference sat closer than this to
    the boundary, in the kind's own unit, by the precision of the artifact's body."""

    fp32: float
    fp16: float
    unit: str  # what the margin measures, for failure messages


@dataclass(frozen=True)
class OpFacts:
    op: str  # the torch op, "adaptex::<name>"
    function: str  # the ONNX function its ONNX and TensorRT lowerings emit (the node's op_type)
    routing_inputs: tuple[str, ...]  # inputs that carry routing, by the op's (and the function's) input names
    decisions: dict[str, str] = field(default_factory=dict)  # recorded field -> decision kind
    margins: dict[str, Margin] = field(default_factory=dict)  # decision kind -> its margin
    # Core ML: the name suffixes its MIL translation (exporter/targets/coreml/mil_ops.py) gives the
    # parts that stay fp32 in an fp16 body ("" is the op's own output), beside the routing
    coreml_fp32_parts: tuple[str, ...] = ()


OP_FACTS: dict[str, OpFacts] = {}


def register(facts: OpFacts) -> OpFacts:
    """Record an op's facts; a decision kind that two ops share must have one margin."""
    for kind, margin in facts.margins.items():
        for other in OP_FACTS.values():
            if kind in other.margins and other.margins[kind] != margin and other.op != facts.op:
                raise ValueError(f"{facts.op}: decision kind {kind!r} has margin {margin}, but {other.op} "
                                 f"declares {other.margins[kind]}: one kind, one margin")
    missing = set(facts.decisions.values()) - set(facts.margins)
    if missing:
        raise ValueError(f"{facts.op}: decision kinds {sorted(missing)} have no margin")
    OP_FACTS[facts.op] = facts
    return facts


def decision_kinds() -> dict[str, str]:
    """Recorded field -> decision kind, over every registered op."""
    return {f: k for facts in OP_FACTS.values() for f, k in facts.decisions.items()}


def margins() -> dict[str, dict[str, float]]:
    """{"fp32": {kind: margin}, "fp16": {...}} over every registered op."""
    every = {k: m for facts in OP_FACTS.values() for k, m in facts.margins.items()}
    return {"fp32": {k: m.fp32 for k, m in every.items()}, "fp16": {k: m.fp16 for k, m in every.items()}}


def margin_units() -> dict[str, str]:
    return {k: m.unit for facts in OP_FACTS.values() for k, m in facts.margins.items()}


def routing_inputs() -> dict[str, tuple[str, ...]]:
    """ONNX function name -> the inputs that carry routing."""
    return {facts.function: facts.routing_inputs for facts in OP_FACTS.values()}
