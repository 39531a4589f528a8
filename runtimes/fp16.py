"""fp16 arithmetic at its worst, and the ranges an fp16 program reaches.

The MIL reference evaluator (coreml_mil.py) evaluates fp16 ops with fp32 accumulation by default, as
Core ML's CPU and GPU kernels are believed to. The Neural Engine's reductions are reported to
overflow exactly at the naive fp16 boundary (coremltools #2690: a logsumexp cliff where the sum of
exps passes 65504; swift-transformers #95: norms overflowing on activations in the hundreds of
thousands). `accumulate="fp16"` evaluates the worst case instead: every product rounded to fp16 and
every sum accumulated in fp16, one term at a time, left to right. Normalisation statistics (means,
variances, norms) and softmax sums included.

`Ranges` records, for every fp16 intermediate, its largest |x| over the inputs seen, and for every
reduction a bound on its partial sums (the sum of the terms' magnitudes, which no partial sum of
any order exceeds), against FP16_MAX.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FP16_MAX = 65504.0


def _front(x: np.ndarray, axes) -> np.ndarray:
    """x with `axes` moved to the front and flattened into one: (n, ...rest)."""
    axes = tuple(sorted(a % x.ndim for a in np.atleast_1d(axes))) if axes is not None else tuple(range(x.ndim))
    moved = np.moveaxis(x, axes, tuple(range(len(axes))))
    return moved.reshape((-1,) + moved.shape[len(axes):])


def sum16(x: np.ndarray, axes=None, keepdims: bool = False) -> np.ndarray:
    """Σ over `axes`, accumulated in fp16 one term at a time (numpy rounds every fp16 add)."""
    x16 = np.asarray(x, np.float16)
    terms = _front(x16, axes)
    acc = np.zeros(terms.shape[1:], np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        for t in terms:
            acc = acc + t
    if keepdims:
        ax = tuple(sorted(a % x16.ndim for a in np.atleast_1d(axes))) if axes is not None else tuple(range(x16.ndim))
        for a in ax:
            acc = np.expand_dims(acc, a)
    return acc


def matmul16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b with fp16 products and an fp16 running sum over the inner axis."""
    a16, b16 = np.asarray(a, np.float16), np.asarray(b, np.float16)
    K = a16.shape[-1]
    acc = np.zeros(np.broadcast_shapes(a16.shape[:-1] + (1,), b16.shape[:-2] + (1, b16.shape[-1])), np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(K):
            acc = acc + a16[..., :, k:k + 1] * b16[..., k:k + 1, :]
    return acc


def matmul_bound(a: np.ndarray, b: np.ndarray) -> float:
    """The largest Σ_k |a_k b_k| over the outputs of a @ b: no partial sum's magnitude exceeds it."""
    return float(np.max(np.abs(a.astype(np.float32)) @ np.abs(b.astype(np.float32)))) if a.size and b.size else 0.0


def sum_bound(x: np.ndarray, axes=None, square: bool = False) -> float:
    """The largest Σ|x| (or Σx²) over the reduced axes."""
    if not x.size:
        return 0.0
    t = np.abs(x.astype(np.float32))
    t = t * t if square else t
    ax = tuple(sorted(a % x.ndim for a in np.atleast_1d(axes))) if axes is not None else None
    return float(np.max(t.sum(axis=ax)))


@dataclass
class OpRange:
    op_type: str
    max_abs: float = 0.0  # the largest |x| of the op's fp16 output
    partial_sum: float | None = None  # a bound on its reduction's partial sums, where it reduces

    @property
    def worst(self) -> float:
        return max(self.max_abs, self.partial_sum or 0.0)


@dataclass
class Ranges:
    """Per fp16 op (by name): the largest |x| of its output and, for a reduction, its partial-sum bound."""
    ops: dict[str, OpRange] = field(default_factory=dict)

    def note(self, name: str, op_type: str, out: np.ndarray, partial: float | None = None,
             inputs_finite: bool = True) -> None:
        """Fold one evaluation of an op in. An infinity the op makes from finite inputs is an overflow;
        one it passes on (a -inf attention mask through an add or a select) is not."""
        r = self.ops.setdefault(name, OpRange(op_type))
        if out.size and out.dtype.kind == "f":
            finite = np.isfinite(out)
            if finite.any():
                r.max_abs = max(r.max_abs, float(np.abs(out[finite].astype(np.float32)).max()))
            if inputs_finite and not finite.all():
                r.max_abs = float("inf")
        if partial is not None:
            r.partial_sum = max(r.partial_sum or 0.0, partial)

    def over(self, limit: float = FP16_MAX) -> list[tuple[str, OpRange]]:
        return sorted(((n, r) for n, r in self.ops.items() if r.worst > limit), key=lambda x: -x[1].worst)

    def top(self, n: int = 10) -> list[tuple[str, OpRange]]:
        return sorted(self.ops.items(), key=lambda x: -x[1].worst)[:n]

    def to_dict(self) -> dict:
        return {name: {"op": r.op_type, "max_abs": r.max_abs, "partial_sum_bound": r.partial_sum}
                for name, r in self.ops.items()}

    def format(self, n: int = 10) -> list[str]:
        lines = [f"  fp16 ranges: {len(self.ops)} fp16 ops; {len(self.over())} reach past {FP16_MAX:g} "
                 "(largest |x| or partial-sum bound)",
                 f"  {'op':<40} {'type':<14} {'max |x|':>10} {'partial sum':>12}"]
        for name, r in self.top(n):
            ps = f"{r.partial_sum:12.4g}" if r.partial_sum is not None else f"{'-':>12}"
            lines.append(f"  {name[:40]:<40} {r.op_type:<14} {r.max_abs:10.4g} {ps}")
        return lines
