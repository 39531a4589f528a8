"""Guards: which program of an artifact a call runs, as data.

An artifact that holds several programs (exporter/targets/onnx/dispatch.py) chooses one per call by
a decision list: the first program whose guard holds runs, the last (no guard) otherwise. A guard is
a small declarative condition on the call's input shapes: a product of input axes (each optionally
less a constant, floored at 0) times a constant, compared with a number, and any combination of
those with all / any. The one object builds the ONNX nodes of the file's If condition and answers
the same question in Python, so the runner, parity and bench read the stored guards and never derive
a condition again. In the metadata a guard is JSON, validated when read and never evaluated as code.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import helper, numpy_helper

from adaptex.graphs.errors import AdaptexError

_OPS = {"<=": ("LessOrEqual", lambda a, b: a <= b), ">=": ("GreaterOrEqual", lambda a, b: a >= b),
        ">": ("Greater", lambda a, b: a > b), "==": ("Equal", lambda a, b: a == b)}


class GuardError(AdaptexError):
    """A stored guard that is not one this version reads."""


@dataclass(frozen=True)
class Axis:
    """The length of `input`'s axis `axis`, less `minus` and floored at 0 where minus > 0."""
    input: str
    axis: int
    minus: int = 0

    def value(self, shapes: dict) -> int:
        n = int(shapes[self.input][self.axis])
        return max(0, n - self.minus) if self.minus else n


@dataclass(frozen=True)
class Compare:
    """product(axes) x scale <op> value."""
    axes: tuple[Axis, ...]
    op: str
    value: int
    scale: int = 1

    def holds(self, shapes: dict) -> bool:
        n = self.scale
        for a in self.axes:
            n *= a.value(shapes)
        return bool(_OPS[self.op][1](n, self.value))

    def inputs(self) -> set[str]:
        return {a.input for a in self.axes}

    def to_dict(self) -> dict:
        return {"axes": [[a.input, a.axis] + ([a.minus] if a.minus else []) for a in self.axes], "op": self.op,
                "value": self.value, **({"scale": self.scale} if self.scale != 1 else {})}


@dataclass(frozen=True)
class _Parts:
    """Guards combined: every one holds (AllOf) or any one (AnyOf)."""
    parts: tuple
    key = ""  # the metadata's word for it

    def holds(self, shapes: dict) -> bool:
        return (all if self.key == "all" else any)(p.holds(shapes) for p in self.parts)

    def inputs(self) -> set[str]:
        return set().union(*(p.inputs() for p in self.parts))

    def to_dict(self) -> dict:
        return {self.key: [p.to_dict() for p in self.parts]}


class AllOf(_Parts):
    key = "all"


class AnyOf(_Parts):
    key = "any"


Guard = Compare | AllOf | AnyOf


# --- the guards an exporter builds --------------------------------------------------------------------

def rows_at_most(rows_input: str, n: int) -> Compare:
    """batch x sequence (the first two axes of `rows_input`) <= n."""
    return Compare((Axis(rows_input, 0), Axis(rows_input, 1)), "<=", _whole(n, "rows"))


def one_new_token(ids_input: str) -> Compare:
    return Compare((Axis(ids_input, 1),), "==", 1)


def decode_step(ids_input: str, past_input: str) -> AllOf:
    """One new token after a non-empty cache (axis 2 of `past_input`)."""
    return AllOf((one_new_token(ids_input), Compare((Axis(past_input, 2),), ">", 0)))


def no_cache(cache_input: str) -> Compare:
    return Compare((Axis(cache_input, 2),), "==", 0)


def keys_at_most(keys_input: str, n: int) -> Compare:
    """The attention mask's key count (axis 1) <= n."""
    return Compare((Axis(keys_input, 1),), "<=", _whole(n, "keys"))


def excess_at_most(keys_input: str, heads: int, beyond: int, up_to: int, batch: bool = True) -> Compare:
    """(batch x) heads x keys x max(0, keys - beyond) <= up_to: the scores masking adds over
    block-local streaming attention (graphs.ops.elastic_attention.masked_excess); batch=False: a
    sample's."""
    axes = ((Axis(keys_input, 0),) if batch else ()) + (Axis(keys_input, 1), Axis(keys_input, 1, beyond))
    return Compare(axes, "<=", _whole(up_to, "excess up_to"), scale=_whole(heads, "heads"))


def large_call(ids_input: str, keys_input: str, heads: int, from_scores: int) -> AllOf:
    """batch > 1 and batch x new tokens x keys x heads >= from_scores: attention a sample at a time."""
    return AllOf((Compare((Axis(ids_input, 0),), ">", 1),
                Compare((Axis(ids_input, 0), Axis(ids_input, 1), Axis(keys_input, 1)), ">=",
                        _whole(from_scores, "from_scores"), scale=_whole(heads, "heads"))))


def _whole(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise AdaptexError(f"a guard's {what} must be a whole number, got {n!r}")
    return int(n)


# --- the If condition in the graph ----------------------------------------------------------------------

def nodes(guard: Guard, prefix: str) -> tuple[list, list, str]:
    """The ONNX nodes computing `guard` as a bool scalar from the graph's inputs, the int64 constants
    they read (initializers), and the scalar's name; every name starts with `prefix`."""
    out, consts, made = [], {}, {}

    def const(v: int) -> str:
        name = f"{prefix}c{v}"
        consts.setdefault(name, numpy_helper.from_array(np.array(v, dtype=np.int64), name))
        return name

    def node(op: str, ins: list, tag: str) -> str:
        name = f"{prefix}{tag}_{len(out)}"
        out.append(helper.make_node(op, ins, [name], name=name))
        return name

    def axis(a: Axis) -> str:
        key = (a.input, a.axis, a.minus)
        if key not in made:
            shape = f"{prefix}{a.input}.{a.axis}.1"
            if shape not in {o for n in out for o in n.output}:
                out.append(helper.make_node("Shape", [a.input], [shape], name=shape, start=a.axis, end=a.axis + 1))
                out.append(helper.make_node("Squeeze", [shape], [shape[:-2]], name=f"{shape[:-2]}.squeeze"))
            v = shape[:-2]
            if a.minus:
                v = node("Max", [node("Sub", [v, const(a.minus)], "sub"), const(0)], "past")
            made[key] = v
        return made[key]

    def build(g) -> str:
        if isinstance(g, Compare):
            v = const(g.scale) if g.scale != 1 or not g.axes else None
            for a in g.axes:
                v = axis(a) if v is None else node("Mul", [v, axis(a)], "mul")
            return node(_OPS[g.op][0], [v, const(g.value)], "cmp")
        op = "And" if isinstance(g, AllOf) else "Or"
        parts = [build(p) for p in g.parts]
        v = parts[0]
        for p in parts[1:]:
            v = node(op, [v, p], op.lower())
        return v

    cond = build(guard)
    return out, list(consts.values()), cond


# --- the metadata ----------------------------------------------------------------------------------------

def from_dict(d, where: str = "guard") -> Guard:
    """A guard read back from the metadata, every field checked (never evaluated as code)."""
    if not isinstance(d, dict):
        raise GuardError(f"{where}: a guard is a JSON object, got {type(d).__name__}")
    if set(d) in ({"all"}, {"any"}):
        (kind, parts), = d.items()
        if not isinstance(parts, list) or not parts:
            raise GuardError(f"{where}: '{kind}' needs a non-empty list of guards")
        made = tuple(from_dict(p, f"{where}.{kind}[{i}]") for i, p in enumerate(parts))
        return AllOf(made) if kind == "all" else AnyOf(made)
    if not {"axes", "op", "value"} <= set(d) or not set(d) <= {"axes", "op", "value", "scale"}:
        raise GuardError(f"{where}: a comparison has axes, op, value and optionally scale; got {sorted(d)}")
    if d["op"] not in _OPS:
        raise GuardError(f"{where}: op {d['op']!r} is not one of {', '.join(_OPS)}")
    axes = d["axes"]
    if not isinstance(axes, list):
        raise GuardError(f"{where}: axes must be a list of [input, axis(, minus)]")
    made = []
    for a in axes:
        ok = isinstance(a, list) and len(a) in (2, 3) and isinstance(a[0], str) \
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in a[1:])
        if not ok:
            raise GuardError(f"{where}: axis {a!r} is not [input name, axis(, minus)] with whole numbers")
        made.append(Axis(a[0], a[1], a[2] if len(a) == 3 else 0))
    for k in ("value", "scale"):
        v = d.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GuardError(f"{where}: {k} must be a whole number, got {v!r}")
    return Compare(tuple(made), d["op"], d["value"], d.get("scale", 1))


def read_programs(meta: dict, where: str = "metadata") -> list[tuple[str, Guard | None]]:
    """The artifact's programs as (name, guard), in the order a call tries them: the metadata's
    'programs' list, the last one's guard null. [] for an artifact of one program."""
    entries = meta.get("programs")
    if entries is None:
        return []
    if not isinstance(entries, list) or len(entries) < 2:
        raise GuardError(f"{where}: 'programs' must list at least two programs")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or "guard" not in e:
            raise GuardError(f"{where}: programs[{i}] needs a name and a guard")
        last = i == len(entries) - 1
        if (e["guard"] is None) != last:
            raise GuardError(f"{where}: programs[{i}]: only the last program has no guard")
        out.append((e["name"], None if last else from_dict(e["guard"], f"{where}: programs[{i}].guard")))
    return out


def chosen(programs: list[tuple[str, Guard | None]], shapes: dict) -> int:
    """The index of the program a call of these input shapes runs: the first whose guard holds."""
    for i, (_, guard) in enumerate(programs):
        if guard is None or guard.holds(shapes):
            return i
    raise AssertionError("the last program has no guard")
