"""The lowering registry: (op, target, variant) -> lowering, with reasons when none applies.

A lowering is registered with a decorator that names its cell (one target or several: an ONNX
function body serves both onnx and tensorrt), an optional validator and a priority; lookup returns
the highest-priority lowering whose validator accepts the node, and otherwise raises
UnsupportedLowering listing why each candidate declined. A cell that cannot work is registered
explicitly with `unsupported(...)`, so the op x target matrix has no empty cell.

The registry imports no target: each target's lowerings module registers itself when imported
(exporter.targets loads them), as Torch-TensorRT's converters do.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from adaptex.exporter.errors import UnsupportedLowering

VARIANTS = ("sparse", "dense")

# A validator returns None to accept the node, or a one-line reason to decline it.
Validator = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Lowering:
    op: str
    target: str
    variant: str
    fn: Callable
    validator: Validator | None = None
    priority: int = 0
    unsupported_reason: str | None = None
    doc: str = field(default="", compare=False)

    def decline_reason(self, node: Any) -> str | None:
        if self.unsupported_reason is not None:
            return self.unsupported_reason
        return self.validator(node) if self.validator else None


_REGISTRY: dict[tuple[str, str, str], list[Lowering]] = {}


def _check_cell(op: str, target: str, variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: expected one of {VARIANTS}")


def register(entry: Lowering) -> Lowering:
    _check_cell(entry.op, entry.target, entry.variant)
    cell = _REGISTRY.setdefault((entry.op, entry.target, entry.variant), [])
    cell.append(entry)
    cell.sort(key=lambda e: -e.priority)
    return entry


def lowering(op: str, *, target: str | tuple[str, ...], variant: str, validator: Validator | None = None,
             priority: int = 0):
    """Decorator: register `fn(ctx, node)` as the lowering of `op` for (target, variant); a tuple of
    targets registers the one function in each of their cells."""
    def wrap(fn: Callable) -> Callable:
        for t in (target,) if isinstance(target, str) else target:
            register(Lowering(op, t, variant, fn, validator, priority, doc=(fn.__doc__ or "").strip()))
        return fn
    return wrap


def unsupported(op: str, *, target: str, variant: str, reason: str) -> None:
    """Declare a cell that cannot work (yet), with the reason users will read."""
    def refuse(*_a, **_k):
        raise UnsupportedLowering(op, target, variant, [reason])
    register(Lowering(op, target, variant, refuse, unsupported_reason=reason, priority=-1000))


def lookup(op: str, target: str, variant: str, node: Any = None) -> Lowering:
    """The lowering for this node, or UnsupportedLowering with every candidate's reason."""
    if variant not in VARIANTS:
        raise UnsupportedLowering(op, target, variant, [f"unknown variant; choose one of {', '.join(VARIANTS)}"])
    reasons = []
    for entry in _REGISTRY.get((op, target, variant), []):
        why = entry.decline_reason(node)
        if why is None:
            return entry
        reasons.append(f"{entry.fn.__name__}: {why}" if entry.unsupported_reason is None else why)
    raise UnsupportedLowering(op, target, variant, reasons)


def cells() -> dict[tuple[str, str, str], list[Lowering]]:
    """Every registered cell (for the docs' matrix and the no-empty-cell test); load the targets
    first (exporter.targets.load_all)."""
    return {k: list(v) for k, v in _REGISTRY.items()}


@contextlib.contextmanager
def override(*entries: Lowering, replace: bool = False) -> Iterator[None]:
    """Put `entries` first in their cell for the duration, or make them the whole cell with
    replace=True (tests swap lowerings this way, never by patching globals)."""
    keys = {(e.op, e.target, e.variant) for e in entries}
    saved = {key: list(_REGISTRY.get(key, [])) for key in keys}
    for key in keys:
        mine = [e for e in entries if (e.op, e.target, e.variant) == key]
        _REGISTRY[key] = mine + ([] if replace else saved[key])
    try:
        yield
    finally:
        _REGISTRY.update(saved)

