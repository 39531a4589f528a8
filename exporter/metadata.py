"""Artifact metadata and atomic writes.

Every artifact carries its own metadata (family, config, op-set version, inputs and outputs with
their dynamic axes, budget range, lowering variant, precision, source checkpoint hash) under the
key `adaptex` of the ONNX model's metadata_props, as one JSON object.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from adaptex.exporter.errors import ExportError

META_KEY = "adaptex"
FORMAT_VERSION = 1


def check_writable(out: str | os.PathLike) -> Path:
    """Fail before any work if `out` cannot be written, naming the fix."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ExportError(f"{out}: is a directory; pass a file path such as {out / 'model.onnx'}")
    if not parent.is_dir():
        raise ExportError(f"{out}: directory {parent} does not exist; create it or choose another -o")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"{out}: directory {parent} is not writable; choose another -o")
    return out


@contextlib.contextmanager
def atomic_path(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `out`; rename it onto `out` only if the block succeeds."""
    out = check_writable(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent if str(out.parent) else ".")
    os.close(fd)
    try:
        try:
            yield Path(tmp)
        except OSError as e:
            raise ExportError(f"{out}: writing failed ({e.strerror or e}); nothing was written") from e
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; an artifact is ordinary data
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_onnx_metadata(path: str | os.PathLike) -> dict:
    """The adaptex metadata of an ONNX artifact (without loading its weights)."""
    import onnx

    from adaptex.exporter.errors import AdaptexError

    path = Path(path)
    if not path.is_file():
        raise AdaptexError(f"{path}: no such artifact; export one with 'adaptex export -o {path}'")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise AdaptexError(f"{path}: not a readable ONNX model ({type(e).__name__}); re-export it") from None
    props = {p.key: p.value for p in model.metadata_props}
    if META_KEY not in props:
        raise AdaptexError(f"{path}: has no adaptex metadata, so it was not written by 'adaptex export'; "
                           "export the model with adaptex first")
    return json.loads(props[META_KEY])


def format_metadata(meta: dict) -> str:
    lines = []
    order = ["family", "target", "variant", "precision", "opset", "source", "budget_range", "config",
             "inputs", "outputs"]
    for key in order + sorted(set(meta) - set(order)):
        if key not in meta:
            continue
        val = meta[key]
        if key in ("inputs", "outputs"):
            lines.append(f"{key}:")
            for name, spec in val.items():
                lines.append(f"  {name:<30} {spec['dtype']:<8} {spec['shape']}")
        elif isinstance(val, dict):
            lines.append(f"{key}:")
            for k, v in val.items():
                lines.append(f"  {k:<20} {v}")
        else:
            lines.append(f"{key}: {val}")
    return "\n".join(lines)


def routing_meta(cfg) -> dict:
    """The family's routing parameters, as artifact metadata."""
    if cfg.family == "tsa":
        return {"keep_threshold": cfg.threshold, "kv_cache_bound": cfg.max_len}
    if cfg.family == "elastic_decoder":
        return {"sink": cfg.sink, "window": cfg.window, "backbone": "dense decoder",
                "backbone_sha256": cfg.backbone_sha256, "kv_cache_bound": cfg.max_len,
                "head_modes": "routed at prefill (empty cache); decode steps take head_modes.{i} = the prefill's "
                              "decisions.layer{i}.sa"}
    if cfg.family == "elastic":
        return {"sink": cfg.sink, "window": cfg.window, "backbone": cfg.backbone,
                "backbone_sha256": cfg.backbone_sha256, "position_limit": cfg.max_len}
    return {"budget_range": [cfg.s_min, cfg.s_max]}
