"""The parity report: per output its errors and the tolerance used, per decision its agreement,
excused and unexcused flips; what `adaptex check` prints and `--json` writes."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

import adaptex.graphs.ops  # noqa: F401  (registers the ops and their facts)
from adaptex.graphs.ops.facts import margin_units, margins

# Tolerances by body precision (docs/parity.md); never loosened silently. A quantized artifact's
# (docs/quantization.md): atol is a fraction of each output's largest |value| in the batch
# ("of_largest"), as int8 rounding error scales with the values it rounds; the activations' one
# scale per call (DynamicQuantizeLinear) rounds at 1/255 of their range at every MatMul, and
# budgetformer-graded's logits (fp32 routers, every decision agreeing) move by 0.030 of their largest.
# A palettized Core ML package's more: 64 or 16 values (one k-means table per tensor) stand for every
# weight of a matrix.
# A bf16 artifact's (OpenVINO) the same way: bf16 keeps 8 bits of mantissa, and the dense charlm
# decoder alone needs 0.24 of the largest |value| in its KV cache under OpenVINO's bf16 hint. For
# each of these an error within `floor` (fp16's atol) passes too: a router's score near 0 (TSA's p of
# 1e-8 in a batch that drops every token) has no largest value to scale by.
TOLERANCES = {"fp32": {"atol": 1e-4, "rtol": 1e-3}, "fp16": {"atol": 1e-2, "rtol": 1e-2},
              "bf16": {"atol": 0.3, "rtol": 0.0, "of_largest": True, "floor": 1e-2},
              "int8": {"atol": 0.05, "rtol": 0.0, "of_largest": True, "floor": 1e-2},
              "int4": {"atol": 0.15, "rtol": 0.0, "of_largest": True, "floor": 1e-2},
              "palettize6": {"atol": 0.15, "rtol": 0.0, "of_largest": True, "floor": 1e-2},
              "palettize4": {"atol": 0.3, "rtol": 0.0, "of_largest": True, "floor": 1e-2}}
# A quantized or bf16 artifact's decisions may flip where its noise moves a score across its boundary: each
# flip is counted and replayed, and the check fails when the flip rate (1 - agreement over every
# decision compared) passes this bound.
FLIP_BOUNDS = {"int8": 0.01, "int4": 0.02, "bf16": 0.01, "palettize6": 0.02, "palettize4": 0.03}
# Decision margins by decision kind, as the ops declare them (graphs/ops/<op>.py, FACTS): a flip is
# excused only when the reference was closer than this to the boundary, in the kind's own unit. A
# quantized artifact's margins are fp32's (its routers are fp32; a flip past them is counted).
MARGINS = margins()
MARGINS.update({k: MARGINS["fp32"] for k in FLIP_BOUNDS})
# What each kind's margin measures, for failure messages
MARGIN_UNITS = margin_units()


@dataclass
class OutputStat:
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    needed_atol: float = 0.0  # the smallest atol that passes at the stated rtol
    worst_input: str = ""


@dataclass
class DecisionStat:
    kind: str = ""
    compared: int = 0
    agreed: int = 0
    excused: int = 0
    unexcused: int = 0
    values_seen: dict = field(default_factory=dict)  # k -> count (k decisions only)

    def count(self, flip: np.ndarray, excusable: np.ndarray, where: np.ndarray | None = None) -> None:
        """Fold one batch in: `flip` where artifact and reference disagree, `excusable` where the
        reference sat within the margin; `where` limits the count (e.g. to real tokens)."""
        w = np.ones_like(flip, dtype=bool) if where is None else where
        self.compared += int(w.sum())
        self.agreed += int((~flip & w).sum())
        self.excused += int((flip & excusable & w).sum())
        self.unexcused += int((flip & ~excusable & w).sum())


@dataclass
class ParityReport:
    artifact: str
    runtime: str
    precision: str
    tolerance: dict
    margins: dict
    samples: int = 0
    batches: int = 0
    outputs: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    note: str = ""
    reference: str = "eager PyTorch (hard mode)"
    ranges: object = None  # runtimes.fp16.Ranges, when the artifact's fp16 ranges were tracked
    flip_bound: float | None = None  # a quantized artifact's: flips counted, failing past this rate

    @property
    def flip_rate(self) -> float:
        return 1.0 - self.decision_agreement

    @property
    def max_abs_err(self) -> float:
        return max((o.max_abs_err for o in self.outputs.values()), default=0.0)

    @property
    def unexcused_flips(self) -> int:
        return sum(d.unexcused for d in self.decisions.values())

    @property
    def excused_flips(self) -> int:
        return sum(d.excused for d in self.decisions.values())

    @property
    def decision_agreement(self) -> float:
        c = sum(d.compared for d in self.decisions.values())
        return sum(d.agreed for d in self.decisions.values()) / c if c else 1.0

    @property
    def decisions_vary(self) -> bool:
        return any(len(d.values_seen) > 1 for d in self.decisions.values() if d.kind in ("budget", "keep", "head_mode"))

    @property
    def passed(self) -> bool:
        return not self.failures and self.samples > 0

    def to_dict(self) -> dict:
        return {
            "passed": self.passed, "artifact": self.artifact, "runtime": self.runtime,
            "precision": self.precision, "samples": self.samples, "batches": self.batches,
            "max_abs_err": self.max_abs_err,
            "max_rel_err": max((o.max_rel_err for o in self.outputs.values()), default=0.0),
            "tolerance": self.tolerance, "margins": self.margins,
            "decision_agreement": self.decision_agreement,
            "unexcused_flips": self.unexcused_flips, "excused_flips": self.excused_flips,
            "decisions_vary": self.decisions_vary, "flip_rate": self.flip_rate, "flip_bound": self.flip_bound,
            "outputs": {k: asdict(v) for k, v in self.outputs.items()},
            "decisions": {k: {**asdict(v), "values_seen": {str(a): b for a, b in sorted(v.values_seen.items())}}
                          for k, v in self.decisions.items()},
            "failures": self.failures[:50], "note": self.note, "reference": self.reference,
            **({"fp16_ranges": self.ranges.to_dict(), "fp16_over_limit": [n for n, _ in self.ranges.over()]}
               if self.ranges is not None else {}),
        }

    def format(self) -> str:
        tol = self.tolerance
        scaled = " (atol: a fraction of each output's largest |value|" if tol.get("of_largest") else ""
        scaled += (f", or {tol['floor']:g}" if tol.get("floor") else "") + (")" if scaled else "")
        lines = [f"parity: {self.artifact} on {self.runtime} against {self.reference}",
                 f"  {self.samples} sequences in {self.batches} batches; {self.precision} tolerance "
                 f"atol={tol['atol']:g} rtol={tol['rtol']:g}{scaled}"]
        if self.flip_bound is not None:
            lines.append(f"  {self.precision}: each flipped decision is counted and replayed; the check fails past "
                         f"a flip rate of {self.flip_bound:g} (this run: {self.flip_rate:.4f})")
        if self.note:
            lines.append(f"  note: {self.note}")
        need = "needs atol" if not scaled else "needs frac"
        lines.append(f"  {'output':<30} {'max abs':>10} {'max rel':>10} {need:>11}")
        for name, o in self.outputs.items():
            lines.append(f"  {name:<30} {o.max_abs_err:10.2e} {o.max_rel_err:10.2e} {o.needed_atol:11.2e}")
        lines.append(f"  {'decision':<30} {'agree':>10} {'excused':>8} {'unexcused':>10}  values seen")
        for name, d in self.decisions.items():
            seen = ",".join(f"{k}:{v}" for k, v in sorted(d.values_seen.items())) if d.values_seen else ""
            lines.append(f"  {name:<30} {d.agreed / max(d.compared, 1):10.4f} {d.excused:8d} {d.unexcused:10d}  {seen}")
        for f in self.failures[:10]:
            lines.append(f"  FAIL {f}")
        if len(self.failures) > 10:
            lines.append(f"  ... and {len(self.failures) - 10} more failures")
        if self.ranges is not None:
            lines += self.ranges.format()
        verdict = "PASSED" if self.passed else "FAILED"
        flips = (f"flip rate {self.flip_rate:.4f} (bound {self.flip_bound:g})" if self.flip_bound is not None
                 else f"unexcused flips {self.unexcused_flips}")
        lines.append(f"  {verdict}: decision agreement {self.decision_agreement:.4f}, {flips}, "
                     f"max abs error {self.max_abs_err:.2e}")
        if not self.decisions_vary and self.decisions:
            lines.append("  warning: the decisions were the same on every input; the checked inputs did not exercise the routing")
        return "\n".join(lines)
