"""ONNX target (ONNX Runtime): each adaptex op is one custom-domain node with a model-local body.

Path: torch.export -> torch.onnx.export(dynamo=True) with a custom translation per adaptex op that
emits the `adaptex.<Op>` node -> the lowering's FunctionProto appended to model.functions.
optimize=False: the exporter's optimiser would inline the functions away, and with them the
one-node-per-op contract that TensorRT plugins and parity tooling rely on; the main graph is then
optimised with the functions left whole.
"""
from __future__ import annotations

import json
import logging
import warnings

import onnx

from adaptex.exporter import metadata
from adaptex.exporter.errors import ExportError
from adaptex.exporter.registry import lookup
from adaptex.exporter.targets import Option, Target, register_target
from adaptex.exporter.targets.onnx import dispatch
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.onnx import passes, passes_by_sample
from adaptex.exporter.targets.onnx import portable
from adaptex.exporter.targets.onnx.lowerings import LoweringContext
from adaptex.exporter.trace import adaptex_nodes, io_specs, op_name, trace

PRECISIONS = ("fp32",)


def trace_for(model, contract, target: str = "onnx", step: bool = False, decode_graph: bool = False,
              short: bool = False, masked: bool = False):
    """The exported program `lower` lowers for `target` (step: a decoder's decode-step program;
    short: its short-call program, masked: its masked one; decode_graph: the general (or
    short-call) program of an artifact that holds a decode-step program too)."""
    # ONNX Runtime runs an If's taken branch only (an elastic decoder's routers skip decode steps);
    # TensorRT-bound graphs compute both and select, as their op bodies keep no decode-step If
    # (unverified on an engine here, so the TensorRT graph stays the one already checked). Beside a
    # decode-step graph the general graph's calls after a cache are chunks of several tokens (rare),
    # so its routers compute and select too: no If per layer at a prefill
    return trace(model, contract, mode="hard", control_flow=target == "onnx" and not decode_graph, step=step,
                 short=short, masked=masked)


def lower(model, contract, *, variant: str = "sparse", precision: str = "fp32",
          target: str = "onnx", ep=None, step: bool = False, short: bool = False, masked: bool = False,
          decode_graph: bool = False, by_sample: bool = True, near: bool = False,
          floor: bool = True, ops_by_sample: bool = True) -> tuple[onnx.ModelProto, dict, dict, dict]:
    """Trace `model` (or take `ep`, trace_for's program) and lower it to an ONNX ModelProto with
    `target`'s lowerings (the TensorRT target hands its engine builder ONNX too); returns (proto,
    lowering per op, inputs, outputs). step: the decode-step program, lowered with the ops' step
    bodies where they have one (its inputs and outputs are the general graph's, at one new token);
    short: the short-call program (no adaptex call: dense attention and the routers); masked, with
    short: the masked short-call program (the streaming heads' keys beyond their reach masked);
    decode_graph: the general program of an artifact that holds the step program too. by_sample:
    False leaves out the main graph's attention-by-sample If (passes.attention_by_sample), for a
    graph whose calls are known to stay below its threshold; ops_by_sample=False does the same in
    the ops' bodies (their own attention-by-sample Ifs). near: with step, the near-cache step
    program (the ops' near-cache step bodies, fx.NEAR_STEP_KEYS). floor: False leaves out
    passes.softmax_floor, for a graph that serves only small calls (a step graph never has it:
    three kernels more a layer, where a step's one query row has nothing masked to speed up)."""
    ep = ep if ep is not None else trace_for(model, contract, target, step=step, short=short, masked=masked,
                                             decode_graph=decode_graph)
    inputs, outputs = io_specs(ep, contract)
    ctx = LoweringContext(target, variant, precision, fx.ONNX_OPSET, step=step, decode_graph=decode_graph,
                          near=near, by_sample=ops_by_sample)
    table, functions, notes = {}, {}, {}
    for node in adaptex_nodes(ep):
        entry = lookup(op_name(node), target, variant, node)
        res = entry.fn(ctx, node)
        table[node.target] = res.translation
        for f in res.functions:
            key = (f.domain, f.name, f.overload)
            if key in functions and functions[key] != f:
                raise ExportError(f"two calls of {f.domain}.{f.name} need different bodies under one name (calls "
                                  "specialised to their shapes: different head widths?); export them as separate models")
            functions[key] = f
        notes[op_name(node)] = entry.fn.__name__
    fx.register_schema()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = _torch_onnx_export(ep, table, contract.input_names(), contract.output_names())
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.onnx.export failed: {first}") from e
    proto = _optimize_main_graph(prog.model_proto)
    _restore_input_names(proto, contract.input_names())
    proto.functions.extend(functions.values())  # before the passes: softmax_floor rewrites the op bodies too
    if target == "onnx" and step:  # a few rows a call: fewer kernels (passes.skip_layernorm)
        passes.skip_layernorm(proto)
    elif target == "onnx":  # ONNX Runtime's speed; TensorRT fuses normalisation its own way
        passes.artifact_passes(proto, by_sample=by_sample, floor=floor)
    _bind_overloads(proto)
    if not any(o.domain == fx.DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(fx.DOMAIN, fx.OPSET_VERSION))
    uses_contrib = any(o.domain == fx.MS_DOMAIN for f in proto.functions for o in f.opset_import)
    if uses_contrib and not any(o.domain == fx.MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(fx.MS_DOMAIN, 1))
    name_axes(proto, inputs, outputs)
    return proto, notes, inputs, outputs


def _restore_input_names(proto: onnx.ModelProto, names: list[str]) -> None:
    """Give the graph's inputs the contract's names again where the exporter renamed one: an input
    that is also an output as it is (a decode step's decisions.layer{i}.sa is its head_modes.{i})
    comes out as `<output>_orig`."""
    rename = {vi.name: want for vi, want in zip(proto.graph.input, names) if vi.name != want}
    if not rename:
        return
    for vi in proto.graph.input:
        vi.name = rename.get(vi.name, vi.name)

    def walk(nodes) -> None:
        for node in nodes:
            node.input[:] = [rename.get(n, n) for n in node.input]
            for g in passes.subgraphs(node):
                walk(g.node)
                for o in g.output:
                    o.name = rename.get(o.name, o.name)
    walk(proto.graph.node)
    for o in proto.graph.output:
        if o.name in rename:
            raise ExportError(f"the exported graph names an output {o.name!r} after an input; report this")


def _bind_overloads(proto: onnx.ModelProto) -> None:
    """Point each adaptex call at its function overload where its op has any: a body specialised to
    the call's head count (fx.budgeted_attention_function's grouped_heads) is the overload
    `heads{num_heads}`. The tracer writes the calls without one."""
    overloads = {(f.domain, f.name, f.overload) for f in proto.functions if f.overload}

    def walk(nodes) -> None:
        for node in nodes:
            heads = next((a.i for a in node.attribute if a.name == "num_heads"), None)
            if (node.domain, node.op_type, f"heads{heads}") in overloads:
                node.overload = f"heads{heads}"
            for g in passes.subgraphs(node):
                walk(g.node)
    walk(proto.graph.node)


def name_axes(proto: onnx.ModelProto, inputs: dict, outputs: dict) -> None:
    """Give the graph's inputs and outputs the artifact's axis names ('batch', 'sequence',
    'past_sequence + sequence', ...) in place of the tracer's symbols, and their descriptions."""
    for values, specs in ((proto.graph.input, inputs), (proto.graph.output, outputs)):
        for vi in values:
            spec = specs.get(vi.name)
            if spec is None:
                continue
            for d, want in zip(vi.type.tensor_type.shape.dim, spec["shape"]):
                if isinstance(want, str):
                    d.dim_param = want
                else:
                    d.dim_value = want
            vi.doc_string = spec.get("description", "")


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


def stamp(proto: onnx.ModelProto, meta: dict, description: str) -> None:
    """Write the metadata into the model: the JSON blob under `adaptex`, every top-level key also as
    its own entry (Netron lists them one per row), adaptex as the producer, a model description."""
    del proto.metadata_props[:]
    proto.metadata_props.append(onnx.StringStringEntryProto(key=metadata.META_KEY, value=json.dumps(meta)))
    for k, v in meta.items():
        if k in ("inputs", "outputs", "tokenizer", "decisions"):
            continue
        text = v if isinstance(v, str) else json.dumps(v)
        proto.metadata_props.append(onnx.StringStringEntryProto(key=f"adaptex.{k}", value=text[:4096]))
    proto.producer_name, proto.producer_version = "adaptex", metadata.version()
    proto.doc_string = description


def is_onnx_artifact(path) -> bool:
    try:
        metadata.read_onnx_metadata(path)
        return True
    except Exception:
        return False


def describe(meta: dict, what: str = "") -> str:
    return (f"{meta['family']} model exported by adaptex {meta.get('adaptex', '')}{what} ({meta['variant']} "
            f"lowering, {meta['precision']}); decisions: {len(meta.get('decisions', {}))} named outputs "
            "decisions.*; the full metadata is the JSON under the 'adaptex' key")


# A decoder's main graph gets a large-call program (dispatch.merge_large_call) only where a call of
# at most this many sequences of its longest length reaches the attention-by-sample threshold: the
# largest batch of the latency grid (docs/benchmarking.md). Below, the program would never run and
# only double what a session that loads the file holds.
LARGE_CALL_BATCH = 64


def _may_run_by_sample(contract, rows: int, keys: int | None = None) -> bool:
    """Whether a call of at most `rows` token rows over at most `keys` keys (default: the model's
    longest sequence) may reach attention_by_sample's threshold: its scores (B H T S) are at most
    rows x heads x keys. Unknown sizes: True."""
    heads, longest = getattr(contract.cfg, "num_heads", None), keys or contract.max_sequence
    return not (heads and longest) or rows * heads * longest >= fx.BY_SAMPLE_FROM


def dense_rows_option(value) -> int | None:
    """The dense_rows option as a whole number >= 1 (the CLI passes text), or None when not given or
    "off"."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise ExportError(f"--dense-rows {value!r}: give a whole number of token rows (batch x sequence) of at "
                          "least 1, e.g. --dense-rows 32, or off")
    return int(text)


def _on_off(value, flag: str, default: bool) -> bool:
    """An on/off option as a bool: "on" or "off" (the CLI passes text), a bool, or None for `default`."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("on", "off"):
        raise ExportError(f"{flag} {value!r}: give on or off")
    return text == "on"


def decode_graph_option(value, contract) -> bool:
    """The decode_graph option as a bool; None for the contract's default (on for the families
    whose decode steps it was measured to speed up)."""
    return _on_off(value, "--decode-graph", bool(getattr(contract, "decode_graph", False)))


def short_graph_option(value, contract) -> bool:
    """The short_graph option as a bool; None for on where the model has a short-call program (an
    elastic decoder)."""
    return _on_off(value, "--short-graph", contract.short_call_keys() is not None)


def export(model, contract, out, *, variant: str = "sparse", precision: str | None = None, source: dict,
           tokenizer: dict | None = None, say=None, dense_rows=None, decode_graph=None, short_graph=None,
           softmax_floor=None) -> dict:
    """Export to `out` atomically; returns the artifact metadata. dense_rows=N: one graph holding
    the sparse and the dense lowering, running the dense one for calls of at most N token rows
    (dispatch.py). decode_graph (decoders): one graph more, traced for a decode step, which runs
    the calls of one new token after a non-empty cache (dispatch.merge_decode_step). short_graph
    (elastic decoders): one graph more, traced for prefills within the streaming heads' reach (at
    most sink + window tokens, no cache), which runs those calls (dispatch.merge_short_call), and
    where the model has one (contract.masked_call_keys(), masked_call_excess()) its masked form for
    the prefills a little longer. softmax_floor (default on): passes.softmax_floor in every graph but
    the decode-step ones; off for a CPU whose Softmax takes masked scores at full speed
    (docs/benchmarking.md#the-softmax-floor)."""
    precision = precision or "fp32"
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the onnx target yet; "
                          f"use one of {', '.join(PRECISIONS)}")
    rows = dense_rows_option(dense_rows)
    if rows is not None and variant != "sparse":
        raise ExportError(f"--dense-rows dispatches between the sparse and the dense lowering; it needs --variant "
                          f"sparse, not {variant}")
    explicit = decode_graph is not None
    step = decode_graph_option(decode_graph, contract)
    if step and explicit and not contract.decoder:
        raise ExportError("--decode-graph is for decoders (models with a KV cache); this model has none: leave it off")
    if step and explicit and variant != "sparse":
        raise ExportError(f"--decode-graph serves the sparse lowering; with --variant {variant} leave it off")
    if step and explicit and rows is not None:
        raise ExportError("--decode-graph and --dense-rows each put an If at the top of the graph; choose one "
                          "(--decode-graph off or --dense-rows off)")
    step = step and contract.decoder and variant == "sparse" and rows is None  # a family default gives way
    explicit_short = short_graph is not None
    short = short_graph_option(short_graph, contract)
    if short and explicit_short and contract.short_call_keys() is None:
        raise ExportError("--short-graph is for elastic decoders (calls within their streaming heads' sinks and "
                          "window); this model has no short-call program: leave it off")
    if short and explicit_short and variant != "sparse":
        raise ExportError(f"--short-graph serves the sparse lowering; with --variant {variant} leave it off")
    if short and explicit_short and rows is not None:
        raise ExportError("--short-graph and --dense-rows each put an If at the top of the graph; choose one "
                          "(--short-graph off or --dense-rows off)")
    short = short and variant == "sparse" and rows is None
    floor = _on_off(softmax_floor, "--softmax-floor", True)
    TARGET.check_output(out, {})
    metadata.check_writable(out, is_onnx_artifact)
    say = say or (lambda m: None)
    ep = trace_for(model, contract, decode_graph=step)  # one trace, lowered once per variant
    heads = getattr(contract.cfg, "num_heads", None)
    longest = contract.max_sequence
    # a decoder's main graph serves its decode steps and short prompts too, where an attention-by-
    # sample If per layer costs more than a small call has (charlm-dense's B1 steps: 1.16 to 1.19x;
    # tsa-charlm's sparse program at B1, T = 128 0.95 without the op bodies' Ifs): where no
    # decode-step or short-call graph dispatches at the top, the op bodies leave them out, and so
    # does the main graph unless the dense branch of --dense-rows takes the small calls (with its
    # If, the sparse program at B1, T = 512 ran 0.91 of itself without: docs/benchmarking.md#large-calls);
    # the calls large enough run a second program of the same weights that has them all (the
    # large-call program, in the sparse branch where there is a dense one)
    split = contract.decoder and variant == "sparse" and not step and not short \
        and isinstance(heads, int) and heads > 0 and bool(longest) \
        and _may_run_by_sample(contract, LARGE_CALL_BATCH * longest)
    proto, notes, inputs, outputs = lower(model, contract, variant=variant, precision=precision, ep=ep,
                                          decode_graph=step, ops_by_sample=not split,
                                          by_sample=not contract.decoder or rows is not None, floor=floor)
    routed, stepped, within, large = None, None, None, None
    if split:
        big, _, _, _ = lower(model, contract, variant=variant, precision=precision, ep=ep, by_sample=True, floor=floor)
        if passes_by_sample.attends_by_sample(big):
            say("the graph for large calls too (attention a sample at a time) ...")
            ids_input, keys_input = contract.input_names()[:2]
            large = {"ids_input": ids_input, "keys_input": keys_input, "heads": heads,
                     "from_scores": fx.BY_SAMPLE_FROM}  # the merge's condition is what the metadata records
            proto = dispatch.merge_large_call(big, proto, **large, domain=fx.DOMAIN)
    if rows is not None:
        say(f"lowering the dense variant too, for calls of at most {rows} token rows ...")
        dense_by_sample = _may_run_by_sample(contract, rows)
        dense_proto, dense_notes, _, _ = lower(model, contract, variant="dense", precision=precision, ep=ep,
                                               by_sample=dense_by_sample, floor=floor)
        rows_input = contract.input_names()[0]
        proto = dispatch.merge(proto, dense_proto, rows_input=rows_input, dense_rows=rows, domain=fx.DOMAIN)
        routed = {"dense_rows": rows, "rows_input": rows_input, "dense_lowerings": dense_notes}
        if contract.decoder:
            # its decode steps take the dense lowering without softmax_floor, whose three kernels a
            # layer only cost a step; its short prompts keep the floor (a causal mask's scores)
            say("lowering the dense variant for decode steps too (no softmax floor) ...")
            step_proto, _, _, _ = lower(model, contract, variant="dense", precision=precision, ep=ep,
                                        by_sample=dense_by_sample, floor=False)
            proto = dispatch.merge_dense_step(step_proto, proto, rows_input=rows_input, dense_rows=rows,
                                              domain=fx.DOMAIN)
            routed["step_graph"] = True
    if short:
        keys, longer = contract.short_call_keys(), contract.masked_call_keys()
        keys_input, cache_input = contract.input_names()[1], contract.input_names()[2]
        within = {"keys_input": keys_input, "cache_input": cache_input, "max_keys": keys}
        # short calls: an attention-by-sample If would only cost (by_sample=False)
        if longer is not None:  # the inner If: prefills up to `longer` tokens, the masked program
            say(f"tracing and lowering the masked short-call graph too (prefills of {keys + 1} to {longer} "
                "tokens, and longer ones where masking adds few scores) ...")
            masked_ep = trace_for(model, contract, short=True, masked=True, decode_graph=step)
            masked_proto, _, _, _ = lower(model, contract, variant=variant, precision=precision, ep=masked_ep,
                                          short=True, masked=True, decode_graph=step, by_sample=False, floor=floor)
            excess = contract.masked_call_excess()  # longer prefills too, where masking adds few scores
            proto = dispatch.merge_short_call(masked_proto, proto, keys_input=keys_input, cache_input=cache_input,
                                              max_keys=longer, domain=fx.DOMAIN, masked=True, excess=excess)
            within["masked_keys"] = longer
            if excess is not None:
                within["masked_excess"] = excess
            if isinstance(heads, int) and heads > 0 and _may_run_by_sample(contract, LARGE_CALL_BATCH * longer, longer):
                # its large batches a sample at a time (the bias planes gathered in the Loop), behind an If
                # of their own: the masked program's smaller calls pay no If a layer
                big, _, _, _ = lower(model, contract, variant=variant, precision=precision, ep=masked_ep,
                                     short=True, masked=True, decode_graph=step, by_sample=True, floor=floor)
                if passes_by_sample.by_sample_ifs(big.graph.node):
                    say("the masked short-call graph for large batches too (attention a sample at a time) ...")
                    by_sample = {"heads": heads, "from_scores": fx.BY_SAMPLE_FROM}
                    proto = dispatch.merge_short_call(big, proto, keys_input=keys_input, cache_input=cache_input,
                                                      max_keys=longer, domain=fx.DOMAIN, masked=True, large=by_sample,
                                                      excess=excess)
                    within["masked_large_call"] = by_sample
        say(f"tracing and lowering the short-call graph too (prefills of at most {keys} tokens) ...")
        short_proto, _, _, _ = lower(model, contract, variant=variant, precision=precision, short=True,
                                     decode_graph=step, by_sample=False, floor=floor)
        proto = dispatch.merge_short_call(short_proto, proto, keys_input=keys_input, cache_input=cache_input,
                                          max_keys=keys, domain=fx.DOMAIN)
    if step:
        say("tracing and lowering the decode-step graph too (one new token after a non-empty cache) ...")
        step_ep = trace_for(model, contract, step=True)
        step_proto, step_notes, _, _ = lower(model, contract, variant=variant, precision=precision, ep=step_ep,
                                             step=True)
        ids_input, keys_input, past_input = contract.input_names()[:3]
        proto = dispatch.merge_decode_step(step_proto, proto, ids_input=ids_input, past_input=past_input,
                                           domain=fx.DOMAIN)
        stepped = {"new_tokens_input": ids_input, "cache_input": past_input, "lowerings": step_notes}
        reach = contract.short_call_keys()
        if reach is not None and variant == "sparse":  # an elastic decoder: steps after a short cache
            # without the softmax floor (a CPU whose Softmax takes masked scores at full speed) the near
            # program wins over more keys: twice the cells, and its key count's rule at every batch
            near = fx.NEAR_STEP_KEYS * reach
            cells = (fx.NEAR_STEP_CELLS if floor else fx.NEAR_STEP_CELLS_UNFLOORED) * reach
            capped = {"near_keys_cells": fx.NEAR_STEP_KEYS_CELLS * reach} if floor else {}
            batches = f" and {capped['near_keys_cells']} batch x keys" if capped else ""
            say(f"lowering the near-cache decode-step graph too (steps of at most {near} keys{batches}, or at most "
                f"{cells} batch x keys) ...")
            near_proto, _, _, _ = lower(model, contract, variant=variant, precision=precision, ep=step_ep,
                                        step=True, near=True)
            proto = dispatch.merge_decode_step(near_proto, proto, ids_input=ids_input, past_input=past_input,
                                               keys=(keys_input, near, cells, *capped.values()), domain=fx.DOMAIN)
            stepped.update(keys_input=keys_input, near_keys=near, near_cells=cells, **capped)
    portable.if_outputs_copied(proto)  # what keeps the file right in OpenVINO too (portable.py)
    meta = metadata.build(contract, target="onnx", variant=variant, precision=precision, lowerings=notes,
                          inputs=inputs, outputs=outputs, source=source,
                          opset={"adaptex": fx.OPSET_VERSION, "onnx": fx.ONNX_OPSET},
                          tokenizer=tokenizer, dispatch=routed, decode_step=stepped, short_call=within,
                          large_call=large, softmax_floor=floor)
    stamp(proto, meta, describe(meta))
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        raise ExportError(f"the exported model fails onnx.checker: {str(e).splitlines()[0]}") from e
    with metadata.atomic_path(out) as tmp:
        onnx.save_model(proto, str(tmp))
    return meta


TARGET = register_target(Target(
    name="onnx", suffixes=(".onnx",), precisions=PRECISIONS, export=export,
    default_precision=lambda contract: "fp32", description="ONNX for ONNX Runtime (CPU, CUDA, web, mobile)",
    options=(Option("--dense-rows", "one graph with both lowerings: calls of at most N token rows (batch x "
                                    "sequence) run the dense one, larger calls the sparse one; off: the sparse "
                                    "graph alone (default: what the checkpoint records, else off; "
                                    "docs/benchmarking.md#never-slower-than-dense)",
                    variants=("sparse",)),
             Option("--decode-graph", "decoders: on puts a second graph in the artifact, traced for a decode step "
                                      "(one new token after a non-empty cache), which runs those calls; off: the "
                                      "one general graph (default: on for elastic decoders, else off; "
                                      "docs/benchmarking.md#decode-steps)",
                    variants=("sparse",)),
             Option("--short-graph", "elastic decoders: on puts two more graphs in the artifact, traced for "
                                     "prefills of at most sink + window tokens, where every head attends "
                                     "as dense attention does and the routers still decide, and for longer "
                                     "prefills the op attends masked (the streaming heads' far keys hidden by "
                                     "one bias for every layer); off: neither (default: on for elastic "
                                     "decoders; docs/benchmarking.md#short-calls)",
                    variants=("sparse",)),
             Option("--softmax-floor", "on (default) raises every masked attention score to its row's largest "
                                       "minus 80 before the Softmax, so ONNX Runtime's exp never makes subnormal "
                                       "floats, which are slow on some CPUs; off leaves it out, for a CPU where "
                                       "they are not (adaptex bench says which; "
                                       "docs/benchmarking.md#the-softmax-floor)"))))
