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
from pathlib import Path

import onnx

from adaptex.exporter import metadata
from adaptex.exporter.errors import ExportError
from adaptex.exporter.registry import lookup
from adaptex.exporter.targets import Option, Target, register_target
from adaptex.exporter.targets.onnx import dispatch
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.onnx import guards, passes, passes_by_sample
from adaptex.exporter.targets.onnx.lowerings import LoweringContext
from adaptex.exporter.trace import adaptex_nodes, io_specs, op_name, trace
from adaptex.graphs.errors import AdaptexError
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy

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
          decode_graph: bool = False, by_sample: bool = True, floor: bool = True, ops_by_sample: bool = True,
          policy: OrtPolicy = DEFAULT) -> tuple[onnx.ModelProto, dict, dict, dict]:
    """Trace `model` (or take `ep`, trace_for's program) and lower it to an ONNX ModelProto with
    `target`'s lowerings (the TensorRT target hands its engine builder ONNX too); returns (proto,
    lowering per op, inputs, outputs). step: the decode-step program, lowered with the ops' step
    bodies where they have one (its inputs and outputs are the general graph's, at one new token);
    short: the short-call program (no adaptex call: dense attention and the routers); masked, with
    short: the masked short-call program (the streaming heads' keys beyond their reach masked);
    decode_graph: the general program of an artifact that holds the step program too. by_sample:
    False leaves out the main graph's attention-by-sample If (passes.attention_by_sample), for a
    graph whose calls are known to stay below its threshold; ops_by_sample=False does the same in
    the ops' bodies (their own attention-by-sample Ifs). policy: ONNX Runtime's thresholds, which
    the ops' bodies and the passes read (graphs/ops/policy.py). floor: False leaves out
    passes.softmax_floor, for a graph that serves only small calls (a step graph never has it:
    three kernels more a layer, where a step's one query row has nothing masked to speed up)."""
    ep = ep if ep is not None else trace_for(model, contract, target, step=step, short=short, masked=masked,
                                             decode_graph=decode_graph)
    inputs, outputs = io_specs(ep, contract)
    ctx = LoweringContext(target, variant, precision, fx.ONNX_OPSET, step=step, decode_graph=decode_graph,
                          by_sample=ops_by_sample, policy=policy)
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
        passes.artifact_passes(proto, by_sample=by_sample, floor=floor, policy=policy)
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


def _may_run_by_sample(contract, rows: int, policy: OrtPolicy, keys: int | None = None) -> bool:
    """Whether a call of at most `rows` token rows over at most `keys` keys (default: the model's
    longest sequence) may reach attention_by_sample's threshold: its scores (B H T S) are at most
    rows x heads x keys. Unknown sizes: True."""
    heads, longest = getattr(contract.cfg, "num_heads", None), keys or contract.max_sequence
    return not (heads and longest) or rows * heads * longest >= policy.by_sample_from


def policy_option(value) -> OrtPolicy:
    """The policy option as an OrtPolicy: one given, None for OrtPolicy(), or (the CLI's --policy) the
    path of a JSON object of its fields."""
    if value is None:
        return DEFAULT
    if isinstance(value, OrtPolicy):
        return value
    if isinstance(value, (str, Path)):
        try:
            data = json.loads(Path(value).read_text())
        except (OSError, ValueError) as e:
            raise ExportError(f"--policy {value}: not a readable JSON file ({str(e).splitlines()[0]}); give a JSON "
                              "object of graphs/ops/policy.py's fields, e.g. {\"by_sample_from\": 2097152}") from None
        try:
            return OrtPolicy.from_dict(data, f"--policy {value}")
        except AdaptexError as e:
            raise ExportError(str(e)) from None
    raise ExportError(f"policy: an OrtPolicy (adaptex.graphs.ops.policy) or a JSON file, got {type(value).__name__}")


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


def softmax_floor_option(value) -> tuple[bool, str]:
    """The softmax_floor option as (on, why): "on" or "off" (or a bool) as given; {"on": bool, "why":
    text}, the choice adaptex.export measured on this CPU (runtimes/cpu.py, floor_probe); None, on."""
    if isinstance(value, dict):
        if set(value) != {"on", "why"} or not isinstance(value["on"], bool) or not isinstance(value["why"], str):
            raise ExportError("softmax_floor: give on, off, or {'on': bool, 'why': text}")
        return value["on"], value["why"]
    on = _on_off(value, "--softmax-floor", True)
    return on, "the default (on)" if value is None else f"--softmax-floor {'on' if on else 'off'} given"


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
           softmax_floor=None, policy: OrtPolicy | None = None) -> dict:
    """Export to `out` atomically; returns the artifact metadata. dense_rows=N: one graph holding
    the sparse and the dense lowering, running the dense one for calls of at most N token rows
    (dispatch.py). decode_graph (decoders): one graph more, traced for a decode step, which runs
    the calls of one new token after a non-empty cache (dispatch.merge_decode_step). short_graph
    (elastic decoders): one graph more, traced for prefills within the streaming heads' reach (at
    most sink + window tokens, no cache), which runs those calls (dispatch.merge_short_call), and
    where the model has one (contract.masked_call_keys(), masked_call_excess()) its masked form for
    the prefills a little longer. softmax_floor (default on): passes.softmax_floor in every graph but
    the decode-step ones; off for a CPU whose Softmax takes masked scores at full speed
    (docs/benchmarking.md#the-softmax-floor). policy: ONNX Runtime's thresholds (graphs/ops/policy.py;
    default OrtPolicy()), stored in the metadata with the guards of the programs (guards.py)."""
    policy = policy_option(policy)
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
    floor, floor_why = softmax_floor_option(softmax_floor)
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
        and _may_run_by_sample(contract, policy.large_call_batch * longest, policy)
    lowered = dict(variant=variant, precision=precision, policy=policy)
    proto, notes, inputs, outputs = lower(model, contract, ep=ep, decode_graph=step, ops_by_sample=not split,
                                          by_sample=not contract.decoder or rows is not None, floor=floor, **lowered)
    names = contract.input_names()
    # the decision list, outermost If first: a call runs the first program whose guard holds
    programs = [{"name": "general", "guard": None, "variant": variant}]

    def on_top(name: str, guard, **entry) -> None:
        programs.insert(0, {"name": name, "guard": guard.to_dict(), "variant": variant, **entry})

    routed = None
    if split:
        big, _, _, _ = lower(model, contract, ep=ep, by_sample=True, floor=floor, **lowered)
        if passes_by_sample.attends_by_sample(big):
            say("the graph for large calls too (attention a sample at a time) ...")
            guard = guards.large_call(names[0], names[1], heads, policy.by_sample_from)
            proto = dispatch.merge_large_call(big, proto, guard=guard, domain=fx.DOMAIN, policy=policy)
            on_top("large-call (attention by sample)", guard)
    if rows is not None:
        say(f"lowering the dense variant too, for calls of at most {rows} token rows ...")
        dense_by_sample = _may_run_by_sample(contract, rows, policy)
        dense_proto, dense_notes, _, _ = lower(model, contract, variant="dense", precision=precision, ep=ep,
                                               by_sample=dense_by_sample, floor=floor, policy=policy)
        guard = guards.rows_at_most(names[0], rows)
        proto = dispatch.merge(proto, dense_proto, guard=guard, domain=fx.DOMAIN, policy=policy)
        on_top("dense", guard, variant="dense")
        routed = {"dense_rows": rows, "rows_input": names[0], "dense_lowerings": dense_notes}
        if contract.decoder:
            # its decode steps take the dense lowering without softmax_floor, whose three kernels a
            # layer only cost a step; its short prompts keep the floor (a causal mask's scores)
            say("lowering the dense variant for decode steps too (no softmax floor) ...")
            step_proto, _, _, _ = lower(model, contract, variant="dense", precision=precision, ep=ep,
                                        by_sample=dense_by_sample, floor=False, policy=policy)
            guard = guards.AllOf((guards.one_new_token(names[0]), guard))
            proto = dispatch.merge_dense_step(step_proto, proto, guard=guard, domain=fx.DOMAIN, policy=policy)
            on_top("dense decode-step", guard, variant="dense")
    if short:
        keys, longer = contract.short_call_keys(), contract.masked_call_keys(policy)
        keys_input, cache_input = names[1], names[2]
        prefill = guards.no_cache(cache_input)
        # short calls: an attention-by-sample If would only cost (by_sample=False)
        if longer is not None:  # the inner If: prefills up to `longer` tokens, the masked program
            say(f"tracing and lowering the masked short-call graph too (prefills of {keys + 1} to {longer} "
                "tokens, and longer ones where masking adds few scores) ...")
            masked_ep = trace_for(model, contract, short=True, masked=True, decode_graph=step)
            masked_proto, _, _, _ = lower(model, contract, ep=masked_ep, short=True, masked=True, decode_graph=step,
                                          by_sample=False, floor=floor, **lowered)
            excess = contract.masked_call_excess(policy)  # longer prefills too, where masking adds few scores

            def masked_guard(batch: bool):
                few = guards.keys_at_most(keys_input, longer)
                if excess is not None:
                    few = guards.AnyOf((few, guards.excess_at_most(keys_input, **excess, batch=batch)))
                return guards.AllOf((few, prefill))
            guard = masked_guard(True)
            proto = dispatch.merge_short_call(masked_proto, proto, guard=guard, tag="masked", domain=fx.DOMAIN,
                                              policy=policy)
            on_top("masked short-call", guard, masked=True)
            if isinstance(heads, int) and heads > 0 \
                    and _may_run_by_sample(contract, policy.large_call_batch * longer, policy, longer):
                # its large batches a sample at a time (the bias planes gathered in the Loop), behind an If
                # of their own: the masked program's smaller calls pay no If a layer
                big, _, _, _ = lower(model, contract, ep=masked_ep, short=True, masked=True, decode_graph=step,
                                     by_sample=True, floor=floor, **lowered)
                if passes_by_sample.by_sample_ifs(big.graph.node):
                    say("the masked short-call graph for large batches too (attention a sample at a time) ...")
                    # where it attends a sample at a time, a sample's excess scores count
                    guard = guards.AllOf((masked_guard(False),
                                          guards.large_call(keys_input, keys_input, heads, policy.by_sample_from)))
                    proto = dispatch.merge_short_call(big, proto, guard=guard, tag="masked_large", domain=fx.DOMAIN,
                                                      policy=policy)
                    on_top("masked short-call (attention by sample)", guard, masked=True)
        say(f"tracing and lowering the short-call graph too (prefills of at most {keys} tokens) ...")
        short_proto, _, _, _ = lower(model, contract, short=True, decode_graph=step, by_sample=False, floor=floor,
                                     **lowered)
        guard = guards.AllOf((guards.keys_at_most(keys_input, keys), prefill))
        proto = dispatch.merge_short_call(short_proto, proto, guard=guard, tag="short", domain=fx.DOMAIN,
                                          policy=policy)
        on_top("short-call", guard)
    if step:
        say("tracing and lowering the decode-step graph too (one new token after a non-empty cache) ...")
        step_ep = trace_for(model, contract, step=True)
        step_proto, step_notes, _, _ = lower(model, contract, ep=step_ep, step=True, **lowered)
        guard = guards.decode_step(names[0], names[2])
        proto = dispatch.merge_decode_step(step_proto, proto, guard=guard, domain=fx.DOMAIN, policy=policy)
        on_top("decode-step", guard, lowerings=step_notes)
    meta = metadata.build(contract, target="onnx", variant=variant, precision=precision, lowerings=notes,
                          inputs=inputs, outputs=outputs, source=source,
                          opset={"adaptex": fx.OPSET_VERSION, "onnx": fx.ONNX_OPSET},
                          tokenizer=tokenizer, dispatch=routed, programs=programs if len(programs) > 1 else None,
                          policy=policy.to_dict(), softmax_floor=floor, softmax_floor_why=floor_why)
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
             Option("--policy", "a JSON file of ONNX Runtime thresholds by which the op bodies and the "
                                "programs choose their paths (the fields of adaptex.graphs.ops.policy.OrtPolicy; "
                                "those not given keep their defaults); stored in the artifact's metadata"),
             Option("--softmax-floor", "on raises every masked attention score to its row's largest minus 80 "
                                       "before the Softmax, so ONNX Runtime's exp never makes subnormal floats, "
                                       "which are slow on some CPUs; off leaves it out, for a CPU where they are "
                                       "not (default: whichever a causal Softmax timed plain and floored on this "
                                       "CPU at export runs faster; adaptex inspect says which and why)"))))
