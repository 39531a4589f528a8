"""adaptex: export adaptive Transformers with their savings intact.

The public API (docs/api.md):

- ``adaptex.nn``: the adaptive layers (budgeted attention, TSA token routing, elastic attention) as
  ordinary ``nn.Module``s for your own models;
- ``adaptex.export(model, example_inputs, path, target=...)``: any model whose adaptive parts are
  adaptex ops, to ONNX, Core ML or TensorRT-bound ONNX;
- ``adaptex.check(path, model, inputs=...)``: parity of an artifact against the eager model,
  decisions first;
- ``adaptex.bench(path, model, inputs=...)``: latency against the dense graphs of the same weights;
- ``adaptex.load(name_or_dir)``: a shipped model or a checkpoint directory.

The rooms below hold the implementation: ``adaptex.graphs`` (what an adaptive model is),
``adaptex.exporter`` (how it becomes an artifact) and ``adaptex.runtimes`` (how an artifact runs).
Nothing heavy is imported until it is used, so ``import adaptex`` and ``adaptex --version`` are quick.
"""
from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("adaptex")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+source"

__all__ = ["__version__", "nn", "export", "check", "bench", "load"]


def __getattr__(name: str):
    # lazy: the API pulls in torch, onnx and onnxruntime only when first used
    if name == "nn":
        import importlib

        return importlib.import_module("adaptex.nn")
    if name in ("export", "check", "bench", "load"):
        from adaptex import api

        return getattr(api, name)
    raise AttributeError(f"module 'adaptex' has no attribute {name!r}")
