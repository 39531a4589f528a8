"""`adaptex export`: a shipped model, a checkpoint or a model of your own to a runtime artifact."""
from __future__ import annotations

from adaptex.cli._util import EXIT_FAILED, UsageError, err, load_model, read_inputs, say


def add_parser(sub) -> None:
    from adaptex.exporter import targets

    s = sub.add_parser("export", help="export a model to a runtime artifact")
    s.add_argument("model", nargs="?", default=None,
                   help="a shipped model name, a checkpoint directory, or MODULE:FUNCTION returning your own model "
                        "(or the model and its example inputs); default: the shipped BudgetFormer")
    s.add_argument("--target", required=True, help="onnx | coreml (ML program) | tensorrt (engine, or --onnx-only)")
    s.add_argument("-o", "--output", required=True, help="artifact path to write")
    s.add_argument("--variant", default="sparse", help="sparse (really skips work) | dense (static shapes, masks)")
    s.add_argument("--precision", default=None,
                   help="body precision; routing always stays fp32 (onnx: fp32; coreml: fp16 or fp32, default fp16 for "
                        "the elastic encoders and your own encoders, fp32 for BudgetFormer and decoders; "
                        "tensorrt: fp32 or fp16)")
    s.add_argument("--no-fp16-audit", action="store_true",
                   help="coreml fp16: write the package without the worst-case fp16 audit (fp16 arithmetic "
                        "throughout, as the Neural Engine may compute) that refuses an unsafe one")
    s.add_argument("--no-validate", action="store_true",
                   help="write the artifact without checking it against the eager model first (by default it is "
                        "checked on generated or derived inputs and, on a mismatch, kept as NAME.failed.SUFFIX with "
                        "exit 1)")
    s.add_argument("--inputs", default=None,
                   help="MODULE:FUNCTION models: an .npz of example inputs by name (batch >= 2), if the function "
                        "returns the model alone")
    for option, _ in targets.all_options():
        kwargs = {"action": option.action} if option.action else {"default": option.default}
        s.add_argument(option.flag, help=option.help, **kwargs)
    s.set_defaults(run=run)


def run(args) -> int:
    import torch

    from adaptex.api import export
    from adaptex.exporter import targets
    from adaptex.exporter.registry import VARIANTS

    if args.variant not in VARIANTS:
        raise UsageError(f"unknown variant {args.variant!r}; choose one of {', '.join(VARIANTS)}")
    target = targets.load(args.target)
    mine = {o.dest for o in target.options}
    given = {o.dest: getattr(args, o.dest) for o, _ in targets.all_options()
             if getattr(args, o.dest, None) not in (None, False)}
    empty = [f"--{d.replace('_', '-')}" for d, v in given.items() if isinstance(v, str) and not v.strip()]
    if args.precision is not None and not args.precision.strip():
        empty.insert(0, "--precision")
    if empty:
        raise UsageError(f"{empty[0]} is empty; give it a value or leave it out for the default")
    foreign = [f"--{d.replace('_', '-')}" for d in given if d not in mine]
    if foreign:
        raise UsageError(f"{', '.join(foreign)} {'applies' if len(foreign) == 1 else 'apply'} to another target, "
                         f"not --target {args.target}")
    if args.target == "tensorrt" and args.model and str(args.model).endswith(".onnx"):
        return _engine_from_onnx(args)
    model, example = load_model(args.model)
    if example is None and args.inputs:
        batches = read_inputs(args.inputs)
        _ids_fit(model, args.inputs, batches[0])
        example = tuple(torch.from_numpy(a) for a in batches[0].values())
    name = getattr(model, "adaptex_source", {}).get("name") or args.model
    say(f"exporting {name or type(model).__name__} to {args.target} ({args.variant}) ...")
    if args.no_fp16_audit and args.target != "coreml":
        raise UsageError("--no-fp16-audit applies to --target coreml only")
    from adaptex.runtimes.validation import ValidationFailed

    try:
        meta = export(model, example, args.output, args.target, args.variant, args.precision, say=say,
                      fp16_audit=not args.no_fp16_audit, validate=not args.no_validate, **given)
    except ValidationFailed as e:
        if e.report is not None:
            print(e.report.format())
        err(str(e))
        return EXIT_FAILED
    routed = (meta.get("dispatch") or {}).get("dense_rows")
    say(f"wrote {args.output}: {len(meta['outputs'])} outputs ({len(meta['decisions'])} decisions), "
        f"lowerings {meta['lowerings']}"
        + (f"; calls of at most {routed} token rows run the dense lowering" if routed else ""))
    return 0


def _ids_fit(model, path: str, arrays: dict) -> None:
    """--inputs for a model whose config names its vocabulary and length: input_ids of whole numbers
    within both, or a one-line error (a float id or one past the embedding table fails deep in
    PyTorch otherwise)."""
    import numpy as np

    cfg, ids = getattr(model, "cfg", None), arrays.get("input_ids")
    vocab, longest = getattr(cfg, "vocab_size", None), getattr(cfg, "max_len", None)
    if ids is not None and not np.issubdtype(ids.dtype, np.integer):  # an embedding's indices: whole numbers
        raise UsageError(f"--inputs {path}: input_ids is {ids.dtype}, and token ids are whole numbers; write them "
                         "as int64 (np.int64)")
    if ids is None or not ids.size:
        return  # other shapes are the export's to refuse
    if isinstance(vocab, int) and (ids.min() < 0 or ids.max() >= vocab):
        raise UsageError(f"--inputs {path}: input_ids holds ids from {ids.min()} to {ids.max()}, and this model's "
                         f"vocabulary has ids 0 to {vocab - 1}; write ids in that range")
    if isinstance(longest, int) and ids.ndim == 2 and ids.shape[1] > longest:
        raise UsageError(f"--inputs {path}: input_ids has {ids.shape[1]} tokens a row, and this model takes at most "
                         f"{longest}; write shorter rows")


def _engine_from_onnx(args) -> int:
    """An engine from a TensorRT-bound ONNX written earlier (--onnx-only): its exact bytes."""
    from adaptex.exporter.targets import tensorrt

    if args.onnx_only:
        raise UsageError(f"{args.model} is already ONNX; drop --onnx-only to build an engine from it")
    say(f"building a TensorRT engine from {args.model} ...")
    tensorrt.export_from_onnx(args.model, args.output, precision=args.precision, timing_cache=args.timing_cache,
                              shapes=(args.min_shapes, args.opt_shapes, args.max_shapes), say=say)
    say(f"wrote {args.output} and {tensorrt.sidecar(args.output).name}")
    return 0
