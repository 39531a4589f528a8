"""`adaptex export`: a shipped model, a checkpoint or your own model to a runtime artifact."""
from __future__ import annotations

from pathlib import Path

from adaptex.cli._util import UsageError, say

TRT_FLAGS = ("onnx_only", "min_shapes", "opt_shapes", "max_shapes", "timing_cache", "trt_version")


def add_parser(sub) -> None:
    s = sub.add_parser("export", help="export a model to a runtime artifact")
    s.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or shipped model name (default: the shipped BudgetFormer)")
    s.add_argument("--target", required=True, help="onnx | coreml (ML program) | tensorrt (engine, or --onnx-only)")
    s.add_argument("-o", "--output", required=True, help="artifact path to write")
    s.add_argument("--variant", default="sparse", help="sparse (really skips heads) | dense (static shapes, masks)")
    s.add_argument("--precision", default=None,
                   help="body precision; routing always stays fp32 (onnx: fp32; coreml: fp16 or fp32, default fp16, "
                        "fp32 for tsa decoders)")
    s.add_argument("--min-target", default=None,
                   help="coreml: minimum deployment target (iOS16..iOS18, macOS13..macOS15; default iOS17)")
    s.add_argument("--onnx-only", action="store_true",
                   help="tensorrt: write the TensorRT-bound ONNX (-o X.onnx) instead of building an engine (no GPU "
                        "needed); build it later with 'adaptex export --target tensorrt X.onnx -o X.plan'")
    for key, default in (("min", "batch=1,sequence=1"), ("opt", "batch=1,sequence=min(128, max)"),
                         ("max", "batch=64,sequence=max")):
        s.add_argument(f"--{key}-shapes", default=None,
                       help=f"tensorrt: the optimization profile's {key} sizes, AXIS=N,... over batch, sequence and "
                            f"(decoders) past_sequence (default {default})")
    s.add_argument("--timing-cache", default=None, help="tensorrt: a timing cache file, read if present and rewritten")
    s.add_argument("--trt-version", default=None, help="tensorrt: the parser version to check rules for (default 10.0)")
    s.set_defaults(run=run)


def run(args) -> int:
    from adaptex.exporter import metadata
    from adaptex.exporter.registry import TARGETS, VARIANTS
    from adaptex.graphs import checkpoint

    if args.target not in TARGETS:
        raise UsageError(f"unknown target {args.target!r}; choose one of {', '.join(TARGETS)}")
    if args.variant not in VARIANTS:
        raise UsageError(f"unknown variant {args.variant!r}; choose one of {', '.join(VARIANTS)}")
    trt_flags = [f"--{f.replace('_', '-')}" for f in TRT_FLAGS if getattr(args, f, None)]
    if args.target != "tensorrt" and trt_flags:
        raise UsageError(f"{', '.join(trt_flags)} {'applies' if len(trt_flags) == 1 else 'apply'} to --target "
                         "tensorrt only")
    if args.min_target and args.target != "coreml":
        raise UsageError("--min-target applies to --target coreml only")
    if args.target == "onnx":
        metadata.check_writable(args.output)
    shapes = (args.min_shapes, args.opt_shapes, args.max_shapes)
    if args.target == "tensorrt" and args.model and str(args.model).endswith(".onnx"):
        # an engine from a TensorRT-bound ONNX written earlier (--onnx-only): its exact bytes
        from adaptex.exporter.targets import tensorrt

        if args.onnx_only:
            raise UsageError(f"{args.model} is already ONNX; drop --onnx-only to build an engine from it")
        say(f"building a TensorRT engine from {args.model} ...")
        tensorrt.export_from_onnx(args.model, args.output, precision=args.precision, shapes=shapes,
                                  timing_cache=args.timing_cache, say=say)
        say(f"wrote {args.output} and {tensorrt.sidecar(args.output).name}")
        return 0
    model, info = checkpoint.load(args.model)
    # a shipped model is recorded by name; a directory by absolute path, so check/bench work from anywhere
    info["name"] = info["path"] if Path(args.model or checkpoint.DEFAULT_MODEL).is_dir() else (
        args.model or checkpoint.DEFAULT_MODEL)
    if args.target == "onnx":
        from adaptex.exporter.targets import onnx as target
    elif args.target == "coreml":
        from adaptex.exporter.targets import coreml as target
    else:
        from adaptex.exporter.targets import tensorrt as target
    say(f"exporting {info['name']} to {args.target} ({args.variant}) ...")
    default = target.default_precision(model.cfg) if hasattr(target, "default_precision") else target.DEFAULT_PRECISION
    kwargs = {"variant": args.variant, "precision": args.precision or default}
    if args.target == "coreml":
        kwargs["min_target"] = args.min_target or target.DEFAULT_MIN_TARGET
    if args.target == "tensorrt":
        kwargs.update(onnx_only=args.onnx_only, shapes=shapes, timing_cache=args.timing_cache, say=say,
                      trt_version=args.trt_version or target.tensorrt_rules.DEFAULT_VERSION)
    meta = target.export(model, info, args.output, **kwargs)
    say(f"wrote {args.output}: {len(meta['outputs'])} outputs, lowerings {meta['lowerings']}")
    return 0
