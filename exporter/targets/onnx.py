"""ONNX target (ONNX Runtime): each adaptex op is one custom-domain node with a model-local body.

Path: torch.export -> torch.onnx.export(dynamo=True) with a custom translation per adaptex op that
emits the `adaptex.<Op>` node -> the lowering's FunctionProto appended to model.functions.
optimize=False: the exporter's optimiser would inline the functions away, and with them the
one-node-per-op contract that TensorRT plugins and parity tooling rely on.
"""
from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import onnx

import adaptex.graphs  # noqa: F401
from adaptex.exporter import metadata as artifact
from adaptex.exporter.errors import ExportError
from adaptex.exporter.registry import lowering
from adaptex.exporter.targets import onnx_functions as fx
from adaptex.exporter.trace import adaptex_nodes, io_names, trace

PRECISIONS = ("fp32",)
DEFAULT_PRECISION = "fp32"


@dataclass(frozen=True)
class LoweringContext:
    """What a lowering may depend on besides the node itself."""
    target: str
    variant: str
    precision: str
    onnx_opset: int


@dataclass
class OnnxLowering:
    """What an ONNX lowering hands the exporter: the translation that emits the node, and bodies."""
    translation: Callable
    functions: list[onnx.FunctionProto]


def _budgeted_attention_node(x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o, num_heads: int):
    from onnxscript.values import Opset

    return Opset(fx.DOMAIN, fx.OPSET_VERSION).BudgetedAttention(
        x, key_mask, s, p, w_qkv, b_qkv, w_o, b_o, num_heads=num_heads)


@lowering("adaptex::budgeted_attention", target="onnx", variant="sparse")
def budgeted_attention_onnx_sparse(ctx, node):
    """TopK with a runtime K (the batch's largest k), Gather of those heads' weight rows and output
    columns, attention on k heads only. At batch 1 exactly k heads run; in a batch, max_b k_b heads run
    and heads past a sample's own k get weight zero."""
    return OnnxLowering(_budgeted_attention_node, [fx.budgeted_attention_function("sparse")])


@lowering("adaptex::budgeted_attention", target="onnx", variant="dense")
def budgeted_attention_onnx_dense(ctx, node):
    """Every head projected and attended, unselected heads weighted by zero: static shapes."""
    return OnnxLowering(_budgeted_attention_node, [fx.budgeted_attention_function("dense")])


def _conditional_ffn_node(x, keep, gate, ln_w, ln_b, w1, b1, w2, b2, eps: float):
    from onnxscript.values import Opset

    return Opset(fx.DOMAIN, fx.OPSET_VERSION).ConditionalFFN(x, keep, gate, ln_w, ln_b, w1, b1, w2, b2, eps=eps)


@lowering("adaptex::conditional_ffn", target="onnx", variant="sparse")
def conditional_ffn_onnx_sparse(ctx, node):
    """NonZero over the keep mask, Gather of the kept tokens, LayerNorm + FFN (two Gemms) on them
    only, ScatterND back: skipped tokens cost nothing."""
    return OnnxLowering(_conditional_ffn_node, [fx.conditional_ffn_function("sparse")])


@lowering("adaptex::conditional_ffn", target="onnx", variant="dense")
def conditional_ffn_onnx_dense(ctx, node):
    """Every token through the FFN, the update multiplied by keep * gate: static shapes."""
    return OnnxLowering(_conditional_ffn_node, [fx.conditional_ffn_function("dense")])


def _conditional_attention_node(x, hn, keep, gate, k, v, bias, wq, bq, wo, bo, num_heads: int):
    from onnxscript.values import Opset

    return Opset(fx.DOMAIN, fx.OPSET_VERSION).ConditionalAttention(x, hn, keep, gate, k, v, bias, wq, bq, wo, bo,
                                                                   num_heads=num_heads)


@lowering("adaptex::conditional_attention", target="onnx", variant="sparse")
def conditional_attention_onnx_sparse(ctx, node):
    """TopK over the keep mask (K = the batch's largest kept count), Gather of those query rows, Q
    projection, scores, Softmax, AV and output projection on them only, ScatterND back: a skipped
    token's query side costs nothing (its keys and values are computed outside the op)."""
    return OnnxLowering(_conditional_attention_node, [fx.conditional_attention_function("sparse")])


@lowering("adaptex::conditional_attention", target="onnx", variant="dense")
def conditional_attention_onnx_dense(ctx, node):
    """Every query row attended, the update multiplied by keep * gate: static shapes."""
    return OnnxLowering(_conditional_attention_node, [fx.conditional_attention_function("dense")])


def _elastic_attention_node(q, k, v, sa, key_mask, sink: int, window: int, causal: bool):
    from onnxscript.values import Opset

    return Opset(fx.DOMAIN, fx.OPSET_VERSION).ElasticAttention(q, k, v, sa, key_mask, sink=sink, window=window,
                                                               causal=int(causal))


def _causal(node) -> bool | None:
    """The node's causal flag when tracing left it a constant (the encoder's False), else None."""
    c = node.args[7] if node is not None and len(node.args) > 7 else None
    return c if isinstance(c, bool) else None


@lowering("adaptex::elastic_attention", target="onnx", variant="sparse")
def elastic_attention_onnx_sparse(ctx, node):
    """The (B*H) head pairs split by mode (NonZero over sa): FA pairs attend every visible key, SA
    pairs block-local (each block of min(window, T) queries against its own run of keys, plus the
    sinks: O(T (sink + window))); ScatterND puts both groups back."""
    return OnnxLowering(_elastic_attention_node, [fx.elastic_attention_function("sparse", _causal(node))])


@lowering("adaptex::elastic_attention", target="onnx", variant="dense")
def elastic_attention_onnx_dense(ctx, node):
    """Every head over the full score matrix, SA heads through a band mask: static shapes."""
    return OnnxLowering(_elastic_attention_node, [fx.elastic_attention_function("dense")])


def _name_dynamic_axes(proto: onnx.ModelProto) -> None:
    """Rename the tracer's symbols (s0, s1...) to 'batch', 'sequence' and, for decoders,
    'past_sequence' everywhere, inside expressions too ('past_sequence + sequence')."""
    import re

    inputs = {i.name: i.type.tensor_type.shape.dim for i in proto.graph.input}
    dims = inputs[proto.graph.input[0].name]
    rename = {dims[0].dim_param: "batch", dims[1].dim_param: "sequence"}
    for name, d in inputs.items():
        if name.startswith("past_key_values.") and d[2].dim_param:
            rename[d[2].dim_param] = "past_sequence"
    rename = {k: v for k, v in rename.items() if k}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, rename)) + r")\b") if rename else None
    for vi in list(proto.graph.input) + list(proto.graph.output) + list(proto.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param and pattern:
                d.dim_param = pattern.sub(lambda m: rename[m.group(1)], d.dim_param)


def _io_spec(values) -> dict:
    out = {}
    for v in values:
        tt = v.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tt.shape.dim]
        out[v.name] = {"dtype": onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name, "shape": shape}
    return out


def lower(model, *, variant: str = "sparse", precision: str = "fp32",
          target: str = "onnx") -> tuple[onnx.ModelProto, dict]:
    """Trace `model` and lower it to an ONNX ModelProto with `target`'s lowerings (the TensorRT
    target hands its engine builder ONNX too); returns (proto, lowering notes)."""
    from adaptex.exporter.registry import lookup

    ep = trace(model, mode="hard")
    ctx = LoweringContext(target, variant, precision, fx.ONNX_OPSET)
    table, functions, notes = {}, {}, {}
    for node in adaptex_nodes(ep):
        op = node.target.name()  # "adaptex::budgeted_attention"
        entry = lookup(op, target, variant, node)
        res = entry.fn(ctx, node)
        table[node.target] = res.translation
        for f in res.functions:
            functions[(f.domain, f.name)] = f
        notes[op] = entry.fn.__name__
    fx.register_schema()
    inputs, names = io_names(model.cfg)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = _torch_onnx_export(ep, table, inputs, names)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.onnx.export failed: {first}") from e
    proto = _optimize_main_graph(prog.model_proto)
    proto.functions.extend(functions.values())
    if not any(o.domain == fx.DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(fx.DOMAIN, fx.OPSET_VERSION))
    _name_dynamic_axes(proto)
    return proto, notes


def _optimize_main_graph(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Constant folding and clean-ups on the main graph, leaving the adaptex nodes whole.

    Without it ONNX Runtime's fusions (LayerNorm+residual, bias+GELU) miss the exporter's raw
    patterns and the adaptive graph pays for them, not for its attention."""
    import onnxscript.optimizer

    try:
        return onnxscript.optimizer.optimize(proto, inline=False)
    except Exception as e:  # an optimiser failure costs speed, never correctness: keep the raw graph
        logging.getLogger(__name__).warning("onnxscript optimizer skipped: %s", str(e).splitlines()[0])
        return proto


def _torch_onnx_export(ep, table: dict, inputs: list[str], names: list[str]):
    """The stock dynamo exporter with our translations; optimize=False keeps the adaptex nodes whole."""
    import torch

    return torch.onnx.export(
        ep, (), dynamo=True, custom_translation_table=table or None,
        optimize=False, opset_version=fx.ONNX_OPSET, input_names=inputs, output_names=names,
        verbose=False,
    )


def export(model, info: dict, out, *, variant: str = "sparse", precision: str = "fp32") -> dict:
    """Export to `out` atomically; returns the artifact metadata."""
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the onnx target yet; "
                          f"use one of {', '.join(PRECISIONS)}")
    if not str(out).endswith(".onnx"):
        raise ExportError(f"{out}: an ONNX artifact's name must end in .onnx (runners pick the runtime by it); "
                          f"use -o {out}.onnx")
    artifact.check_writable(out)
    proto, notes = lower(model, variant=variant, precision=precision)
    cfg = model.cfg
    meta = {
        "format": artifact.FORMAT_VERSION,
        "family": cfg.family,
        "target": "onnx",
        "variant": variant,
        "precision": precision,
        "opset": {"adaptex": fx.OPSET_VERSION, "onnx": fx.ONNX_OPSET},
        "lowerings": notes,
        **artifact.routing_meta(cfg),
        "config": cfg.to_dict(),
        "source": {"checkpoint": info.get("name") or info.get("path"), "sha256": info.get("sha256")},
        "inputs": _io_spec(proto.graph.input),
        "outputs": _io_spec(proto.graph.output),
        "max_sequence": cfg.max_len,
    }
    if info.get("tokenizer"):
        meta["tokenizer"] = info["tokenizer"]
    proto.metadata_props.append(onnx.StringStringEntryProto(key=artifact.META_KEY, value=json.dumps(meta)))
    proto.producer_name, proto.doc_string = "adaptex", f"{cfg.family} exported by adaptex ({variant})"
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        raise ExportError(f"the exported model fails onnx.checker: {str(e).splitlines()[0]}") from e
    with artifact.atomic_path(out) as tmp:
        onnx.save_model(proto, str(tmp))
    return meta
