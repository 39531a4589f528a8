"""Core ML target (ML program): each adaptex op translated to MIL through coremltools' torch.export path.

By concern: lowerings.py picks each op's MIL emitter (mil_ops.py) from the registry, precision.py
finds what an fp16 package keeps in fp32, convert.py runs coremltools, package.py names the
features and writes the package atomically. Nothing here keeps state between exports.

fp16 (default) or fp32 bodies; routing always fp32; a decoder's package defaults to fp32 (its fp16
package missed the fp16 tolerance on the shipped character LM even with the residual stream and
norms in fp32) and takes Optimum's decoder-with-past inputs with flexible batch, sequence and past
length. past_sequence may be 0 (package.MIN_PAST), so a prefill passes empty caches: coremltools 9
converts and saves such a range, but whether the Core ML runtime accepts a zero-length input on
every compute unit cannot be checked on Linux (coremltools issues #1040 and #2516 report zero-size
tensors and lower bounds of 0 failing at prediction time), so check a prefill on macOS first.

Packages are checked on Linux by runtimes/coreml_mil.py and on macOS by runtimes/coreml.py.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

# before coremltools is first imported: its import warns about untested torch and scikit-learn versions
# and missing macOS-only libraries, ten lines before anything adaptex says
logging.getLogger("coremltools").setLevel(logging.ERROR)

from adaptex.exporter import metadata
from adaptex.exporter.errors import ExportError
from adaptex.exporter.registry import lookup
from adaptex.exporter.targets import Option, Target, register_target
from adaptex.exporter.targets.coreml import lowerings  # noqa: F401  (registers the Core ML cells)
from adaptex.exporter.targets.coreml import package
from adaptex.exporter.targets.coreml import precision as policy
from adaptex.exporter.targets.coreml import quantize as cq
from adaptex.exporter.targets.coreml.convert import convert
from adaptex.exporter.targets.coreml.decompose import decompositions
from adaptex.exporter.targets.coreml.package import DEFAULT_MIN_TARGET, MIN_PAST, MIN_TARGETS  # noqa: F401
from adaptex.exporter.trace import adaptex_nodes, io_specs, op_name, trace
from adaptex.graphs import files

PRECISIONS = ("fp16", "fp32")


def default_precision(contract) -> str:
    return contract.coreml_default_precision


def export(model, contract, out, *, variant: str = "sparse", precision: str | None = None, source: dict,
           tokenizer: dict | None = None, min_target: str | None = None, quantize=None, quantize_routers=None,
           say=None) -> dict:
    """Convert to an ML program package at `out` (a directory, written atomically). quantize: int8,
    palettize4 or palettize6 weights, the routers float unless quantize_routers (quantize.py)."""
    prec = precision or default_precision(contract)
    scheme = cq.scheme_option(quantize, bool(quantize_routers))
    min_target = min_target or DEFAULT_MIN_TARGET
    if prec not in PRECISIONS:
        raise ExportError(f"precision {prec!r} is not supported for the coreml target; use fp16 or fp32")
    if min_target not in MIN_TARGETS:
        raise ExportError(f"unknown --min-target {min_target!r}; choose one of {', '.join(MIN_TARGETS)}")
    out = Path(out)
    package.check_output(out)
    try:
        import coremltools  # noqa: F401
    except ImportError as e:
        raise ExportError("the coreml target needs coremltools; install it with pip install 'adaptex[coreml]'") from e

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = trace(model, contract, mode="hard", float_bools=True).run_decompositions(decompositions())
    emitters, notes = {}, {}
    for node in adaptex_nodes(ep):
        entry = lookup(op_name(node), "coreml", variant, node)
        emitters[node.name] = entry.fn(None, node)
        notes[op_name(node)] = entry.fn.__name__
    inputs, outputs = package.coreml_io(*io_specs(ep, contract))
    policy.bool_ops_as_logical(ep)
    keep, between = policy.keep_fp32(ep, contract)
    if prec == "fp16":
        policy.saturate_fp16_constants(ep, keep)
    from adaptex.exporter.targets.coreml.mil_ops import register_translations

    register_translations(emitters)
    with files.tempdir_for_libraries():  # coremltools' intermediate package: deleted with it, even on SIGTERM
        try:
            mlmodel = convert(ep, inputs, outputs, prec, min_target, keep, between, contract.max_sequence or 4096)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ExportError(f"coremltools conversion failed: {first}") from e
        quantized = None
        if scheme is not None:
            if say:
                say(f"quantizing the weights ({scheme.name}, routers {'too' if scheme.routers else 'float'}) ...")
            mlmodel, quantized = cq.quantize(mlmodel, scheme, min_target)
        meta = _describe_and_save(mlmodel, contract, out, variant, prec, notes, inputs, outputs, source, tokenizer,
                                  min_target, quantized)
    return meta


def _describe_and_save(mlmodel, contract, out, variant, prec, notes, inputs, outputs, source, tokenizer,
                       min_target, quantized=None) -> dict:
    extra = {"routing_precision": "fp32", "min_target": min_target}
    if quantized is not None:
        extra["quantize"] = quantized
    if contract.decoder:
        extra["min_past_sequence"] = MIN_PAST
    if "residual_stream" in contract.coreml_fp32_roles:
        extra["residual_precision"] = "fp32"
    if "classifier_tail" in contract.coreml_fp32_roles or "pooling_tail" in contract.coreml_fp32_roles:
        extra["head_precision"] = "fp32"
    meta = metadata.build(contract, target="coreml", variant=variant, precision=prec, lowerings=notes,
                          inputs=inputs, outputs=outputs, source=source, opset={"adaptex": 1},
                          tokenizer=tokenizer, **extra)
    package.check_features(mlmodel, meta)
    package.describe(mlmodel, meta)
    package.stamp(mlmodel, meta)
    package.save(mlmodel, out)
    return meta


TARGET = register_target(Target(
    name="coreml", suffixes=(".mlpackage",), precisions=PRECISIONS, export=export,
    default_precision=default_precision, description="Core ML ML program package (iOS, macOS)",
    options=(Option("--min-target", f"minimum deployment target ({', '.join(MIN_TARGETS)}; default "
                                    f"{DEFAULT_MIN_TARGET})"),
             Option("--quantize", "int8: weights stored int8, one scale per output channel; palettize4 / "
                                  "palettize6: a k-means table of 16 / 64 values per tensor; Core ML expands them "
                                  "when it loads the package; routers stay float (docs/quantization.md)"),
             Option("--quantize-routers", "with --quantize: the routers' weights too (check reports the "
                                          "decisions that flip)", action="store_true"))))
