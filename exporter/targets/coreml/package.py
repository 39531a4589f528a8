"""A Core ML package's I/O and files: feature names and types, descriptions, the adaptex metadata in
the package, and the atomic write that never loses an existing package.

Core ML feature names cannot hold dots, so `decisions.layer0.k` is the feature `decisions_layer0_k`
(every I/O entry of the metadata records its `coreml_name`). Core ML has no int64 or bool features:
integer inputs and outputs are int32, bool ones float32 0/1.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from adaptex.exporter import metadata
from adaptex.exporter.errors import ExportError
from adaptex.graphs.errors import AdaptexError

MAX_BATCH = 4096  # the batch bound of the trace (the contracts' dynamic shapes)
MIN_PAST = 0  # a decoder package's past_sequence lower bound: a prefill passes an empty cache
MIN_TARGETS = ("iOS16", "iOS17", "iOS18", "macOS13", "macOS14", "macOS15")
DEFAULT_MIN_TARGET = "iOS17"


def coreml_name(name: str) -> str:
    return name.replace(".", "_")


def coreml_dtype(dtype: str) -> str:
    return "int32" if dtype.startswith(("int", "uint")) else "float32"


def coreml_io(inputs: dict, outputs: dict) -> tuple[dict, dict]:
    """The artifact's I/O (exporter.trace.io_specs) as a package takes and gives it."""
    def conv(specs):
        return {n: {**s, "dtype": coreml_dtype(s["dtype"]), "coreml_name": coreml_name(n)} for n, s in specs.items()}
    return conv(inputs), conv(outputs)


def input_types(inputs: dict, max_sequence: int) -> list:
    """ct.TensorType per input with flexible shapes: batch 1..MAX_BATCH, past_sequence MIN_PAST..L-1,
    a sum of axes (a decoder's mask) 1..L, any other axis 1..L. Core ML shapes cannot be sums of
    ranges; the runtime checks the mask against the ids and the cache."""
    import coremltools as ct

    L = max_sequence
    dims: dict[str, object] = {}

    def dim(d):
        if isinstance(d, int):
            return d
        if d not in dims:
            lo, hi, default = {"batch": (1, MAX_BATCH, 1), "past_sequence": (MIN_PAST, L - 1, max(MIN_PAST, 1))}.get(
                d, (1, L, 2 if "+" in d else 1))
            symbol = "past_plus_sequence" if "+" in d else d
            dims[d] = ct.RangeDim(lo, hi, default=default, symbol=symbol)
        return dims[d]

    return [ct.TensorType(name=s["coreml_name"], shape=tuple(dim(d) for d in s["shape"]),
                          dtype=np.int32 if s["dtype"] == "int32" else np.float32) for s in inputs.values()]


def describe(mlmodel, meta: dict) -> None:
    """Descriptions Xcode shows: the model's, and each feature's (from the metadata)."""
    mlmodel.short_description = (f"{meta['family']} exported by adaptex {meta.get('adaptex', '')}: {meta['variant']} "
                                 f"lowering, {meta['precision']} body, fp32 routing; decisions are the decisions_* "
                                 "outputs")
    mlmodel.author = "adaptex"
    mlmodel.version = str(metadata.FORMAT_VERSION)
    spec = mlmodel.get_spec()
    ins = {i.name for i in spec.description.input}
    outs = {o.name for o in spec.description.output}
    for side in ("inputs", "outputs"):
        for spec_ in meta[side].values():
            text = spec_.get("description") or ""
            if not text:
                continue
            if spec_["coreml_name"] in ins:
                mlmodel.input_description[spec_["coreml_name"]] = text
            elif spec_["coreml_name"] in outs:
                mlmodel.output_description[spec_["coreml_name"]] = text


def stamp(mlmodel, meta: dict) -> None:
    """The metadata as the JSON blob under `adaptex`, and each top-level key as its own entry."""
    ud = mlmodel.user_defined_metadata
    ud[metadata.META_KEY] = json.dumps(meta)
    for k, v in meta.items():
        if k in ("inputs", "outputs", "tokenizer", "decisions"):
            continue
        ud[f"adaptex.{k}"] = v if isinstance(v, str) else json.dumps(v)


def check_features(mlmodel, meta: dict) -> None:
    spec = mlmodel.get_spec()
    got = ([i.name for i in spec.description.input], [o.name for o in spec.description.output])
    want = tuple([s["coreml_name"] for s in meta[side].values()] for side in ("inputs", "outputs"))
    if got != want:
        raise ExportError(f"coremltools named the package's features {got}, expected {want}")


def save(mlmodel, out: Path) -> None:
    """Write the package at `out` atomically: the old one moves aside and is deleted only once the
    new one is in place (metadata.atomic_dir); a full disk is one line naming the fix."""
    try:
        with metadata.atomic_dir(out) as tmp:
            mlmodel.save(str(tmp))
    except OSError as e:
        raise ExportError(f"{out}: writing the package failed ({e.strerror or e}); free space or choose another "
                          "-o; the previous package, if any, is untouched") from None
    except Exception as e:
        if isinstance(e, AdaptexError):
            raise
        raise ExportError(f"{out}: coremltools could not write the package ({str(e).splitlines()[0][:200]}); "
                          "free space or choose another -o") from None


def is_package(path: Path) -> bool:
    return path.is_dir() and (path / "Manifest.json").is_file()


def check_output(out: Path) -> None:
    if out.suffix != ".mlpackage":
        hint = out.with_suffix(".mlpackage") if out.suffix else Path(f"{out}.mlpackage")
        raise ExportError(f"{out}: a Core ML package's name must end in .mlpackage; use -o {hint}")
    parent = out.absolute().parent
    if not parent.exists():
        try:  # like mkdir -p, as for every other artifact and a checkpoint
            parent.mkdir(parents=True)
        except OSError as e:
            raise ExportError(f"{out}: cannot create directory {parent} ({e.strerror or e}); create it or choose "
                              "another -o") from None
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ExportError(f"{out}: directory {parent} is not a writable directory; choose another -o")
    if out.exists():
        try:
            package_meta(load_spec(out), out)
        except AdaptexError:
            raise ExportError(f"{out}: exists and is not an ML package written by adaptex; choose a new -o "
                              "(adaptex only replaces artifacts it wrote)") from None


def check_package_files(path: Path) -> None:
    """Refuse a package whose files reach outside it (a symlinked weight.bin would be read from
    wherever it points), as ONNX external data outside the model's folder is refused."""
    root = path.resolve()
    for p in path.rglob("*"):
        if p.is_symlink() or not p.resolve().is_relative_to(root):
            where = "inside" if p.resolve().is_relative_to(root) else f"outside the package ({p.resolve()})"
            raise AdaptexError(f"{path}: {p.relative_to(path)} is a link to {where}; adaptex reads only plain "
                               "files inside a package; re-export the package")


def package_meta(spec, path: Path) -> dict:
    """The adaptex metadata of a Core ML package's spec, or a one-line error naming the fix."""
    ud = dict(spec.description.metadata.userDefined)
    if metadata.META_KEY not in ud:
        raise AdaptexError(f"{path}: has no adaptex metadata, so it was not written by 'adaptex export'; "
                           "export the model with adaptex first")
    meta = metadata.parse(ud[metadata.META_KEY], path)
    check_spec_io(spec, meta, path)
    return meta


def check_spec_io(spec, meta: dict, path) -> None:
    """Refuse metadata that does not describe the package's program (adaptex metadata copied onto
    another package): every feature by name and rank."""
    for side, features in (("inputs", spec.description.input), ("outputs", spec.description.output)):
        got = {f.name: len(f.type.multiArrayType.shape) if f.type.HasField("multiArrayType") else None
               for f in features}
        want = {s.get("coreml_name", coreml_name(n)): len(s["shape"]) for n, s in meta[side].items()}
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise AdaptexError(f"{path}: its adaptex metadata does not describe this package: the metadata's {side} "
                               f"{missing[:3]} are not the package's features, the package's {extra[:3]} are not in "
                               "the metadata (metadata copied from another model?); re-export the model with adaptex")
        for name, rank in got.items():
            if rank and rank != want[name]:
                raise AdaptexError(f"{path}: its adaptex metadata does not describe this package: feature {name!r} "
                                   f"has rank {rank}, the metadata says {want[name]}; re-export the model with adaptex")


def _root_spec(path: Path):
    """The root model's spec, read from the files as they are: coremltools' own reader opens the
    package read-write and rewrites its Manifest.json, and reading must not modify."""
    import json

    from coremltools.proto import Model_pb2

    manifest = json.loads((path / "Manifest.json").read_text())
    entry = manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]
    model = path / "Data" / entry["path"]
    if not model.resolve().is_relative_to(path.resolve()):
        raise ValueError(f"its manifest names a model file outside the package ({str(entry['path'])[:80]})")
    spec = Model_pb2.Model()
    spec.ParseFromString(model.read_bytes())
    return spec


def load_spec(path: str | Path):
    """The package's protobuf spec, without loading its program (nor writing anything); one-line errors
    for a broken package."""
    path = Path(path)
    if not path.exists():
        raise AdaptexError(f"{path}: no such artifact; export one with 'adaptex export --target coreml -o {path}'")
    if not is_package(path):
        raise AdaptexError(f"{path}: not an ML package (no Manifest.json); pass a .mlpackage written by adaptex export")
    check_package_files(path)
    try:
        return _root_spec(path)
    except Exception as e:
        raise AdaptexError(f"{path}: a corrupt ML package ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}); "
                           "re-export it") from None


def read_package_meta(path: str | Path) -> dict:
    """The adaptex metadata of the package at `path`, without loading its program."""
    return package_meta(load_spec(path), Path(path))
