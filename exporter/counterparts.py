"""The dense graphs an adaptive artifact is timed against, built from the same weights.

The yardstick is the fastest dense graph a user could ship for these weights, so bench builds
several and times them all (runtimes/bench.py):

- `dense`: the model with no routing at all (every head, every token, full attention; its
  contract's `dense` counterpart mode), by today's stock exporter (`torch.onnx.export(dynamo=True)`,
  its optimiser on);
- `dense-legacy`: the same module by the TorchScript exporter (`dynamo=False`), whose graphs ONNX
  Runtime's fusions were written against;
- `original`, `original-legacy`: where the model wraps a pretrained checkpoint, that checkpoint's
  own `transformers` module (plus the model's pooling) by both exporters;
- `+ortopt`: each of those through `onnxruntime.transformers.optimizer.optimize_model`, kept where it
  fused something (SkipLayerNormalization, BiasGelu, Attention, ...); `+ortopt+rows` the same with its
  SkipLayerNormalization fusions off and adaptex's artifact passes after (fused attention and the
  faster Add + LayerNormalization together; a large batch's attention a sample at a time; a masked
  Softmax kept off subnormal floats); `dense+rows` those passes on `dense` alone;
- `+rows-batched`: each `+rows` candidate without attention_by_sample's If (every call's attention
  batched), built where that pass rewrites something: an artifact's programs for calls below its
  threshold leave the If out of their op bodies, so a dense graph may leave it out too;
- `naive`: the model's plain inference path (the decisions taken, everything computed and the
  skipped work masked: what a stock exporter makes of the model without adaptex). Not a yardstick:
  it is what adaptex replaces.

Exports are cached per weights (their hash), library versions and a hash of the graphs and exporter
sources, so a sweep or a second bench of the same checkpoint does not export again, and a change to
the code that makes them does.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

# what ONNX Runtime's transformer optimizer reports; these mean it fused something the session's own
# optimisations would not (LayerNormalization alone the session fuses by itself)
_FUSIONS = ("EmbedLayerNormalization", "Attention", "MultiHeadAttention", "Gelu", "FastGelu", "BiasGelu",
            "GemmFastGelu", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "RotaryEmbedding",
            "GroupQueryAttention")


@dataclass
class Graph:
    """One graph bench times: its name, file (None: not built, and why), how it was made, and
    whether it is a dense candidate for the yardstick."""
    name: str
    path: str | None
    how: str
    reason: str | None = None
    dense: bool = True


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


@contextlib.contextmanager
def _quiet():
    """Exporters and the ORT optimizer print progress and warnings; bench prints its own."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # the optimizer's modules log under their bare names
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _export_both(module, example, dynamic_shapes, input_names, output_names, stem: Path,
                 names: tuple[str, str], how: str, legacy_module=None, legacy_how: str = "") -> tuple[list[Graph], object]:
    """`module` by the dynamo exporter and by the legacy one (`legacy_module` if given); the axes the
    legacy export marks dynamic are the ones torch.export found (by input name)."""
    import torch

    out, ep = [], None
    dyn_name, legacy_name = names
    path = stem.parent / f"{dyn_name}.onnx"
    try:
        with torch.no_grad(), _quiet():
            ep = torch.export.export(module, example, dynamic_shapes=dynamic_shapes)
            prog = torch.onnx.export(ep, (), dynamo=True, optimize=True, verbose=False,
                                     input_names=input_names, output_names=output_names)
        prog.save(str(path))
        out.append(Graph(dyn_name, str(path), f"{how}, torch.onnx.export(dynamo=True)"))
    except Exception as e:
        out.append(Graph(dyn_name, None, f"{how}, torch.onnx.export(dynamo=True)",
                         reason=f"stock export failed: {_first_line(e)}"))
    path = stem.parent / f"{legacy_name}.onnx"
    how_legacy = f"{legacy_how or how}, torch.onnx.export(dynamo=False, opset 17)"
    try:
        axes = _dynamic_axes(ep, example, input_names) if ep is not None else {}
        with torch.no_grad(), _quiet():
            torch.onnx.export(legacy_module or module, example, str(path), dynamo=False, opset_version=17,
                              input_names=input_names, output_names=output_names, dynamic_axes=axes)
        out.append(Graph(legacy_name, str(path), how_legacy))
    except Exception as e:
        out.append(Graph(legacy_name, None, how_legacy, reason=f"legacy export failed: {_first_line(e)}"))
    return out, ep


def _dynamic_axes(ep, example, input_names) -> dict:
    """{input name: {axis: name}} for every axis torch.export left symbolic."""
    import torch

    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user = [nodes[n].meta["val"] for n in ep.graph_signature.user_inputs]
    axes = {}
    for name, val in zip(input_names, user):
        dyn = {a: str(s.node.expr) for a, s in enumerate(val.shape)
               if isinstance(s, torch.SymInt) and not s.node.expr.is_number}
        if dyn:
            axes[name] = dyn
    return axes


def _rows_name_how(base: str, how: str, batched: bool, floor: bool = True) -> tuple[str, str]:
    """The name and description of a `+rows` candidate (adaptex's artifact passes on `base`);
    batched: without attention_by_sample's If (`+rows-batched`); floor: with softmax_floor (where
    it pays on the bench's CPU, runtimes/cpu.py)."""
    floored = " and softmax_floor" if floor else ""
    if batched:
        return f"{base}+rows-batched", (f"{how}adaptex's layernorm_rows{floored} passes (attention "
                                        "batched at every size: no attention_by_sample If)")
    return f"{base}+rows", f"{how}adaptex's layernorm_rows, attention_by_sample{floored} passes"


def _no_batched_twin(proto, policy=None) -> str | None:
    """Why a `+rows-batched` candidate of `proto` (a ModelProto, left as it is) would be its `+rows`
    twin (None: it differs): a graph with no attention for attention_by_sample to rewrite (ONNX
    Runtime's optimizer may have fused it into one kernel)."""
    import onnx

    from adaptex.exporter.targets.onnx.passes_by_sample import attention_by_sample

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    if attention_by_sample(copy, *([policy] if policy else [])):
        return None
    return "no batched attention for attention_by_sample to rewrite: the same graph as +rows"


def _ort_optimized(graph: Graph, model_type: str, num_heads: int, hidden: int, rows: bool = False,
                   batched: bool = False, floor: bool = True, policy=None) -> Graph:
    """`graph` through ORT's transformer optimizer: kept when it fused something. rows: with its
    SkipLayerNormalization fusions off and adaptex's rows pass after (`+ortopt+rows`), so that the
    yardstick can have both the optimizer's fused attention and the faster Add + LayerNormalization
    (on ONNX Runtime's CPU a SkipLayerNormalization costs several times the pair it replaces);
    batched, with rows: without the attention_by_sample If (`+ortopt+rows-batched`); floor, with rows:
    with softmax_floor."""
    opt_how = f"{graph.how}, then onnxruntime.transformers optimize_model(model_type={model_type!r}"
    if rows:
        name, how = _rows_name_how(f"{graph.name}+ortopt", f"{opt_how}, SkipLayerNormalization fusion off) and ",
                                   batched, floor)
    else:
        name, how = f"{graph.name}+ortopt", f"{opt_how})"
    if graph.path is None:
        return Graph(name, None, how, reason=f"no {graph.name} graph to optimise")
    try:
        import onnx
        from onnxruntime.transformers.fusion_options import FusionOptions
        from onnxruntime.transformers.optimizer import optimize_model

        from adaptex.exporter.targets.onnx.passes import artifact_passes

        options = FusionOptions(model_type)
        if rows:
            options.enable_skip_layer_norm = options.enable_bias_skip_layer_norm = False
        with _quiet(), contextlib.redirect_stderr(io.StringIO()):
            opt = optimize_model(graph.path, model_type=model_type, num_heads=num_heads, hidden_size=hidden,
                                 optimization_options=options)
            fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if k in _FUSIONS and v}
        if not fused:
            return Graph(name, None, how, reason="ORT's transformer optimizer fused nothing in this graph")
        path = Path(graph.path).with_name(f"{name}.onnx")
        if rows:
            twin = _no_batched_twin(opt.model, policy) if batched else None
            if twin:
                return Graph(name, None, how, reason=twin)
            if not artifact_passes(opt.model, by_sample=not batched, floor=floor, policy=policy):
                return Graph(name, None, how,
                             reason="no residual LayerNormalization, batched attention or Softmax to rewrite")
            onnx.save(opt.model, str(path))
        else:
            opt.save_model_to_file(str(path))
        return Graph(name, str(path), how + " fused " + ", ".join(f"{v} {k}" for k, v in sorted(fused.items())))
    except Exception as e:
        return Graph(name, None, how, reason=f"ORT's transformer optimizer failed: {_first_line(e)}")


def _rows(graph: Graph, batched: bool = False, floor: bool = True, policy=None) -> Graph:
    """`graph` with the passes adaptex's ONNX artifacts get (passes.artifact_passes): the yardstick
    gets every trick the artifact gets. batched: without attention_by_sample's If, as the programs
    of an artifact that serve calls below its threshold run their op bodies (`+rows-batched`);
    floor: with softmax_floor; policy: ONNX Runtime's thresholds (graphs/ops/policy.py)."""
    import onnx

    from adaptex.exporter.targets.onnx.passes import artifact_passes

    name, how = _rows_name_how(graph.name, f"{graph.how}, then ", batched, floor)
    if graph.path is None:
        return Graph(name, None, how, reason=f"no {graph.name} graph")
    proto = onnx.load(graph.path)
    twin = _no_batched_twin(proto, policy) if batched else None
    if twin:
        return Graph(name, None, how, reason=twin)
    if not artifact_passes(proto, by_sample=not batched, floor=floor, policy=policy):
        return Graph(name, None, how, reason="no residual LayerNormalization, batched attention or Softmax to rewrite")
    path = Path(graph.path).with_name(f"{name}.onnx")
    onnx.save(proto, str(path))
    return Graph(name, str(path), how)


def _heads_hidden(contract) -> tuple[int, int]:
    cfg = contract.cfg
    heads = getattr(cfg, "num_heads", 0) or 0
    hidden = getattr(cfg, "d_model", 0) or (heads * getattr(cfg, "head_dim", 0))
    return int(heads), int(hidden or 0)


def onnx_candidates(model, contract, workdir: Path, say=None, floor: bool = True, policy=None) -> list[Graph]:
    """Every dense candidate and the naive export, as ONNX files in `workdir`; floor: the `+rows`
    candidates with softmax_floor (what the CPU that times them wants: runtimes/cpu.py)."""
    say = say or (lambda msg: None)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mode = contract.counterpart_modes["dense"]
    say("exporting the dense graph (dynamo and legacy exporters) ...")
    graphs, _ = _export_both(contract.wrapper(model, mode), contract.example_inputs(mode),
                             contract.dynamic_shapes(mode), contract.input_names(mode), contract.output_names(mode),
                             workdir / "dense", ("dense", "dense-legacy"),
                             "the model with every head, token and position computed")
    try:
        original = contract.original(model)
    except Exception as e:
        original = None
        graphs.append(Graph("original", None, "the pretrained checkpoint's own module",
                            reason=f"not built: {_first_line(e)}"))
    if original is not None:
        say(f"exporting the original model ({original.source}) ...")
        more, _ = _export_both(original.module, original.example, original.dynamic_shapes, original.input_names,
                               original.output_names, workdir / "original", ("original", "original-legacy"),
                               original.source, original.legacy_module, original.legacy_source)
        graphs += more
    graphs += [_rows(graphs[0], floor=floor, policy=policy), _rows(graphs[0], batched=True, floor=floor, policy=policy)]
    model_type = getattr(contract, "ort_model_type", None)
    if model_type:
        say("applying ONNX Runtime's transformer optimizer ...")
        heads, hidden = _heads_hidden(contract)
        kinds = ((False, False), (True, False), (True, True))  # (rows, batched)
        opt = [_ort_optimized(g, model_type, heads, hidden, rows, batched, floor, policy) for g in graphs
               if g.name in ("dense", "dense-legacy") for rows, batched in kinds]
        if original is not None:
            opt += [_ort_optimized(g, original.model_type, original.num_heads, original.hidden_size, rows, batched,
                                   floor)
                    for g in graphs if g.name in ("original", "original-legacy") for rows, batched in kinds]
        graphs += opt
    naive_mode = contract.counterpart_modes.get("naive")
    if naive_mode:
        say("exporting the naive graph (the model's masked inference path) ...")
        path = workdir / "naive.onnx"
        how = "the model's plain inference path (decisions taken, skipped work masked), torch.onnx.export(dynamo=True)"
        try:
            import torch

            with torch.no_grad(), _quiet():
                ep = torch.export.export(contract.wrapper(model, naive_mode), contract.example_inputs(naive_mode),
                                         dynamic_shapes=contract.dynamic_shapes(naive_mode))
                prog = torch.onnx.export(ep, (), dynamo=True, optimize=True, verbose=False,
                                         input_names=contract.input_names(naive_mode),
                                         output_names=contract.output_names(naive_mode))
            prog.save(str(path))
            graphs.append(Graph("naive", str(path), how, dense=False))
        except Exception as e:
            graphs.append(Graph("naive", None, how, reason=f"stock export failed: {_first_line(e)}", dense=False))
    return graphs


def onnx_counterparts(model, contract, workdir: Path) -> dict[str, tuple[str | None, str | None]]:
    """The stock `dense` and `naive` exports: name -> (path, reason if none)."""
    return {g.name: (g.path, g.reason) for g in onnx_candidates(model, contract, workdir)
            if g.name in ("dense", "naive")}


# --- the cache ---------------------------------------------------------------------------------------

def cache_root() -> Path:
    """$ADAPTEX_CACHE_DIR, else $XDG_CACHE_HOME/adaptex, else ~/.cache/adaptex."""
    if os.environ.get("ADAPTEX_CACHE_DIR"):
        return Path(os.environ["ADAPTEX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "adaptex"


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    """sha256 of the graphs and exporter sources that make the dense graphs (the rows pass, the naive
    graph's lowerings): a cached graph from other code is exported again, whatever the version says."""
    import adaptex.exporter
    import adaptex.graphs

    h = hashlib.sha256()
    for pkg in (adaptex.graphs, adaptex.exporter):
        root = Path(pkg.__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _cache_key(model, contract, kind: str) -> str:
    import onnxruntime
    import torch

    from adaptex.exporter.metadata import state_hash, version

    try:
        cfg = contract.config_dict()
    except Exception:
        cfg = {}
    text = json.dumps({"kind": kind, "family": contract.family, "model": type(model).__name__, "config": cfg,
                       "weights": state_hash(model), "adaptex": version(), "code": _code_hash(),
                       "torch": torch.__version__,
                       "onnxruntime": onnxruntime.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cached_onnx_candidates(model, contract, workdir: Path, say=None, cache: bool = True,
                           floor: bool = True) -> list[Graph]:
    """`onnx_candidates`, from the cache when these weights were exported before by these versions
    (written whole or not at all: a directory swap)."""
    if not cache:
        return onnx_candidates(model, contract, workdir, say, floor)
    from adaptex.graphs import files

    entry = cache_root() / "counterparts" / _cache_key(model, contract, "onnx" if floor else "onnx, no softmax floor")
    graphs = _cached_entry(entry, say)
    if graphs is not None:
        return graphs
    try:
        # one process builds an entry; another that wants it meanwhile waits, then reads it
        with files.exclusive(f"{entry}.lock"):
            graphs = _cached_entry(entry, say)
            if graphs is not None:
                return graphs
            with files.atomic_directory(entry) as new:
                new.mkdir()
                graphs = onnx_candidates(model, contract, new, say, floor)
                rows = [dict(asdict(g), path=Path(g.path).name if g.path else None) for g in graphs]
                (new / "graphs.json").write_text(json.dumps(rows, indent=1))
    except OSError:  # an unwritable cache: export into the bench's own directory
        return onnx_candidates(model, contract, workdir, say, floor)
    for g in graphs:
        if g.path is not None:
            g.path = str(entry / Path(g.path).name)
    return graphs


def _cached_entry(entry: Path, say=None) -> list[Graph] | None:
    """The graphs of a whole cache entry, or None (missing or damaged: build it again)."""
    manifest = entry / "graphs.json"
    if not manifest.is_file():
        return None
    try:
        graphs = [Graph(**g) for g in json.loads(manifest.read_text())]
        for g in graphs:
            if g.path is not None:
                g.path = str(entry / g.path)
                if not Path(g.path).is_file():
                    raise FileNotFoundError(g.path)
    except (OSError, TypeError, ValueError):
        return None
    (say or (lambda m: None))(f"dense graphs from the cache ({entry})")
    return graphs


def coreml_counterparts(model, contract, workdir: Path, precision: str, min_target: str) -> dict:
    """Each counterpart as a Core ML package by stock coremltools: name -> (path, reason if none)."""
    from adaptex.exporter.targets.coreml.convert import export_stock

    out = {}
    for name, mode in contract.counterpart_modes.items():
        try:
            out[name] = (str(export_stock(model, contract, Path(workdir) / f"{name}.mlpackage", mode,
                                          prec=precision, min_target=min_target)), None)
        except Exception as e:
            out[name] = (None, f"stock coremltools conversion failed: {_first_line(e)}")
    return out
