"""Why adaptex exists: the legacy ONNX tracer bakes the routing of its example input into the graph.

Exports the shipped BudgetFormer's plain PyTorch inference path with torch.onnx.export(dynamo=False),
then runs it on inputs whose k differs from the traced one, next to the adaptex artifact.

    python examples/legacy_tracer_bakes_k.py
"""
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from exporter.targets import onnx as onnx_target
from exporter.trace import ExportWrapper, output_names
from graphs import checkpoint
from graphs.tasks import GradedCues

warnings.filterwarnings("ignore")


def main() -> None:
    model, info = checkpoint.load(None)
    info["name"] = checkpoint.DEFAULT_MODEL
    task = GradedCues()
    rng = np.random.default_rng(0)
    trace_batch = task.sample(1, rng, levels=[0])
    with tempfile.TemporaryDirectory() as tmp:
        legacy, ours = Path(tmp) / "legacy.onnx", Path(tmp) / "adaptex.onnx"
        with torch.no_grad():
            torch.onnx.export(ExportWrapper(model, "naive"), (trace_batch.input_ids, trace_batch.attention_mask),
                              str(legacy), dynamo=False, input_names=["input_ids", "attention_mask"],
                              output_names=output_names(model.cfg.num_layers),
                              dynamic_axes={"input_ids": {0: "b", 1: "t"}, "attention_mask": {0: "b", 1: "t"}})
        onnx_target.export(model, info, ours)
        s_legacy, s_ours = ort.InferenceSession(str(legacy)), ort.InferenceSession(str(ours))
        print(f"{'input':<18} {'k (eager)':<14} {'legacy max err':>14} {'adaptex max err':>16}")
        for level in range(4):
            b = task.sample(1, rng, levels=[level])
            feeds = {"input_ids": b.input_ids.numpy(), "attention_mask": b.attention_mask.numpy()}
            with torch.no_grad():
                ref, dec = model(b.input_ids, b.attention_mask)
            ks = [int(d["k"][0]) for d in dec]
            e_legacy = np.abs(s_legacy.run(None, feeds)[0] - ref.numpy()).max()
            e_ours = np.abs(s_ours.run(None, feeds)[0] - ref.numpy()).max()
            print(f"level {level} ({task.levels[level]})".ljust(18) + f" {str(ks):<14} {e_legacy:14.2e} {e_ours:16.2e}")


if __name__ == "__main__":
    main()
