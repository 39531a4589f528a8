"""`adaptex lint`: the static check of an ONNX model against TensorRT's parser rules (no GPU needed)."""
from __future__ import annotations

import json
from pathlib import Path

from adaptex.cli._util import EXIT_FAILED, UsageError


def add_parser(sub) -> None:
    s = sub.add_parser("lint", help="check an ONNX model against TensorRT's parser rules (no GPU needed)")
    s.add_argument("model", help="an .onnx file (e.g. from 'adaptex export --target tensorrt --onnx-only')")
    s.add_argument("--trt-version", default="10.0", help="TensorRT version whose rules apply (default 10.0)")
    s.add_argument("--plugin", action="append", help="a custom op served by a registered plugin (repeatable)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=run)


def _check_external_data(model, path: Path) -> None:
    """Tensors stored in external files must lie inside the model's directory, as regular files."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    base = path.absolute().parent
    for t in model.graph.initializer:
        if not uses_external_data(t):
            continue
        location = ExternalDataInfo(t).location
        target = (base / location).resolve() if location else base
        if not location or Path(location).is_absolute() or base.resolve() not in target.parents:
            raise UsageError(f"{path}: tensor {t.name[:60]!r} keeps its data at {location[:80]!r}, outside the model's "
                             "directory; adaptex reads no file outside it: put the data file beside the model")
        if not target.is_file() or (base / location).is_symlink():
            raise UsageError(f"{path}: tensor {t.name[:60]!r} keeps its data in {location[:80]!r}, which is missing "
                             "or not a regular file; put the data file beside the model")


def run(args) -> int:
    import onnx

    from adaptex.exporter.targets.tensorrt import rules as tensorrt_rules

    path = Path(args.model)
    if path.suffix != ".onnx":
        raise UsageError(f"{path}: lint checks ONNX files against TensorRT's parser; pass the .onnx that "
                         "'adaptex export --target tensorrt --onnx-only' writes (a Core ML package or engine has "
                         "nothing to lint)")
    if not path.is_file():
        raise UsageError(f"{path}: no such file; export one with 'adaptex export --target tensorrt --onnx-only -o {path}'")
    if path.stat().st_size == 0:
        raise UsageError(f"{path}: is empty (0 bytes), not an ONNX model; pass an .onnx file")
    try:
        model = onnx.load(str(path), load_external_data=False)  # external data: checked below, never followed out
        _check_external_data(model, path)
        onnx.load_external_data_for_model(model, str(path.absolute().parent))
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"{path}: not a readable ONNX model ({type(e).__name__}); pass an .onnx file") from None
    if not model.HasField("graph") or not model.graph.node:  # bytes that parse as an empty ModelProto
        raise UsageError(f"{path}: not an ONNX model (no graph); pass an .onnx file")
    try:
        violations = tensorrt_rules.lint(model, args.trt_version, tuple(args.plugin or ()))
    except ValueError as e:
        raise UsageError(str(e)) from None
    active = [r for r in tensorrt_rules.RULES if r.holds_for(tensorrt_rules._version(args.trt_version))]
    if args.json:
        print(json.dumps({"model": str(path), "tensorrt": args.trt_version, "rules": [r.name for r in active],
                          "violations": [v.__dict__ for v in violations]}, indent=2))
    else:
        for v in violations:
            print(v)
        verdict = (f"{len(violations)} violation(s) of the {len(active)}" if violations else
                   f"passes all {len(active)}")
        print(f"{path}: {verdict} TensorRT {args.trt_version} parser rules")
    return EXIT_FAILED if violations else 0
