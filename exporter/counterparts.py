"""The dense graphs an adaptive artifact is timed against, built from the same weights.

- dense: the model with no routing at all (every head, every token, full attention), exported by
  the stock exporter with its optimiser on (its contract's `dense` counterpart mode);
- naive: the model's plain inference path (the decisions taken, everything computed and the skipped
  work masked: what a stock exporter makes of the model without adaptex), the `naive` mode.
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def onnx_counterparts(model, contract, workdir: Path) -> dict[str, tuple[str | None, str | None]]:
    """Each counterpart as an ONNX file by the stock exporter: name -> (path, reason if none)."""
    import torch

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out = {}
    for name, mode in contract.counterpart_modes.items():
        path = Path(workdir) / f"{name}.onnx"
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ep = torch.export.export(contract.wrapper(model, mode), contract.example_inputs(mode),
                                         dynamic_shapes=contract.dynamic_shapes(mode))
                prog = torch.onnx.export(ep, (), dynamo=True, optimize=True, verbose=False,
                                         input_names=contract.input_names(mode),
                                         output_names=contract.output_names(mode))
            prog.save(str(path))
            out[name] = (str(path), None)
        except Exception as e:
            out[name] = (None, f"stock export failed: {_first_line(e)}")
    return out


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
