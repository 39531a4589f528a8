"""Artifact metadata, built and validated in one place, and atomic writes.

Every artifact carries its own metadata under the key `adaptex` (ONNX metadata_props, Core ML
user-defined metadata, a TensorRT engine's `<plan>.json`), as one JSON object: the adaptex
version, family (or `custom` for a model of your own), target, variant, precision, op-set, the
lowering of each op, the routing parameters, the config, the source's hashes, every input and
output (dtype, named dynamic axes, description), and every decision (its kind and the layer that
takes it). Metadata is data: it is parsed and checked against `SCHEMA`, never evaluated.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from importlib import metadata as _pkg
from pathlib import Path
from typing import Iterator

from adaptex.exporter.errors import ExportError
from adaptex.graphs import files
from adaptex.graphs.errors import AdaptexError

META_KEY = "adaptex"
FORMAT_VERSION = 2


def version() -> str:
    """The installed adaptex version (what artifacts record)."""
    try:
        return _pkg.version("adaptex")
    except _pkg.PackageNotFoundError:
        return "0+source"


# --- building --------------------------------------------------------------------------------------

def build(contract, *, target: str, variant: str, precision: str, lowerings: dict, inputs: dict, outputs: dict,
          source: dict, opset: dict, **extra) -> dict:
    """The metadata of an artifact of `contract`'s model (graphs.family.Contract)."""
    describe = contract.io_descriptions()
    for name, spec in list(inputs.items()) + list(outputs.items()):
        spec.setdefault("description", describe.get(name, ""))
    meta = {
        "format": FORMAT_VERSION, "adaptex": version(), "family": contract.family, "target": target,
        "variant": variant, "precision": precision, "opset": opset, "lowerings": lowerings,
        **contract.routing_meta(), "config": contract.config_dict(), "source": source,
        "inputs": inputs, "outputs": outputs,
        "decisions": {d.name: {"kind": d.kind, "layer": d.path, "field": d.field} for d in contract.decisions()},
        "decoder": contract.decoder,
    }
    if contract.max_sequence:
        meta["max_sequence"] = contract.max_sequence
    if hasattr(contract, "to_meta"):
        meta.update(contract.to_meta())
    meta.update({k: v for k, v in extra.items() if v is not None})
    validate(meta, "the exported model")
    return meta


def source_of(model, info: dict | None) -> dict:
    """What an artifact records of its source: a checkpoint's name and the hashes of its weights and
    config, or a model of your own's class and the hash of its state dict."""
    if info:
        return {"checkpoint": info.get("name") or info.get("path"), "sha256": info.get("sha256"),
                "config_sha256": info.get("config_sha256")}
    return {"model": type(model).__name__, "state_sha256": state_hash(model)}


def state_hash(model) -> str:
    """sha256 over a module's state dict (names, dtypes, shapes and bytes), in key order."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- validation --------------------------------------------------------------------------------------

# key -> (type(s), required): what every artifact's metadata holds
SCHEMA = {
    "format": (int, True), "family": (str, True), "target": (str, True), "variant": (str, True),
    "precision": (str, True), "inputs": (dict, True), "outputs": (dict, True), "source": (dict, True),
    "config": (dict, False), "lowerings": (dict, False), "opset": (dict, False), "decisions": (dict, False),
    "max_sequence": (int, False), "adaptex": (str, False), "tokenizer": (dict, False), "decoder": (bool, False),
    "tensorrt": (dict, False), "dispatch": (dict, False), "programs": (list, False), "policy": (dict, False),
    "softmax_floor": (bool, False), "softmax_floor_why": (str, False),
    "quantize": (dict, False),
    "model": (str, False), "call": (dict, False),
}


# key -> the values it may take (a schema enum: a precision adaptex has no tolerance for is no precision)
ENUMS = {"variant": ("sparse", "dense"), "precision": ("fp32", "fp16", "bf16")}
SHOWN = 60  # characters of a metadata value an error message quotes


def shown(value) -> str:
    """A metadata value for an error message: quoted, and cut short when long (a 200 KB string is not
    echoed whole)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def validate(meta, where) -> dict:
    """Check metadata against SCHEMA (types of the known keys, each I/O entry's dtype and shape);
    a one-line AdaptexError names the first problem."""
    if not isinstance(meta, dict):
        raise AdaptexError(f"{where}: its adaptex metadata is a {type(meta).__name__}, not an object; re-export it")
    for key, (kind, required) in SCHEMA.items():
        if key not in meta:
            if required:
                raise AdaptexError(f"{where}: its adaptex metadata has no {key!r}; re-export it with adaptex")
            continue
        if not isinstance(meta[key], kind) or (kind is int and isinstance(meta[key], bool)):
            raise AdaptexError(f"{where}: metadata {key!r} is a {type(meta[key]).__name__}, expected "
                               f"{kind.__name__}; re-export it with adaptex")
    from adaptex.exporter import targets  # the registered targets (built in, and any a user registers)

    for key, allowed in {"target": tuple(targets.names()), **ENUMS}.items():
        if meta[key] not in allowed:
            raise AdaptexError(f"{where}: metadata {key!r} is {shown(meta[key])}, not one of {', '.join(allowed)}; "
                               "re-export it with adaptex")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", meta["family"]):
        raise AdaptexError(f"{where}: metadata 'family' is {shown(meta['family'])}, not a family name (letters, "
                           "digits, '_', '.', '-'; at most 64); re-export it with adaptex")
    if "max_sequence" in meta and meta["max_sequence"] < 1:
        raise AdaptexError(f"{where}: metadata 'max_sequence' is {meta['max_sequence']}, not a length (at least 1); "
                           "re-export it with adaptex")
    if not all(len(k) <= 200 for side in ("inputs", "outputs") for k in meta[side]):
        raise AdaptexError(f"{where}: metadata names an input or output of over 200 characters; re-export it with "
                           "adaptex")
    routed = meta.get("dispatch")
    if routed is not None:
        rows = routed.get("dense_rows")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1 \
                or not (isinstance(routed.get("rows_input"), str) and routed["rows_input"] in meta["inputs"]):
            raise AdaptexError(f"{where}: metadata 'dispatch' needs dense_rows (a whole number >= 1) and rows_input "
                               "(an input name); re-export it with adaptex")
    if "programs" in meta:  # each program's guard, checked as data (never evaluated as code)
        from adaptex.exporter.targets.onnx.guards import read_programs

        for name, guard in read_programs(meta, where):
            unknown = sorted(guard.inputs() - set(meta["inputs"])) if guard is not None else []
            if unknown:
                raise AdaptexError(f"{where}: metadata program {name!r} reads {unknown[0]!r}, not an input; re-export "
                                   "it with adaptex")
    if "policy" in meta:
        from adaptex.graphs.ops.policy import OrtPolicy

        OrtPolicy.from_dict(meta["policy"], f"{where}: metadata 'policy'")
    for side in ("inputs", "outputs"):
        for name, spec in meta[side].items():
            if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str) \
                    or not isinstance(spec.get("shape"), list) \
                    or not all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in spec["shape"]):
                raise AdaptexError(f"{where}: metadata {side}[{name!r}] needs a dtype string and a shape list of "
                                   "sizes and axis names; re-export it with adaptex")
    return meta


def parse(text: str, where) -> dict:
    """Metadata from its JSON text, validated; never evaluated."""
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise AdaptexError(f"{where}: its adaptex metadata is not valid JSON ({e.msg if hasattr(e, 'msg') else e}); "
                           "re-export it with adaptex") from None
    return validate(meta, where)


# --- reading ------------------------------------------------------------------------------------------

def read_onnx_metadata(path: str | os.PathLike) -> dict:
    """The adaptex metadata of an ONNX artifact (without loading its weights)."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise AdaptexError(f"{path}: no such artifact; export one with 'adaptex export -o {path}'")
    if path.stat().st_size == 0:
        raise AdaptexError(f"{path}: is empty (0 bytes), not an ONNX model; re-export it")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise AdaptexError(f"{path}: not a readable ONNX model ({type(e).__name__}); re-export it") from None
    if not model.HasField("graph"):  # a few bytes can parse as an empty ModelProto
        raise AdaptexError(f"{path}: not an ONNX model (no graph); re-export it")
    props = {p.key: p.value for p in model.metadata_props}
    if META_KEY not in props:
        raise AdaptexError(f"{path}: an ONNX model that has no adaptex metadata, so it was not written by "
                           "'adaptex export'; export the model with adaptex first")
    meta = parse(props[META_KEY], path)
    check_onnx_io(model.graph, meta, path)
    return meta


def _onnx_io(values, skip=()) -> dict[str, tuple[str, int]]:
    """{name: (numpy dtype name, rank)} of a graph's inputs or outputs."""
    from onnx import helper

    out = {}
    for v in values:
        if v.name in skip:
            continue
        t = v.type.tensor_type
        try:
            dtype = helper.tensor_dtype_to_np_dtype(t.elem_type).name
        except (KeyError, ValueError, TypeError):
            dtype = f"elem_type {t.elem_type}"
        out[v.name] = (dtype, len(t.shape.dim) if t.HasField("shape") else -1)
    return out


def check_onnx_io(graph, meta: dict, where) -> None:
    """Refuse metadata that does not describe the graph it rides on (adaptex metadata copied onto
    another model): every input and output by name, dtype and rank, before any run."""
    got = {"inputs": _onnx_io(graph.input, {i.name for i in graph.initializer}), "outputs": _onnx_io(graph.output)}
    for side in ("inputs", "outputs"):
        want = meta[side]
        if set(got[side]) != set(want):
            missing, extra = sorted(set(want) - set(got[side])), sorted(set(got[side]) - set(want))
            raise AdaptexError(f"{where}: its adaptex metadata does not describe this graph: the metadata's {side} "
                               f"{missing[:3]} are not the graph's, the graph's {extra[:3]} are not in the metadata "
                               "(metadata copied from another model?); re-export the model with adaptex")
        for name, (dtype, rank) in got[side].items():
            spec = want[name]
            if dtype != spec["dtype"] or rank not in (-1, len(spec["shape"])):
                raise AdaptexError(f"{where}: its adaptex metadata does not describe this graph: {side[:-1]} "
                                   f"{name!r} is {dtype} of rank {rank} in the graph, {spec['dtype']} of rank "
                                   f"{len(spec['shape'])} in the metadata; re-export the model with adaptex")


def format_metadata(meta: dict) -> str:
    lines = []
    order = ["family", "target", "variant", "precision", "adaptex", "opset", "source", "budget_range", "config",
             "inputs", "outputs", "decisions"]
    for key in order + sorted(set(meta) - set(order)):
        if key not in meta:
            continue
        val = meta[key]
        if key in ("inputs", "outputs"):
            lines.append(f"{key}:")
            for name, spec in val.items():
                lines.append(f"  {name:<30} {spec['dtype']:<8} {spec['shape']}")
        elif key == "decisions":
            lines.append(f"{key}:")
            for name, spec in val.items():
                lines.append(f"  {name:<30} {spec['kind']:<10} {spec['layer']}")
        elif key == "programs":  # the decision list: a call runs the first program whose guard holds
            lines.append(f"{key}:")
            for p in val:
                lines.append(f"  {p['name']:<40} {json.dumps(p['guard']) if p['guard'] else 'every other call'}")
        elif key == "softmax_floor":
            lines.append(f"{key}: {'on' if val else 'off'}" + (f" ({meta['softmax_floor_why']})"
                                                               if meta.get("softmax_floor_why") else ""))
        elif key == "softmax_floor_why":
            continue
        elif key == "tokenizer" and isinstance(val, dict):
            lines.append(f"{key}: {val.get('kind') or val.get('type', 'included')} ({len(json.dumps(val))} bytes)")
        elif isinstance(val, dict):
            lines.append(f"{key}:")
            for k, v in val.items():
                lines.append(f"  {k:<20} {v}")
        else:
            lines.append(f"{key}: {val}")
    return "\n".join(lines)


# --- writing -----------------------------------------------------------------------------------------

def check_writable(out: str | os.PathLike, is_ours=None) -> Path:
    """Fail before any work if `out` cannot be written, naming the fix. An existing `out` is replaced
    only when `is_ours(out)` says it is an adaptex artifact."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir() and out.suffix != ".mlpackage":
        raise ExportError(f"{out}: is a directory; pass a file path such as {out / 'model.onnx'}")
    if not parent.exists():
        try:  # like mkdir -p (train's -o does the same)
            parent.mkdir(parents=True)
        except OSError as e:
            raise ExportError(f"{out}: cannot create directory {parent} ({e.strerror or e}); create it or choose "
                              "another -o") from None
    if not parent.is_dir():
        raise ExportError(f"{out}: {parent} is not a directory; choose another -o")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"{out}: directory {parent} is not writable; choose another -o")
    if out.exists() and is_ours is not None and not is_ours(out):
        raise ExportError(f"{out}: exists and is not an adaptex artifact; choose a new -o (adaptex only replaces "
                          "artifacts it wrote)")
    if out.is_file() and not os.access(out, os.W_OK):
        raise ExportError(f"{out}: exists and is read-only; make it writable or choose another -o")
    return out


def _cleanup_stale(parent: Path, name: str) -> None:
    """Remove what an interrupted (killed) write of `name` left behind in `parent`."""
    files.sweep(parent, f".{name}.{files.TAG}-*")


@contextlib.contextmanager
def atomic_path(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `out`; rename it onto `out` only if the block succeeds."""
    out = check_writable(out)
    parent = out.parent if str(out.parent) else Path(".")
    _cleanup_stale(parent, out.name)
    try:
        with files.owned(files.fresh_name(parent, files.sibling_prefix(out), ".tmp"), files.make_file) as tmp:
            yield tmp
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # made private; an artifact is ordinary data
            os.replace(tmp, out)
    except OSError as e:
        raise ExportError(f"{out}: writing failed ({e.strerror or e}); nothing was written, and the "
                          "previous file, if any, is untouched") from e


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp directory path beside `out` (a package directory); when the block succeeds, the
    old `out` moves aside, the new one takes its place, and only then is the old one deleted. An
    interruption at any point leaves the old or the new package at `out`, never neither."""
    try:
        with files.atomic_directory(out) as new:
            yield new
    except OSError as e:
        raise ExportError(f"{out}: writing failed ({e.strerror or e}); nothing was written, and the previous "
                          "artifact, if any, is untouched") from e

