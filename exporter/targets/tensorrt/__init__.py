"""TensorRT target: the ONNX handed to TensorRT's parser, its static check, and engine building.

Two stages, so that the first runs anywhere:
1. The TensorRT-bound ONNX (`bound_onnx`): the ONNX target's graph with the tensorrt cells of the
   registry (the same function bodies, and the CumSum partition where TopK's runtime K would be
   unbounded). Each adaptex op stays one custom-domain node whose body ships as a model-local
   function, which TensorRT's parser inlines (since 9.0; a plugin of the same name overrides it,
   10.7+). The routing nodes are named with plan.ROUTE_MARK and the pinning plan rides in the
   metadata. The file passes `rules.lint`, and its parity runs in ONNX Runtime like any ONNX.
2. The engine (engine.build_engine, TensorRT 10): parse those exact bytes, one optimization profile
   from --min/--opt/--max-shapes, fp16 or fp32. Its metadata sits beside it in `<plan>.json`.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from adaptex.exporter import metadata
from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets import Option, Target, register_target
from adaptex.exporter.targets import onnx as onnx_target
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.tensorrt import rules
from adaptex.exporter.targets.tensorrt.engine import build_engine, require_tensorrt, sidecar
from adaptex.exporter.targets.tensorrt.plan import (ROUTE_MARK, dynamic_axes, mark_routing, parse_shapes, pin_plan,
                                                    profile)

PRECISIONS = ("fp32", "fp16")
PLAN_SUFFIXES = (".plan", ".engine")
SHAPE_FLAGS = ("min", "opt", "max")


def bound_onnx(model, contract, source: dict, *, variant: str = "sparse", trt_version: str = rules.DEFAULT_VERSION,
               shapes: tuple = (None, None, None), tokenizer: dict | None = None) -> tuple[bytes, dict]:
    """The TensorRT-bound ONNX, serialised (the exact bytes an engine build parses), and its metadata.
    Raises ExportError listing the static checker's violations, if any."""
    proto, notes, inputs, outputs = onnx_target.lower(model, contract, variant=variant, target="tensorrt")
    mark_routing(proto)
    violations = rules.lint(proto, trt_version)
    if violations:
        raise ExportError(f"the TensorRT-bound ONNX breaks {len(violations)} parser rule(s) for TensorRT "
                          f"{trt_version}, first: {violations[0]}; run 'adaptex lint' on an --onnx-only export")
    plan = pin_plan(proto)
    meta = metadata.build(contract, target="tensorrt", variant=variant, precision="fp32", lowerings=notes,
                          inputs=inputs, outputs=outputs, source=source,
                          opset={"adaptex": fx.OPSET_VERSION, "onnx": fx.ONNX_OPSET}, tokenizer=tokenizer)
    axes = dynamic_axes(inputs)
    prof = profile(meta, *(parse_shapes(s, f"--{k}-shapes", axes) for s, k in zip(shapes, SHAPE_FLAGS)))
    meta["tensorrt"] = {"checked_against": trt_version, "rules": len(rules.RULES), "routing_mark": ROUTE_MARK,
                        "routing_values": sorted(plan.tensors), "pin_nodes": sorted(plan.nodes),
                        "routing_unpinned": len(plan.skipped), "profile": prof}
    onnx_target.stamp(proto, meta, onnx_target.describe(meta, " for TensorRT"))
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        raise ExportError(f"the TensorRT-bound ONNX fails onnx.checker: {str(e).splitlines()[0]}") from e
    return proto.SerializeToString(), meta


def export(model, contract, out, *, variant: str = "sparse", precision: str | None = None, source: dict,
           tokenizer: dict | None = None, onnx_only: bool = False, min_shapes=None, opt_shapes=None,
           max_shapes=None, timing_cache: str | None = None, trt_version: str | None = None, say=None) -> dict:
    """--onnx-only: write the TensorRT-bound ONNX to `out` (.onnx). Otherwise build an engine at
    `out` (.plan or .engine) from the same bytes, its metadata in `<out>.json`."""
    precision = precision or "fp32"
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the tensorrt target; use fp16 or fp32")
    out = Path(out)
    if onnx_only and out.suffix != ".onnx":
        raise ExportError(f"{out}: --onnx-only writes ONNX, so the name must end in .onnx; use -o "
                          f"{out.with_suffix('.onnx')}")
    if not onnx_only and out.suffix not in PLAN_SUFFIXES:
        raise ExportError(f"{out}: a TensorRT engine's name must end in .plan or .engine (or pass --onnx-only "
                          f"with -o {out.with_suffix('.onnx')})")
    metadata.check_writable(out, onnx_target.is_onnx_artifact if onnx_only else _is_plan)
    if not onnx_only:
        require_tensorrt()  # before the export's minutes, not after
    data, meta = bound_onnx(model, contract, source, variant=variant, trt_version=trt_version or rules.DEFAULT_VERSION,
                            shapes=(min_shapes, opt_shapes, max_shapes), tokenizer=tokenizer)
    if onnx_only:
        with metadata.atomic_path(out) as tmp:
            tmp.write_bytes(data)
        return meta
    return build_engine(data, meta, out, precision=precision, timing_cache=timing_cache, say=say)


def _is_plan(path: Path) -> bool:
    return sidecar(path).is_file()


def export_from_onnx(path, out, *, precision: str | None = None, timing_cache: str | None = None,
                     shapes: tuple = (None, None, None), say=None) -> dict:
    """Build an engine from a TensorRT-bound ONNX written earlier with --onnx-only (its exact bytes)."""
    precision = precision or "fp32"
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the tensorrt target; use fp16 or fp32")
    meta = metadata.read_onnx_metadata(path)
    if meta.get("target") != "tensorrt" or not isinstance(meta.get("tensorrt"), dict):
        raise ExportError(f"{path}: was exported for {meta.get('target')}, not TensorRT; re-export it with "
                          "'adaptex export --target tensorrt --onnx-only'")
    out = Path(out)
    if out.suffix not in PLAN_SUFFIXES:
        raise ExportError(f"{out}: a TensorRT engine's name must end in .plan or .engine")
    metadata.check_writable(out, _is_plan)
    if any(shapes):
        axes = dynamic_axes(meta["inputs"])
        meta["tensorrt"]["profile"] = profile(meta, *(parse_shapes(s, f"--{k}-shapes", axes)
                                                      for s, k in zip(shapes, SHAPE_FLAGS)))
    require_tensorrt()
    return build_engine(Path(path).read_bytes(), meta, out, precision=precision, timing_cache=timing_cache, say=say)


def read_plan_meta(path: str | Path) -> dict:
    """An engine's metadata, from its `<plan>.json`."""
    from adaptex.graphs.errors import AdaptexError

    path = Path(path)
    if not path.is_file():
        raise AdaptexError(f"{path}: no such engine; build one with 'adaptex export --target tensorrt -o {path}'")
    side = sidecar(path)
    if not side.is_file():
        raise AdaptexError(f"{path}: its metadata {side.name} is missing (adaptex writes it beside the engine); "
                           "rebuild the engine with 'adaptex export --target tensorrt'")
    return metadata.parse(side.read_text(), side)


TARGET = register_target(Target(
    name="tensorrt", suffixes=PLAN_SUFFIXES + (".onnx",), precisions=PRECISIONS, export=export,
    default_precision=lambda contract: "fp32",
    description="TensorRT engine (.plan), or the TensorRT-bound ONNX with --onnx-only",
    options=(
        Option("--onnx-only", "write the TensorRT-bound ONNX (-o X.onnx) instead of building an engine (no GPU "
                              "needed); build it later with 'adaptex export --target tensorrt X.onnx -o X.plan'",
               action="store_true"),
        Option("--min-shapes", "the optimization profile's min sizes, AXIS=N,... (default batch=1 and 1 elsewhere)"),
        Option("--opt-shapes", "the profile's opt sizes (default batch=1, sequence=min(128, max))"),
        Option("--max-shapes", "the profile's max sizes (default batch=64, sequence=the model's maximum)"),
        Option("--timing-cache", "a timing cache file, read if present and rewritten"),
        Option("--trt-version", f"the parser version to check rules for (default {rules.DEFAULT_VERSION})"),
    )))
