"""TensorRT target: the ONNX handed to TensorRT's parser, its static check, and engine building.

Two stages, so that the first runs anywhere:
1. The TensorRT-bound ONNX (`bound_onnx`): the ONNX target's graph with the TensorRT lowerings.
   Each adaptex op stays one custom-domain node whose body ships as a model-local function, which
   TensorRT's parser inlines (since 9.0; a plugin of the same name can override it, 10.7+):
   BudgetedAttention's TopK takes its K at run time (the parser makes it the scalar K of a TopK
   layer, accepted since 8.6, K <= 3840, here K <= H) and ConditionalFFN's NonZero has a
   data-dependent output (an internal tensor here, so no output allocator is needed for it). The
   routing nodes are named with ROUTE_MARK so the builder can pin their layers to fp32. The file
   passes `tensorrt_rules.lint`, and its parity runs in ONNX Runtime like any ONNX artifact.
2. The engine (`build_engine`, TensorRT 10 Python API): parse those exact bytes, one optimization
   profile from --min/--opt/--max-shapes, fp16 (weakly typed: BuilderFlag.FP16 with
   OBEY_PRECISION_CONSTRAINTS and every routing layer pinned to fp32) or fp32, and a timing cache
   reused across builds. The plan's metadata sits beside it in `<plan>.json`.

Stage 2 is written against TensorRT 10's documented API and has not run on these machines: their
TensorRT wheels are download stubs and they have no GPU (see docs/tensorrt.md).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import onnx

from adaptex.exporter import metadata as artifact
from adaptex.exporter.errors import ExportError
from adaptex.exporter.registry import lowering
from adaptex.exporter.targets import onnx as onnx_target
from adaptex.exporter.targets import onnx_functions as fx
from adaptex.exporter.targets import tensorrt_rules

PRECISIONS = ("fp32", "fp16")
DEFAULT_PRECISION = "fp32"
ROUTE_MARK = "adaptex_route"
PLAN_SUFFIXES = (".plan", ".engine")
AXES = ("batch", "sequence", "past_sequence")


# --- lowerings: the ONNX bodies, which TensorRT 10's parser accepts as they are -----------------------

@lowering("adaptex::budgeted_attention", target="tensorrt", variant="sparse")
def budgeted_attention_tensorrt_sparse(ctx, node):
    """The ONNX function body: TopK with a runtime K (the batch's largest k; K <= H <= 3840), Gather
    of the selected heads' weights, attention on those heads only. TensorRT 8.6+ takes the runtime K."""
    return onnx_target.OnnxLowering(onnx_target._budgeted_attention_node, [fx.budgeted_attention_function("sparse")])


@lowering("adaptex::budgeted_attention", target="tensorrt", variant="dense")
def budgeted_attention_tensorrt_dense(ctx, node):
    """Every head computed, unselected heads weighted by zero; TopK over all H heads (static K)."""
    return onnx_target.OnnxLowering(onnx_target._budgeted_attention_node, [fx.budgeted_attention_function("dense")])


@lowering("adaptex::conditional_ffn", target="tensorrt", variant="sparse")
def conditional_ffn_tensorrt_sparse(ctx, node):
    """NonZero (a data-dependent shape, internal to the engine) + Gather + LayerNorm/FFN on the kept
    tokens + ScatterND without a reduction attribute (TensorRT <= 10.8 refuses even 'none')."""
    return onnx_target.OnnxLowering(onnx_target._conditional_ffn_node, [fx.conditional_ffn_function("sparse")])


@lowering("adaptex::conditional_ffn", target="tensorrt", variant="dense")
def conditional_ffn_tensorrt_dense(ctx, node):
    """Every token through the FFN, the update scaled by keep * gate: static shapes."""
    return onnx_target.OnnxLowering(onnx_target._conditional_ffn_node, [fx.conditional_ffn_function("dense")])


@lowering("adaptex::conditional_attention", target="tensorrt", variant="sparse")
def conditional_attention_tensorrt_sparse(ctx, node):
    """The kept positions first by a CumSum partition sliced at the batch's largest kept count (no
    TopK: its runtime K would run over the sequence axis, unbounded by 3840), Gather of the kept query
    rows, attention on them only, ScatterND without a reduction attribute."""
    return onnx_target.OnnxLowering(onnx_target._conditional_attention_node,
                                    [fx.conditional_attention_function("sparse", partition="cumsum")])


@lowering("adaptex::conditional_attention", target="tensorrt", variant="dense")
def conditional_attention_tensorrt_dense(ctx, node):
    """Every query row attended, the update scaled by keep * gate: static shapes."""
    return onnx_target.OnnxLowering(onnx_target._conditional_attention_node,
                                    [fx.conditional_attention_function("dense")])


@lowering("adaptex::elastic_attention", target="tensorrt", variant="sparse")
def elastic_attention_tensorrt_sparse(ctx, node):
    """The ONNX body: NonZero over the head modes (internal data-dependent shapes), Gather of each
    group, block-local SA (Gather with a (blocks, L) index), ScatterND without a reduction attribute."""
    return onnx_target.OnnxLowering(onnx_target._elastic_attention_node,
                                    [fx.elastic_attention_function("sparse", onnx_target._causal(node))])


@lowering("adaptex::elastic_attention", target="tensorrt", variant="dense")
def elastic_attention_tensorrt_dense(ctx, node):
    """Every head over the full score matrix, SA heads through a band mask: static shapes."""
    return onnx_target.OnnxLowering(onnx_target._elastic_attention_node, [fx.elastic_attention_function("dense")])


# --- routing nodes ---------------------------------------------------------------------------------

ROUTING_INPUTS = {"BudgetedAttention": ("s", "p"), "ConditionalFFN": ("keep", "gate"),
                  "ConditionalAttention": ("keep", "gate"), "ElasticAttention": ("sa",)}


def _scopes(node: onnx.NodeProto) -> str:
    return next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")


def _graph_routing(graph, sources: set[str], sinks: set[str]) -> set[int]:
    """Indices of the nodes on a path from a `sources` value to a `sinks` value (of every node fed by
    `sources`, when `sinks` is empty). Paths do not pass through adaptex nodes: a layer's routing
    ends at its op, and the next layer's routing starts at its own router."""
    nodes = list(graph.node)
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for v in n.input:
            consumers.setdefault(v, []).append(i)
    fwd, todo = set(), list(sources)
    while todo:
        for i in consumers.get(todo.pop(), []):
            if i not in fwd and nodes[i].domain != fx.DOMAIN:
                fwd.add(i)
                todo.extend(nodes[i].output)
    if not sinks:
        return fwd
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    bwd, todo = set(), list(sinks)
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in bwd or nodes[i].domain == fx.DOMAIN:
            continue
        bwd.add(i)
        todo.extend(nodes[i].input)
    return fwd & bwd


def mark_routing(proto: onnx.ModelProto) -> list[str]:
    """Name every routing node with ROUTE_MARK, in the main graph and in the function bodies; returns
    the main graph's routing value names (the builder pins the layers that produce them to fp32 too).

    Main graph: nodes on a path from a router module's node (name scope '.router' or 'routers.') to
    an adaptex node's routing input (s, p, keep, gate) or a decisions.* output. Function bodies:
    nodes fed by the routing inputs that do not read the token stream x or the weights."""
    g = proto.graph
    nodes = list(g.node)
    is_router = [bool(re.search(r"\.router\b|\brouters\.", _scopes(n))) for n in nodes]  # TSA, BudgetFormer, Elastic
    router_outs = {o for n, r in zip(nodes, is_router) if r for o in n.output}
    sinks = {o.name for o in g.output if o.name.startswith("decisions.")}
    for n in nodes:
        names = {"BudgetedAttention": fx.INPUTS, "ConditionalFFN": fx.CFFN_INPUTS,
                 "ConditionalAttention": fx.CA_INPUTS, "ElasticAttention": fx.EA_INPUTS}.get(n.op_type, [])
        sinks.update(n.input[pos] for pos, name in enumerate(names)
                     if name in ROUTING_INPUTS[n.op_type] and pos < len(n.input))
    marked = {i for i, r in enumerate(is_router) if r} | _graph_routing(g, router_outs, sinks)
    values = []
    for i in sorted(marked):
        n = nodes[i]
        n.name = f"{ROUTE_MARK}/{n.name or f'{n.op_type}_{i}'}"
        values.extend(n.output)
    for f in proto.functions:
        sources = set(ROUTING_INPUTS.get(f.name, ()))
        body = _graph_routing(f, set(f.input) - sources, set())  # reads x or the weights
        marked = _graph_routing(f, sources, set()) - body
        for i, n in enumerate(f.node):
            n.name = f"{ROUTE_MARK}/{n.op_type}_{i}" if i in marked else f"{n.op_type}_{i}"
    return values


# --- shapes ----------------------------------------------------------------------------------------

def parse_shapes(text: str | None, flag: str) -> dict[str, int]:
    """'batch=1,sequence=128' -> {'batch': 1, 'sequence': 128}; a one-line error names the flag."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in AXES or not value.strip().isdigit():
            raise ExportError(f"{flag} {text!r}: expected AXIS=N[,AXIS=N] with AXIS one of {', '.join(AXES)} "
                              f"(e.g. {flag} batch=1,sequence=128)")
        out[name] = int(value)
    return out


def profile(cfg, min_s: dict, opt_s: dict, max_s: dict) -> dict[str, dict[str, int]]:
    """The optimization profile over the dynamic axes: {'min'|'opt'|'max': {axis: size}}, with
    defaults (batch 1/1/64, sequence 1/min(128, max_len)/max_len, a decoder's past 0/0/max_len-1)."""
    from adaptex.exporter.trace import is_decoder

    decoder = is_decoder(cfg)
    L = cfg.max_len
    prof = {"min": {"batch": 1, "sequence": 1}, "opt": {"batch": 1, "sequence": min(128, L)},
            "max": {"batch": 64, "sequence": L}}
    if decoder:
        prof["min"]["past_sequence"], prof["opt"]["past_sequence"], prof["max"]["past_sequence"] = 0, 0, L - 1
    for key, given in (("min", min_s), ("opt", opt_s), ("max", max_s)):
        for axis, v in given.items():
            if axis == "past_sequence" and not decoder:
                raise ExportError(f"past_sequence applies to decoders (tsa, elastic_decoder) only; drop it from --{key}-shapes")
            prof[key][axis] = v
    for axis in prof["min"]:
        lo, mid, hi = prof["min"][axis], prof["opt"][axis], prof["max"][axis]
        floor = 0 if axis == "past_sequence" else 1
        if not floor <= lo <= mid <= hi:
            raise ExportError(f"{axis}: need {floor} <= min <= opt <= max, got {lo}, {mid}, {hi}; "
                              "fix --min-shapes/--opt-shapes/--max-shapes")
    if decoder:
        if prof["max"]["past_sequence"] > L - 1:
            raise ExportError(f"--max-shapes: past_sequence {prof['max']['past_sequence']} leaves no room for a new "
                              f"token within the model's maximum of {L}; use at most {L - 1}")
        total = prof["opt"]["sequence"] + prof["opt"]["past_sequence"]
        if total > L:
            raise ExportError(f"--opt-shapes: sequence + past_sequence = {total} exceeds the model's maximum of {L}; "
                              "lower it")
    elif prof["max"]["sequence"] > L:
        raise ExportError(f"--max-shapes: sequence {prof['max']['sequence']} exceeds the model's maximum of {L}; "
                          "lower it")
    return prof


def input_shapes(meta: dict, sizes: dict[str, int]) -> dict[str, tuple]:
    """Each network input's concrete shape for axis sizes (expressions such as
    'past_sequence + sequence' evaluated, capped at the model's maximum sequence: a decoder's
    mask never exceeds the cache bound, whatever the profile's separate maxima)."""
    out = {}
    for name, spec in meta["inputs"].items():
        dims = []
        for d in spec["shape"]:
            if isinstance(d, int) and d > 0:
                dims.append(d)
            else:
                v = int(eval(str(d), {"__builtins__": {}}, dict(sizes)))  # names from AXES only
                dims.append(min(v, meta["max_sequence"]) if str(d) not in AXES else v)
        out[name] = tuple(dims)
    return out


# --- stage 1: the TensorRT-bound ONNX ---------------------------------------------------------------

def bound_onnx(model, info: dict, *, variant: str = "sparse", trt_version: str = tensorrt_rules.DEFAULT_VERSION,
               prof: dict | None = None) -> tuple[bytes, dict]:
    """The TensorRT-bound ONNX, serialised (the exact bytes an engine build parses), and its metadata.
    Raises ExportError listing the static checker's violations, if any."""
    proto, notes = onnx_target.lower(model, variant=variant, target="tensorrt")
    routing_values = mark_routing(proto)
    violations = tensorrt_rules.lint(proto, trt_version)
    if violations:
        raise ExportError(f"the TensorRT-bound ONNX breaks {len(violations)} parser rule(s) for TensorRT "
                          f"{trt_version}, first: {violations[0]}; run 'adaptex lint' on an --onnx-only export")
    cfg = model.cfg
    meta = {
        "format": artifact.FORMAT_VERSION, "family": cfg.family, "target": "tensorrt", "variant": variant,
        "precision": "fp32", "opset": {"adaptex": fx.OPSET_VERSION, "onnx": fx.ONNX_OPSET},
        "lowerings": notes, **artifact.routing_meta(cfg), "config": cfg.to_dict(),
        "source": {"checkpoint": info.get("name") or info.get("path"), "sha256": info.get("sha256")},
        "inputs": onnx_target._io_spec(proto.graph.input), "outputs": onnx_target._io_spec(proto.graph.output),
        "max_sequence": cfg.max_len,
        "tensorrt": {"checked_against": trt_version, "rules": len(tensorrt_rules.RULES),
                     "routing_mark": ROUTE_MARK, "routing_values": routing_values,
                     "profile": prof or profile(cfg, {}, {}, {})},
    }
    if info.get("tokenizer"):
        meta["tokenizer"] = info["tokenizer"]
    proto.metadata_props.append(onnx.StringStringEntryProto(key=artifact.META_KEY, value=json.dumps(meta)))
    proto.producer_name = "adaptex"
    proto.doc_string = f"{cfg.family} exported by adaptex for TensorRT ({variant})"
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        raise ExportError(f"the TensorRT-bound ONNX fails onnx.checker: {str(e).splitlines()[0]}") from e
    return proto.SerializeToString(), meta


def export(model, info: dict, out, *, variant: str = "sparse", precision: str | None = None,
           onnx_only: bool = False, shapes: tuple = (None, None, None), timing_cache: str | None = None,
           trt_version: str = tensorrt_rules.DEFAULT_VERSION, say=None) -> dict:
    """--onnx-only: write the TensorRT-bound ONNX to `out` (.onnx). Otherwise build an engine at
    `out` (.plan or .engine) from the same bytes, its metadata in `<out>.json`."""
    precision = precision or DEFAULT_PRECISION
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the tensorrt target; use fp16 or fp32")
    out = Path(out)
    if onnx_only and out.suffix != ".onnx":
        raise ExportError(f"{out}: --onnx-only writes ONNX, so the name must end in .onnx; use -o {out.with_suffix('.onnx')}")
    if not onnx_only and out.suffix not in PLAN_SUFFIXES:
        raise ExportError(f"{out}: a TensorRT engine's name must end in .plan or .engine (or pass --onnx-only "
                          f"with -o {out.with_suffix('.onnx')})")
    artifact.check_writable(out)
    prof = profile(model.cfg, *(parse_shapes(s, f"--{k}-shapes") for s, k in zip(shapes, ("min", "opt", "max"))))
    if not onnx_only:
        require_tensorrt()  # before the export's minutes, not after
    data, meta = bound_onnx(model, info, variant=variant, trt_version=trt_version, prof=prof)
    if onnx_only:
        with artifact.atomic_path(out) as tmp:
            tmp.write_bytes(data)
        return meta
    return build_engine(data, meta, out, precision=precision, timing_cache=timing_cache, say=say)


def export_from_onnx(path, out, *, precision: str | None = None, timing_cache: str | None = None,
                     shapes: tuple = (None, None, None), say=None) -> dict:
    """Build an engine from a TensorRT-bound ONNX written earlier with --onnx-only (its exact bytes)."""
    from adaptex.graphs import checkpoint
    from adaptex.graphs.budgetformer import BudgetFormerConfig

    precision = precision or DEFAULT_PRECISION
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the tensorrt target; use fp16 or fp32")
    meta = artifact.read_onnx_metadata(path)
    if meta.get("target") != "tensorrt":
        raise ExportError(f"{path}: was exported for {meta.get('target')}, not TensorRT; re-export it with "
                          "'adaptex export --target tensorrt --onnx-only'")
    out = Path(out)
    if out.suffix not in PLAN_SUFFIXES:
        raise ExportError(f"{out}: a TensorRT engine's name must end in .plan or .engine")
    artifact.check_writable(out)
    if any(shapes):
        cfg_cls = checkpoint.FAMILIES.get(meta["family"], (BudgetFormerConfig,))[0]
        cfg = cfg_cls.from_dict(meta["config"])
        meta["tensorrt"]["profile"] = profile(cfg, *(parse_shapes(s, f"--{k}-shapes")
                                                     for s, k in zip(shapes, ("min", "opt", "max"))))
    require_tensorrt()
    return build_engine(Path(path).read_bytes(), meta, out, precision=precision, timing_cache=timing_cache, say=say)


# --- stage 2: the engine (TensorRT 10 Python API; unverified on these machines) ---------------------

NO_TENSORRT = ("building a TensorRT engine needs TensorRT 10 and an NVIDIA GPU, and {why}; write the "
               "TensorRT-bound ONNX here with --onnx-only -o model.onnx, then build it on a GPU machine with "
               "'adaptex export --target tensorrt model.onnx -o model.plan'")


def require_tensorrt():
    """tensorrt, once a CUDA device is visible; else ExportError naming --onnx-only."""
    try:
        import tensorrt as trt
    except Exception:  # the registry's stub packages raise on import too
        raise ExportError(NO_TENSORRT.format(why="TensorRT is not installed here")) from None
    from adaptex.runtimes.tensorrt import cuda_device_count

    if cuda_device_count() < 1:
        raise ExportError(NO_TENSORRT.format(why="no CUDA device is visible"))
    return trt


def pin_routing(network, mark: str, routing_values: set[str], trt) -> int:
    """Require fp32 for every layer that computes routing: named with `mark` (function bodies and the
    main graph's routers) or producing a main-graph routing value. Returns how many were pinned."""
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        outs = [layer.get_output(j) for j in range(layer.num_outputs)]
        if mark in layer.name or any(o is not None and o.name in routing_values for o in outs):
            if layer.type in (trt.LayerType.CONSTANT, trt.LayerType.SHAPE):
                continue
            layer.precision = trt.float32
            for j, o in enumerate(outs):
                if o is not None and o.dtype in (trt.float32, trt.float16):
                    layer.set_output_type(j, trt.float32)
            pinned += 1
    return pinned


def build_engine(data: bytes, meta: dict, out: Path, *, precision: str, timing_cache: str | None, say=None,
                 pin: bool = True) -> dict:
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
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        pinned = pin_routing(network, meta["tensorrt"]["routing_mark"], set(meta["tensorrt"]["routing_values"]), trt)
        if pinned == 0 and pin:
            raise ExportError("no routing layer was found to pin to fp32, so fp16 could move decisions; "
                              "build with --precision fp32")
    cache = None
    if timing_cache:
        blob = Path(timing_cache).read_bytes() if Path(timing_cache).is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)
    say(f"building the TensorRT engine ({precision}, {pinned} routing layers pinned to fp32) ...")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ExportError("TensorRT failed to build the engine (its log above says why)")
    if timing_cache:
        with artifact.atomic_path(timing_cache) as tmp:
            tmp.write_bytes(bytes(config.get_timing_cache().serialize()))
    meta = {**meta, "precision": precision}
    meta["tensorrt"] = {**meta["tensorrt"], "version": trt.__version__, "routing_layers_pinned": pinned,
                        "onnx_sha256": hashlib.sha256(data).hexdigest()}
    with artifact.atomic_path(sidecar(out)) as tmp_meta, artifact.atomic_path(out) as tmp:
        tmp.write_bytes(bytes(plan))
        tmp_meta.write_text(json.dumps(meta, indent=1))
    return meta


def sidecar(plan: str | Path) -> Path:
    """Where an engine's metadata lives: beside it, `<plan>.json`."""
    return Path(str(plan) + ".json")
