"""The public API: load, export, check and bench, for the shipped models and for models of your own.

    import adaptex
    model = adaptex.load("budgetformer-graded")            # or any nn.Module built from adaptex.nn
    adaptex.export(model, None, "bf.onnx")                  # a model of your own: its example inputs
    report = adaptex.check("bf.onnx", model)                # inputs=[(ids, mask), ...] for your own
    assert report.passed, report.format()
    print(adaptex.bench("bf.onnx", model)["latency_ratio"])

Each function is a thin composition of the rooms below (exporter, runtimes); docs/api.md has the rest.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from adaptex.runtimes.chunks import CHUNK_ROWS


def load(name_or_dir: str | Path | None = None):
    """A shipped model by name ('adaptex models' lists them) or a checkpoint directory, in eval mode.
    Its source record (name, hashes, tokenizer) rides along as `model.adaptex_source`."""
    from adaptex.graphs import checkpoint

    model, info = checkpoint.load(name_or_dir)
    default = name_or_dir or checkpoint.DEFAULT_MODEL
    # a shipped model is recorded by name; a directory by absolute path, so check/bench work from anywhere
    info["name"] = info["path"] if Path(str(default)).is_dir() else str(default)
    model.adaptex_source = info
    return model


def _measured_floor(say=None) -> dict:
    """The softmax floor an ONNX artifact gets by default: whichever of a causal Softmax plain and floored
    runs faster on this CPU (runtimes/cpu.py, floor_probe; well under a second), with why."""
    from adaptex.runtimes import cpu

    (say or (lambda m: None))("timing a causal Softmax plain and with the softmax floor on this CPU ...")
    probe = cpu.floor_probe(1)
    shape = "x".join(str(n) for n in probe["shape"])
    why = (f"measured at export on {cpu.describe()}: a causal {shape} Softmax took {probe['plain_ms']:.3f} ms plain, "
           f"{probe['floored_ms']:.3f} ms floored")
    return {"on": bool(probe["pays"]), "why": why}


def export(model, example_inputs=None, path=None, target: str = "onnx", variant: str = "sparse",
           precision: str | None = None, dynamic_shapes=None, *, example_kwargs: dict | None = None,
           validate: bool = True, fp16_audit: bool = True, say=None, **options) -> dict:
    """Export `model` to `path`: ONNX (`.onnx`), Core ML (`.mlpackage`) or TensorRT (`.plan`, or the
    TensorRT-bound `.onnx` with onnx_only=True). Returns the artifact's metadata.

    example_inputs: a tuple with one tensor per forward argument (batch >= 2), a dict of them by argument
    name, or None for a model from adaptex.load; example_kwargs: more keyword arguments (a tensor is an
    input, None, a bool, a number or a string a constant of every call). dynamic_shapes: torch.export's
    forms (a dict by argument name, a tuple or a list; Dim, Dim.AUTO, Dim.DYNAMIC). The decisions become outputs named `decisions.<module path>.<field>`.
    An fp16 Core ML package is audited before it is written (runtimes/audit.py: fp16 arithmetic
    throughout, as the Neural Engine may compute); one that fails is refused with the layer and the
    range or drift; where fp16 was the model's default precision rather than asked for, the package is
    written in fp32 instead, and `say` is told why. fp16_audit=False writes it unaudited.
    validate (default True): the written artifact is checked against the eager model before it takes
    its name (runtimes/validation.py: a shipped model's generated inputs, or your example inputs and
    variations of their batch, lengths and padding); a mismatch raises ValidationFailed with the
    report and keeps the artifact as `<stem>.failed<suffix>`. A TensorRT engine, OpenVINO IR and a
    target of your own are not validated (check them with `adaptex check` where they run). The model's training mode (every
    submodule's) is as it was when export returns or raises."""
    modes = [(m, m.training) for m in model.modules()] if hasattr(model, "modules") else []
    try:
        return _export_model(model, example_inputs, path, target, variant, precision, dynamic_shapes,
                             example_kwargs=example_kwargs, validate=validate, fp16_audit=fp16_audit, say=say,
                             **options)
    finally:
        for m, training in modes:
            m.training = training


def _export_model(model, example_inputs, path, target, variant, precision, dynamic_shapes, *, example_kwargs,
                  validate, fp16_audit, say, **options) -> dict:
    from adaptex.exporter.export import resolve

    contract, t, prec = resolve(model, example_inputs, target, precision, dynamic_shapes,
                                options.pop("input_names", None), example_kwargs, variant)
    recorded = (((getattr(model, "adaptex_source", None) or {}).get("export") or {}).get(t.name) or {})
    if t.name == "onnx" and options.get("softmax_floor") is None and "softmax_floor" not in recorded:
        options["softmax_floor"] = _measured_floor(say)

    def write(out) -> dict:
        return _write(model, example_inputs, out, t.name, variant, precision, prec, dynamic_shapes, contract,
                      fp16_audit, say, options)

    # validated where adaptex runs the artifact here: ONNX in ONNX Runtime (TensorRT-bound ONNX too),
    # OpenVINO IR and ONNX in OpenVINO, and Core ML by MIL evaluation; an engine or a target of your
    # own is written as it is
    checkable = t.name in ("onnx", "coreml", "openvino") or (t.name == "tensorrt" and options.get("onnx_only"))
    if not validate or not checkable:
        return write(path)
    return _validated(write, t, model, example_inputs, path, contract, say, options)


def _validated(write, t, model, example, path, contract, say, options) -> dict:
    """write() into a staging path beside `path`, check it there, and only then give it its name."""
    from adaptex.exporter.errors import AdaptexError, ExportError
    from adaptex.exporter.metadata import check_writable
    from adaptex.runtimes import validation

    if path is None:
        raise ExportError("export needs a path to write, e.g. adaptex.export(model, inputs, 'model.onnx')")
    t.check_output(path, options)
    check_writable(path, _is_artifact)
    beside = t.companions(Path(path))
    for c in beside:  # an IR's weights: replaced only beside an adaptex artifact of that name
        check_writable(c, lambda _: _is_artifact(path))
    tell = say or (lambda m: None)
    with validation.staged(path) as work:
        meta = write(work)
        inputs = validation.validation_inputs(meta, model, contract, example)
        samples = validation.VALIDATION_SAMPLES.get(t.name, validation.VALIDATION_SAMPLES["onnx"])
        n = f"{len(inputs)} inputs derived from the example" if inputs is not None else f"{samples} generated sequences"
        tell(f"validating the artifact against the eager model on {n} (--no-validate skips this) ...")
        try:
            report = check(work, model, inputs, samples=samples,  # an OpenVINO-bound .onnx in OpenVINO too
                           runtime="openvino" if t.name == "openvino" else None)
        except AdaptexError as e:  # the check could not run (an op the MIL evaluation lacks, say)
            failed = validation.reject(work, path, beside)
            raise validation.ValidationFailed(
                f"{path}: the artifact could not be checked ({e}); it is kept as {failed} and {path} is "
                "unchanged; pass --no-validate (validate=False) to write it unchecked", None, failed) from e
        if report.passed:
            validation.promote(work, path, beside)
            tell(f"validated: {report.samples} sequences, max abs error {report.max_abs_err:.2g}, "
                 f"{report.unexcused_flips} unexcused flips")
            return meta
        failed = validation.reject(work, path, beside)
    report.artifact = str(failed)
    first = (report.failures or ["see the report"])[0]
    other = "another --quantize scheme (more bits) or none" if meta.get("quantize") else \
        "another precision, variant or target"
    raise validation.ValidationFailed(
        f"{path}: the artifact does not compute what the eager model does ({first}); it is kept as {failed} "
        f"and {path} is unchanged; export {other}, or pass --no-validate (validate=False) to write it "
        "unchecked", report, failed)


def _is_artifact(path) -> bool:
    from adaptex.runtimes.open import read_metadata

    try:
        read_metadata(path)
        return True
    except Exception:
        return False


def _write(model, example_inputs, path, target, variant, precision, prec, dynamic_shapes, contract, fp16_audit, say,
           options) -> dict:
    """The artifact at `path`, as `export` describes it, unchecked."""
    from adaptex.exporter.export import export as _export

    if target != "coreml" or prec != "fp16":
        return _export(model, example_inputs, path, target, variant, prec, dynamic_shapes, contract=contract,
                       say=say, **options)
    try:
        return _audited_coreml(model, example_inputs, path, variant, prec, dynamic_shapes, contract, fp16_audit,
                               say, options, asked=precision is not None)
    except _DefaultRefused as e:  # the default fp16 failed its audit: the default becomes fp32 (a safe package)
        (say or (lambda m: None))(f"the default fp16 package failed the fp16 audit ({e}); writing fp32 instead "
                                  "(--precision fp16 --no-fp16-audit keeps fp16) ...")
        return _export(model, example_inputs, path, "coreml", variant, "fp32", dynamic_shapes, contract=contract,
                       say=say, **options)


class _DefaultRefused(Exception):
    """The fp16 audit failed a package whose precision was the model's default, not asked for."""


def _audited_coreml(model, example_inputs, path, variant, prec, dynamic_shapes, contract, audit, say, options,
                    asked: bool = True):
    """Write the fp16 package beside `path`, audit it, and only then put it in place (asked=False: a
    failed audit raises _DefaultRefused, for the caller to write fp32 instead)."""
    from adaptex.exporter.errors import ExportError
    from adaptex.exporter.export import export as _export
    from adaptex.exporter.targets.coreml import package
    from adaptex.graphs import files
    from adaptex.runtimes.audit import describe, fp16_audit

    package.check_output(Path(path))
    with files.atomic_directory(path) as work:
        meta = _export(model, example_inputs, work, "coreml", variant, prec, dynamic_shapes, contract=contract,
                       say=say, **options)
        if audit:
            (say or (lambda m: None))("auditing the fp16 package (fp16 arithmetic throughout) ...")
            task = ((getattr(model, "adaptex_source", None) or {}).get("training") or {}).get("task")
            result = fp16_audit(work, model, contract, task=task)
            if not result.passed and not asked:
                raise _DefaultRefused(result.reason)
            if not result.passed:
                raise ExportError(f"--precision fp16 refused: under fp16 arithmetic throughout (as the Neural "
                                  f"Engine may compute), {result.reason}; export with --precision fp32 "
                                  "(or pass --no-fp16-audit to accept the risk)")
            (say or (lambda m: None))(describe(result))
    return meta


def _feeds(inputs: Iterable, names: list[str]) -> list[dict[str, np.ndarray]]:
    """Input tuples (tensors or arrays, in the model's argument order) or dicts -> feed dicts."""
    out = []
    for item in inputs:
        if isinstance(item, dict):
            unknown = [k for k in item if k not in names]
            if unknown:
                import difflib

                from adaptex.graphs.errors import InputError

                close = difflib.get_close_matches(str(unknown[0]), names, n=1)
                raise InputError(f"{unknown[0]!r}: not an input of this artifact" + (f" (did you mean {close[0]!r}?)"
                                 if close else "") + f"; its inputs are {', '.join(names)}")
            out.append({k: _array(v, k) for k, v in item.items()})
            continue
        item = item if isinstance(item, (tuple, list)) else (item,)
        if len(item) != len(names):
            from adaptex.graphs.errors import InputError

            raise InputError(f"an input has {len(item)} tensors, the artifact takes {len(names)} ({', '.join(names)})")
        out.append({n: _array(v, n) for n, v in zip(names, item)})
    return out


def _array(v, name: str = "an input") -> np.ndarray:
    """A caller's input as a numpy array of numbers in native byte order (or a one-line InputError)."""
    a = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
    if a.dtype.kind not in "biuf":
        from adaptex.graphs.errors import InputError

        raise InputError(f"{name}: dtype {a.dtype} (shape {list(a.shape)}), not numbers; inputs are arrays of "
                         "numbers (token ids, masks, caches)")
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _reference(path, model, inputs, threads, **runner_options):
    from adaptex.runtimes.open import open_artifact
    from adaptex.runtimes.source import check_source, contract_of, load_source_model
    from adaptex.runtimes.torch_ref import TorchRunner

    runner = open_artifact(path, threads, **runner_options)
    meta = runner.meta
    info = None
    if model is None:
        model, info = load_source_model(meta, None)
    else:
        check_source(meta, model=model, name=(getattr(model, "adaptex_source", None) or {}).get("name")
                     or type(model).__name__)
        info = getattr(model, "adaptex_source", None)
    feeds = _feeds(inputs, list(meta["inputs"])) if inputs is not None else None
    example = None
    if feeds:
        import torch

        example = tuple(torch.from_numpy(np.ascontiguousarray(feeds[0][n])) for n in meta["inputs"])
    contract = contract_of(meta, model, example)
    return runner, TorchRunner(model, contract=contract), feeds, info or {}


def check(path, model=None, inputs: Iterable | None = None, *, samples: int = 200, seed: int = 0,
          atol: float | None = None, rtol: float | None = None, threads: int | None = None, progress=None,
          compute_units: str | None = None, fp16_accumulation: str | None = None, ranges: bool = False,
          against=None, one_session: bool = False, runtime: str | None = None):
    """Parity of the artifact at `path` against the eager `model` (default: the shipped or checkpoint
    model the artifact records), decisions first. inputs: an iterable of input tuples (one array or
    tensor per model input) or dicts by input name; a shipped model generates its own by default.
    Returns a runtimes.report.ParityReport (passed, samples, max_abs_err, unexcused_flips,
    decision_agreement, format(), to_dict()). A Core ML package: fp16_accumulation="fp16" evaluates it
    with fp16 arithmetic throughout (the worst case), ranges=True reports every fp16 op's largest |x|
    and partial sums against 65504. against: another artifact of the same source as the reference
    instead of the eager model (e.g. an .onnx against an .mlpackage), decisions first. one_session:
    an ONNX artifact run in one ONNX Runtime session, its top-level Ifs choosing the graph, as an app
    that loads the file itself runs it (default: adaptex's runner, a session per graph). runtime:
    "openvino" runs an .onnx artifact in OpenVINO (an OpenVINO .xml runs there anyway)."""
    from adaptex.runtimes.parity import ArtifactReference
    from adaptex.runtimes.parity import check as _check

    runner, reference, feeds, info = _reference(path, model, inputs, threads, compute_units=compute_units,
                                                accumulate=fp16_accumulation, ranges=ranges,
                                                one_session=one_session, runtime=runtime)
    precision = (runner.meta.get("quantize") or {}).get("scheme") or runner.meta.get("precision", "fp32")
    if against is not None:
        from adaptex.graphs.errors import InputError
        from adaptex.runtimes.open import open_artifact

        other = open_artifact(against, threads)
        if other.meta.get("source") != runner.meta.get("source"):
            raise InputError(f"{against} was exported from another source than {path} "
                             f"({other.meta.get('source')} vs {runner.meta.get('source')}); compare artifacts of "
                             "one checkpoint")
        reference = ArtifactReference(other, reference)
        loosest = ["fp32", "fp16", "bf16", "int8", "int4", "palettize6", "palettize4"]
        theirs = (other.meta.get("quantize") or {}).get("scheme") or other.meta.get("precision", "fp32")
        if theirs in loosest and precision in loosest:  # the looser of the two (printed in the report)
            precision = max(precision, theirs, key=loosest.index)
    report = _check(runner, reference, samples=samples, task=(info.get("training") or {}).get("task"),
                    precision=precision, seed=seed, artifact_name=str(path), inputs=feeds, atol=atol, rtol=rtol,
                    progress=progress)
    if against is not None:
        report.reference = f"{against} on {reference.runner.name} (margins from the eager model)"
    return report


def bench(path, model=None, inputs: Iterable | None = None, *, batch: int = 1, seq: int = 128, past: int = 0,
          threads: int = 1, warmup: int = 10, runs: int | None = None, blocks: int = 5, profile: bool = False,
          progress=None, chunk_rows: int | None = CHUNK_ROWS) -> dict:
    """Latency of the artifact at `path` against every dense graph of the same weights, the fastest
    being the yardstick, as `adaptex bench` prints it (a dict). inputs: the inputs to time (the first is
    used; a shipped model makes its own of `batch` x `seq`). chunk_rows: a call of more token rows
    runs in chunks of whole samples, every graph alike, as adaptex's runner runs it (None: whole)."""
    from adaptex.runtimes.bench import run_bench

    runner, reference, feeds, info = _reference(path, model, inputs, threads)
    return run_bench(path, reference.model, info, batch=batch, seq=seq, threads=threads, warmup=warmup, runs=runs,
                     progress=progress, past=past, feeds=feeds[0] if feeds else None, contract=reference.contract,
                     blocks=blocks, profile=profile, chunk_rows=chunk_rows)
