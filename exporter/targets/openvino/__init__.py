"""OpenVINO target: OpenVINO IR (.xml + .bin), or the ONNX it is made from (.onnx).

OpenVINO's ONNX frontend does not expand a custom domain's model-local functions ("No conversion
rule found for operations: adaptex.BudgetedAttention"), so the file holds them inlined. The bodies
are the portable ones, the registry's openvino cells: the ONNX lowerings without ONNX Runtime's
own choices (no com.microsoft contrib op, no If choosing a body by the batch's decisions, none of
the graph passes tuned for ONNX Runtime's kernels), each op's work skipped as in the ONNX Runtime
file. Every If output a node reads goes through a copy (onnx/portable.py: the CPU plugin's
If-output buffer). The routing nodes are named with ROUTE_MARK (tensorrt/plan.py), which OpenVINO
keeps in its nodes' names. The metadata rides in the IR's rt_info under `adaptex` (in an .onnx, its
metadata properties, as the ONNX target's).

bf16 (an IR only): the artifact is an f32 IR that its runner compiles under OpenVINO's bf16
inference precision hint, with every routing layer marked to run in f32 (openvino/bf16.py): the
routers compute their decisions in f32 from bf16 features, as TensorRT's fp16 engines do.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import onnx
import onnx.inliner

from adaptex.exporter import metadata
from adaptex.exporter.errors import ExportError
from adaptex.exporter.registry import cells, register
from adaptex.exporter.targets import Target, register_target
from adaptex.exporter.targets import onnx as onnx_target
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.onnx import portable
from adaptex.exporter.targets.openvino.bf16 import biases_in_weights, keep_routing_f32
from adaptex.exporter.targets.tensorrt.plan import ROUTE_MARK, mark_routing

NAME = "openvino"
SUFFIXES = (".xml", ".onnx")
META_KEY = metadata.META_KEY
PRECISIONS = ("fp32", "bf16")


def _register_cells() -> None:
    """The openvino cells: each ONNX lowering registered for onnx, under this target's name (the
    lowerings build ONNX Runtime's own bodies only where ctx.target == "onnx")."""
    for (op, target, variant), entries in cells().items():
        if target == "onnx" and not cells().get((op, NAME, variant)):
            for e in entries:
                register(replace(e, target=NAME))


_register_cells()


def requires_openvino():
    try:
        import openvino
    except ImportError as e:
        raise ExportError(f"the openvino target needs the openvino package ({e}); pip install openvino") from None
    return openvino


def inlined_onnx(model, contract, source: dict, *, variant: str = "sparse", precision: str = "fp32",
                 tokenizer: dict | None = None) -> tuple[onnx.ModelProto, dict]:
    """The ONNX OpenVINO reads (the adaptex functions inlined), and its metadata."""
    proto, notes, inputs, outputs = onnx_target.lower(model, contract, variant=variant, target=NAME)
    mark_routing(proto)
    portable.if_outputs_copied(proto)
    proto = onnx.inliner.inline_local_functions(proto)
    del proto.functions[:]
    keep = [o for o in proto.opset_import if o.domain != fx.DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(keep)
    meta = metadata.build(contract, target=NAME, variant=variant, precision=precision, lowerings=notes,
                          inputs=inputs, outputs=outputs, source=source, opset={"onnx": fx.ONNX_OPSET},
                          tokenizer=tokenizer)
    meta["openvino"] = {"routing_mark": ROUTE_MARK}
    onnx_target.stamp(proto, meta, onnx_target.describe(meta, " for OpenVINO"))
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        raise ExportError(f"the OpenVINO-bound ONNX fails onnx.checker: {str(e).splitlines()[0]}") from e
    return proto, meta


def is_ours(path: Path) -> bool:
    try:
        read_meta(path)
        return True
    except Exception:
        return False


def export(model, contract, out, *, variant: str = "sparse", precision: str | None = None, source: dict,
           tokenizer: dict | None = None, say=None) -> dict:
    """Write OpenVINO IR at `out` (.xml, its weights in the .bin beside it) or the inlined ONNX (.onnx)."""
    precision = precision or "fp32"
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported for the openvino target; use one of "
                          f"{', '.join(PRECISIONS)}")
    out = Path(out)
    if precision == "bf16" and out.suffix == ".onnx":
        raise ExportError(f"{out}: a bf16 OpenVINO artifact is IR (.xml): its routing layers carry the mark that "
                          "keeps them f32, which an .onnx cannot hold; write -o with .xml")
    TARGET.check_output(out, {})
    metadata.check_writable(out, is_ours)
    ov = requires_openvino()  # before the export's minutes, not after
    proto, meta = inlined_onnx(model, contract, source, variant=variant, precision=precision, tokenizer=tokenizer)
    meta["openvino"]["version"] = ov.__version__.split("-")[0]
    if out.suffix == ".onnx":
        onnx_target.stamp(proto, meta, onnx_target.describe(meta, " for OpenVINO"))
        with metadata.atomic_path(out) as tmp:
            onnx.save_model(proto, str(tmp))
        return meta
    if precision == "bf16":
        biases_in_weights(proto)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as work:
        src = Path(work) / "model.onnx"
        onnx.save_model(proto, str(src))
        try:
            ir = ov.convert_model(str(src))
        except Exception as e:
            raise ExportError(f"OpenVINO cannot convert the inlined ONNX ({str(e).strip().splitlines()[0]})") from e
        ir.set_rt_info(json.dumps(meta), [META_KEY])
        ov.save_model(ir, str(Path(work) / "model.xml"), compress_to_fp16=False)
        if precision == "bf16":
            kept = keep_routing_f32(Path(work) / "model.xml")
            if not kept and meta["decisions"]:
                raise ExportError("no routing layer found in the IR to keep in f32; the bf16 artifact could move "
                                  "decisions, so nothing was written (export fp32)")
        bin_out = out.with_suffix(".bin")
        metadata.check_writable(bin_out, lambda p: is_ours(p.with_suffix(".xml")))
        with metadata.atomic_path(bin_out) as tmp:  # the weights first: an .xml in place always has its .bin
            (Path(work) / "model.bin").replace(tmp)
        with metadata.atomic_path(out) as tmp:
            (Path(work) / "model.xml").replace(tmp)
    return meta


def read_meta(path: str | Path) -> dict:
    """An artifact's metadata: an IR's rt_info entry (read from the .xml text, never loading the
    weights), or an .onnx file's metadata properties."""
    import xml.etree.ElementTree as ET

    from adaptex.graphs.errors import AdaptexError

    path = Path(path)
    if path.suffix == ".onnx":
        return metadata.read_onnx_metadata(path)
    if not path.is_file():
        raise AdaptexError(f"{path}: no such file; export one with 'adaptex export --target openvino -o {path}'")
    try:
        info = ET.parse(path).getroot().find("rt_info")
    except ET.ParseError as e:
        raise AdaptexError(f"{path}: not OpenVINO IR ({e})") from None
    node = info.find(META_KEY) if info is not None else None
    if node is None or node.get("value") is None:
        raise AdaptexError(f"{path}: OpenVINO IR without adaptex metadata (rt_info '{META_KEY}'); export it with "
                           "'adaptex export --target openvino'")
    return metadata.parse(node.get("value"), path)


TARGET = register_target(Target(
    name=NAME, suffixes=SUFFIXES, precisions=PRECISIONS, export=export,
    default_precision=lambda contract: "fp32",
    description="OpenVINO IR (.xml + .bin), or the ONNX it is made from, functions inlined (.onnx)",
    companions=lambda out: (Path(out).with_suffix(".bin"),) if Path(out).suffix == ".xml" else ()))
