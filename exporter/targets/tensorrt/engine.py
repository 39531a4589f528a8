"""Building a TensorRT engine (TensorRT 10 Python API): parse the TensorRT-bound ONNX's exact bytes,
one optimization profile, fp16 (weakly typed: BuilderFlag.FP16 with OBEY_PRECISION_CONSTRAINTS and
the routing pinned to fp32) or fp32, a timing cache reused across builds. What to build is decided in
plan.py without TensorRT; this module only carries it out.

Written against TensorRT 10's documented API; it has not run on these machines, whose TensorRT
wheels are download stubs (docs/tensorrt.md says what a first GPU run must check)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from adaptex.exporter import metadata
from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.tensorrt import cuda
from adaptex.exporter.targets.tensorrt.plan import PinPlan, input_shapes, should_pin

NO_TENSORRT = ("building a TensorRT engine needs TensorRT 10 and an NVIDIA GPU, and {why}; write the "
               "TensorRT-bound ONNX here with --onnx-only -o model.onnx, then build it on a GPU machine with "
               "'adaptex export --target tensorrt model.onnx -o model.plan'")


def require_tensorrt():
    """tensorrt, once a CUDA device is visible; else ExportError naming --onnx-only."""
    try:
        import tensorrt as trt
    except Exception:  # the registry's stub packages raise on import too
        raise ExportError(NO_TENSORRT.format(why="TensorRT is not installed here")) from None
    if cuda.device_count() < 1:
        raise ExportError(NO_TENSORRT.format(why="no CUDA device is visible"))
    return trt


def _is_float(t, trt) -> bool:
    return t is not None and t.dtype in (trt.float32, trt.float16, trt.bfloat16)


def pin_routing(network, plan: PinPlan, mark: str, trt) -> int:  # noqa: ARG001 (mark: plan.ROUTE_MARK)
    """Require fp32 for each routing layer that has a float input or output: a layer named after a
    planned node (or carrying the routing mark: function bodies' routing), or producing a planned
    routing tensor (helper layers the parser names its own way). An int or bool layer is never
    pinned: its precision must be its own input or output type. Returns how many were pinned."""
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type in (trt.LayerType.CONSTANT, trt.LayerType.SHAPE):
            continue
        ins = [layer.get_input(j) for j in range(layer.num_inputs)]
        outs = [layer.get_output(j) for j in range(layer.num_outputs)]
        typed = lambda ts: [(t.name, _is_float(t, trt)) for t in ts if t is not None]
        if not should_pin(layer.name, typed(ins), typed(outs), plan):
            continue
        layer.precision = trt.float32
        for j, o in enumerate(outs):
            if _is_float(o, trt):
                layer.set_output_type(j, trt.float32)
        pinned += 1
    return pinned


def build_engine(data: bytes, meta: dict, out: Path, *, precision: str, timing_cache: str | None, say=None,
                 pin: bool = True, plan: PinPlan | None = None) -> dict:
    """Parse `data`, build with one optimization profile, write `out` and `<out>.json`. `pin=False`
    (benchmarks of stock exports only) skips the fp32 pinning of routing layers."""
    trt = require_tensorrt()
    say = say or (lambda msg: None)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(data):
        errs = [parser.get_error(i).desc() for i in range(parser.num_errors)]
        raise ExportError(f"TensorRT's parser refused the model: {errs[0] if errs else 'no error given'} "
                          f"({len(errs)} error(s)); 'adaptex lint' names the rules it checks")
    config = builder.create_builder_config()
    prof = meta["tensorrt"]["profile"]
    p = builder.create_optimization_profile()
    shapes = {key: input_shapes(meta, prof[key]) for key in ("min", "opt", "max")}
    for name in meta["inputs"]:
        p.set_shape(name, shapes["min"][name], shapes["opt"][name], shapes["max"][name])
    if config.add_optimization_profile(p) < 0:
        raise ExportError(f"TensorRT rejected the optimization profile {prof}; check the --*-shapes")
    pinned = 0
    if precision == "fp16":
        if not hasattr(trt.BuilderFlag, "FP16"):
            raise ExportError(f"TensorRT {trt.__version__} builds strongly typed networks only (no FP16 flag), and "
                              "adaptex writes fp32 ONNX; build with --precision fp32, or with TensorRT 10")
        config.set_flag(trt.BuilderFlag.FP16)
        if pin:
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
            tr = meta["tensorrt"]
            plan = plan or PinPlan(frozenset(tr.get("pin_nodes", ())), frozenset(tr.get("routing_values", ())),
                                   frozenset())
            pinned = pin_routing(network, plan, tr["routing_mark"], trt)
            if pinned == 0:
                raise ExportError("no routing layer was found to pin to fp32, so fp16 could move decisions; "
                                  "build with --precision fp32")
    cache = None
    if timing_cache:
        blob = Path(timing_cache).read_bytes() if Path(timing_cache).is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)
    say(f"building the TensorRT engine ({precision}, {pinned} routing layers pinned to fp32) ...")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError("TensorRT failed to build the engine (its log above says why)")
    if timing_cache:
        with metadata.atomic_path(timing_cache) as tmp:
            tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
    meta = {**meta, "precision": precision}
    meta["tensorrt"] = {**meta["tensorrt"], "version": trt.__version__, "routing_layers_pinned": pinned,
                        "onnx_sha256": hashlib.sha256(data).hexdigest()}
    with metadata.atomic_path(sidecar(out)) as tmp_meta, metadata.atomic_path(out) as tmp:
        tmp.write_bytes(bytes(serialized))
        tmp_meta.write_text(json.dumps(meta, indent=1))
    return meta


def sidecar(plan: str | Path) -> Path:
    """Where an engine's metadata lives: beside it, `<plan>.json`."""
    return Path(str(plan) + ".json")
