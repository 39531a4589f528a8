"""The fp16 audit: an fp16 Core ML package evaluated at its worst before anyone ships it.

Core ML's CPU and GPU kernels are believed to accumulate fp16 work in fp32, but a package that may
run on the Neural Engine must not depend on it (runtimes/fp16.py). The audit evaluates the saved
program with fp16 arithmetic throughout on a few of the model's inputs and refuses it when
- an fp16 intermediate, or a reduction's partial sums, reach past 65504 (the layer and the range);
- a decision flips outside its margin;
- a model output drifts past the fp16 tolerance (the recorded routing values are reported, not
  judged: what they drive, the decisions, is).
"""
from __future__ import annotations

from dataclasses import dataclass

from adaptex.runtimes.fp16 import FP16_MAX, Ranges
from adaptex.runtimes.report import ParityReport


@dataclass
class AuditResult:
    passed: bool
    reason: str
    report: ParityReport
    ranges: Ranges


def fp16_audit(path, model, contract, *, task: str | None = None, inputs: list[dict] | None = None,
               samples: int = 6) -> AuditResult:
    """Evaluate the fp16 package at `path` with fp16 accumulation against the eager `model`."""
    from adaptex.runtimes.coreml_mil import MilReferenceRunner
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.torch_ref import TorchRunner

    runner = MilReferenceRunner(path, accumulate="fp16", track_ranges=True)
    items = inputs if inputs is not None else contract.parity_items(task, samples, seed=1)
    if items is None:  # a model of your own: its example inputs
        items = [{n: t.detach().numpy() for n, t in zip(contract.input_names(), contract.example_inputs())}]
    report = check(runner, TorchRunner(model, contract=contract), inputs=items, precision="fp16",
                   artifact_name=str(path))
    over = runner.ranges.over()
    if over:
        name, r = over[0]
        what = "its partial sums reach" if (r.partial_sum or 0) > r.max_abs else "its values reach"
        return AuditResult(False, f"{r.op_type} {name}: {what} {r.worst:.4g}, past fp16's {FP16_MAX:g}",
                           report, runner.ranges)
    if report.unexcused_flips:
        first = next(f for f in report.failures if "unexcused flip" in f)
        return AuditResult(False, f"{report.unexcused_flips} decision(s) flip: {first}", report, runner.ranges)
    outputs = set(contract.model_output_names())
    tol = report.tolerance
    for name, st in report.outputs.items():
        if name in outputs and st.needed_atol > tol["atol"]:
            return AuditResult(False, f"{name} drifts {st.max_abs_err:.3g} from the eager model (it needs atol "
                                      f"{st.needed_atol:.3g} > {tol['atol']:g} at rtol {tol['rtol']:g})",
                               report, runner.ranges)
    return AuditResult(True, "", report, runner.ranges)


def describe(result: AuditResult) -> str:
    worst = result.ranges.top(1)
    peak = f"; largest fp16 value or partial sum {worst[0][1].worst:.4g} ({worst[0][0]})" if worst else ""
    drift = max((s.max_abs_err for s in result.report.outputs.values()), default=0.0)
    return (f"fp16 audit (fp16 accumulation throughout, {result.report.samples} inputs): "
            f"{'passed' if result.passed else 'FAILED: ' + result.reason}; max drift {drift:.3g}{peak}")

