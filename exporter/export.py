"""Exporting any model whose adaptive parts are adaptex ops: its contract (a shipped family's, or the
generic one derived from the model), its source record, and the target's export."""
from __future__ import annotations

from pathlib import Path

from adaptex.exporter import metadata, targets
from adaptex.exporter.errors import ExportError, UnsupportedLowering
from adaptex.exporter.registry import VARIANTS
from adaptex.graphs.family import contract_for, refuse_unexportable_examples


def resolve(model, example_inputs, target: str, precision: str | None, dynamic_shapes=None,
            input_names: list[str] | None = None, example_kwargs: dict | None = None, variant: str = "sparse"):
    """(the model's contract, the target, the precision it will be exported in)."""
    t = targets.load(target)
    refuse_half_weights(model, target, variant)
    contract = contract_for(model, example_inputs, dynamic_shapes, input_names, example_kwargs)
    if example_inputs is not None:  # a model of your own: its example must make a usable artifact
        refuse_unexportable_examples(contract.input_names(), contract.example_inputs(), contract.dynamic_shapes()[0],
                                     explicit=dynamic_shapes is not None)
    prec = precision or t.default_precision(contract)
    if prec not in t.precisions:
        raise ExportError(f"precision {prec!r} is not supported for the {target} target; use "
                          f"{' or '.join(t.precisions)}")
    return contract, t, prec


def refuse_half_weights(model, target: str, variant: str = "sparse") -> None:
    """UnsupportedLowering naming the first layer whose weights are not float32 (float16, bfloat16):
    adaptex's layers route in fp32 and take fp32 weights, and an artifact's precision is chosen at
    export (precision="fp16"), not inherited from the weights."""
    import torch

    for path, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if p.is_floating_point() and p.dtype != torch.float32:
                where = f"{path}.{name}" if path else name
                raise UnsupportedLowering(f"{type(module).__name__} {path or '(the model)'!r}", target, variant, [
                    f"its weights are {str(p.dtype).replace('torch.', '')} ({where}); adaptex exports float32 weights "
                    "(its adaptive layers route in float32): call model.float() and pass precision='fp16' for a "
                    "half-precision Core ML or TensorRT artifact"])


def export(model, example_inputs=None, path=None, target: str = "onnx", variant: str = "sparse",
           precision: str | None = None, dynamic_shapes=None, *, input_names: list[str] | None = None,
           example_kwargs: dict | None = None, contract=None, say=None, **options) -> dict:
    """Export `model` to `path` for `target` (onnx, coreml, tensorrt); returns the artifact's metadata.

    A shipped family's model (from adaptex.load) needs no example inputs. Any other model needs them:
    a tuple with one tensor per forward argument or a dict by argument name, and example_kwargs for
    more keyword arguments (batch >= 2: torch.export specialises sizes 0 and 1). dynamic_shapes: any of
    torch.export's forms for those arguments (default: every axis dynamic where tracing allows). Target options: onnx dense_rows, decode_graph, short_graph, softmax_floor; coreml
    min_target; tensorrt onnx_only, min/opt/max_shapes, timing_cache, trt_version."""
    if path is None:
        raise ExportError("export needs a path to write, e.g. adaptex.export(model, inputs, 'model.onnx')")
    if variant not in VARIANTS:
        raise ExportError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    t = targets.load(target)
    unknown = set(options) - {o.dest for o in t.options}
    if unknown:
        takes = ", ".join(o.dest for o in t.options) or "none"
        raise ExportError(f"{', '.join(sorted(unknown))}: not an option of the {target} target (it takes {takes})")
    if contract is None:
        contract, t, prec = resolve(model, example_inputs, target, precision, dynamic_shapes, input_names,
                                     example_kwargs, variant)
    else:
        prec = precision or t.default_precision(contract)
    info = getattr(model, "adaptex_source", None)
    options = recorded_options(t, variant, info, options, say)
    return t.export(model, contract, Path(path), variant=variant, precision=prec,
                    source=metadata.source_of(model, info), tokenizer=(info or {}).get("tokenizer"), say=say,
                    **options)


def recorded_options(t, variant: str, info: dict | None, options: dict, say=None) -> dict:
    """`options` with the target options the checkpoint's config.json records under "export"
    ({target: {option: value}}: what was measured to suit this model, such as tsa-charlm's onnx
    dense_rows) for those not given, where they apply to `variant`. An option given as "off" (or any
    given value) wins over the recorded one."""
    recorded = ((info or {}).get("export") or {}).get(t.name) or {}
    by_dest = {o.dest: o for o in t.options}
    where = (info or {}).get("name") or (info or {}).get("path") or "the checkpoint"
    for dest in recorded:
        if dest not in by_dest:
            takes = ", ".join(by_dest) or "none"
            raise ExportError(f"{where}: config.json 'export' gives {t.name} the option {dest!r}, which it does not "
                              f"take (it takes {takes}); fix or remove that entry")
    out = dict(options)
    for dest, value in recorded.items():
        opt = by_dest[dest]
        if dest in out or (opt.variants is not None and variant not in opt.variants):
            continue
        out[dest] = value
        if say is not None:
            say(f"{where} records {opt.flag} {value} for {t.name} exports ({opt.flag} off leaves it out)")
    return out

