"""coremltools conversion of a traced program: flexible input shapes, the fp16 op selector that keeps
routing (and a contract's roles) in fp32, fp32 float outputs; and the stock counterparts bench times."""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

from adaptex.exporter.targets.coreml import package, precision
from adaptex.exporter.targets.coreml.decompose import decompositions
from adaptex.graphs import files
from adaptex.exporter.trace import io_specs


def convert(ep, inputs: dict, outputs: dict, prec: str, min_target: str, keep_fp32: set[str],
            keep_between: bool, max_sequence: int):
    """ct.convert an ExportedProgram to an ML program. inputs/outputs: the package's I/O (package.coreml_io,
    in program order). In fp16, the FX nodes in keep_fp32 (and every op whose name carries a
    precision.FP32_PREFIXES prefix) stay fp32, and every float output is fp32. keep_between: an op fed
    only by kept ops and read only by kept ops stays fp32 too."""
    import coremltools as ct

    logging.getLogger("coremltools").setLevel(logging.ERROR)
    with warnings.catch_warnings(), quiet_progress():
        warnings.simplefilter("ignore")
        if prec == "fp16":
            # coremltools names the MIL op of an unsuffixed FX node "linear" as "linear_0"
            keep = keep_fp32 | {n + "_0" for n in keep_fp32 if not n.rsplit("_", 1)[-1].isdigit()}

            def kept(op) -> bool:
                # by output name too: translations such as aten.linear's name the result after the FX
                # node while the op takes a counter name from coremltools (linear_4; _fresh_op_names)
                return (op.name in keep or op.op_type in precision.FP32_OP_TYPES
                        or op.name.startswith(precision.FP32_PREFIXES)
                        or any(v.name in keep or v.name.startswith(precision.FP32_PREFIXES) for v in op.outputs))

            def between(op) -> bool:
                ins = [v.op for v in op.inputs.values() if not isinstance(v, (list, tuple))
                       and v.op is not None and v.op.op_type != "const"]
                # a shape op reads no values (F.normalize's clamp_min feeds expand_as's shape)
                outs = [c for v in op.outputs for c in v.child_ops if c.op_type != "shape"]
                return bool(ins and outs) and all(kept(o) for o in ins + outs)

            compute = ct.transform.FP16ComputePrecision(
                op_selector=lambda op: not kept(op) and not (keep_between and between(op)))
        else:
            compute = ct.precision.FLOAT32
        with _fresh_op_names():
            return ct.convert(ep, convert_to="mlprogram", inputs=package.input_types(inputs, max_sequence),
                              minimum_deployment_target=getattr(ct.target, min_target), compute_precision=compute,
                              outputs=[ct.TensorType(name=s["coreml_name"], dtype=precision.output_dtype(s["dtype"]))
                                       for s in outputs.values()])


@contextlib.contextmanager
def _fresh_op_names():
    """Number coremltools' generated op names from zero for one conversion, as in a new process.
    coremltools counts them per op type for the whole process (mil.Builder.name_count): after other
    MIL programs were built (another conversion, the MIL evaluator's tests), a head Linear was named
    linear_14 where the FP16 op selector keeps linear_13, and went fp16 (the package's op names, and
    so its fp32 ops, depended on what the process had done before)."""
    from coremltools.converters.mil.mil import Builder

    counts = getattr(Builder, "name_count", None)
    if counts is None:  # another coremltools: nothing to reset
        yield
        return
    saved = dict(counts)
    counts.clear()
    try:
        yield
    finally:
        counts.clear()
        counts.update(saved)


@contextlib.contextmanager
def quiet_progress():
    """coremltools draws a tqdm bar for every pass of every conversion (on stderr, which tqdm looks up
    when a bar starts); adaptex reports its own progress. Failures still raise."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def export_stock(model, contract, out, mode: str, *, prec: str = "fp16",
                 min_target: str = package.DEFAULT_MIN_TARGET) -> Path:
    """The model's `mode` path (a contract's dense or naive counterpart mode) converted by stock
    coremltools, as `adaptex bench`'s counterparts: no adaptex translation, the tails kept fp32 like
    the adaptive package's. Raises whatever coremltools raises (a data-dependent top-k does not
    convert)."""
    import torch

    wrapper = contract.wrapper(model, mode)
    example = tuple(t.float() if t.dtype == torch.bool else t for t in contract.example_inputs(mode))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(wrapper, example, dynamic_shapes=contract.dynamic_shapes(mode)).run_decompositions(decompositions())
    inputs, outputs = package.coreml_io(*io_specs(ep, contract, mode))
    precision.bool_ops_as_logical(ep)
    keep, between = precision.keep_fp32(ep, contract, adaptive=False)
    if prec == "fp16":
        precision.saturate_fp16_constants(ep, keep)
    with files.tempdir_for_libraries():  # coremltools' intermediate package lives there until saved
        mlmodel = convert(ep, inputs, outputs, prec, min_target, keep, between, contract.max_sequence or 4096)
        out = Path(out)
        mlmodel.save(str(out))
    return out
