"""Why adaptex exists: the legacy ONNX tracer bakes the routing of its example input into the graph.

Exports the shipped BudgetFormer's plain-PyTorch skipping implementation (per sample, compute only
the chosen heads) with torch.onnx.export(dynamo=False), then runs it on inputs whose k differs from
the traced one, next to the adaptex artifact.

    python examples/legacy_tracer_bakes_k.py
"""
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import adaptex
from adaptex.graphs.family import family_contract
from adaptex.graphs.tasks import GradedCues

warnings.filterwarnings("ignore")


def compare(ours: str | Path | None = None, T: int = 20, seed: int = 0) -> dict:
    """Trace the legacy export on one level-0 input of length T and compare both graphs with eager
    PyTorch on two inputs per difficulty level of the same length, then run the legacy graph at
    another length. `ours`: an adaptex export of the shipped model to use (default: export one).
    Returns {"traced_k", "rows": [(level, k per layer, legacy error, adaptex error)], "other_length"
    (None if the legacy graph ran there, else its error)}."""
    model = adaptex.load()  # the shipped default, budgetformer-graded
    contract = family_contract(model)
    task = GradedCues()
    rng = np.random.default_rng(seed)
    trace_batch = task.sample(1, rng, levels=[0], length=T)
    out = {"rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        legacy = Path(tmp) / "legacy.onnx"
        with torch.no_grad():
            torch.onnx.export(contract.wrapper(model, "eager"), (trace_batch.input_ids, trace_batch.attention_mask),
                              str(legacy), dynamo=False, input_names=contract.input_names(),
                              output_names=contract.output_names(),
                              dynamic_axes={"input_ids": {0: "b", 1: "t"}, "attention_mask": {0: "b", 1: "t"}})
        if ours is None:
            ours = Path(tmp) / "adaptex.onnx"
            adaptex.export(model, None, ours)
        so = ort.SessionOptions()
        so.log_severity_level = 4  # the legacy graph's failure is reported below, once
        s_legacy, s_ours = ort.InferenceSession(str(legacy), so), ort.InferenceSession(str(ours), so)
        with torch.no_grad():
            out["traced_k"] = [int(d["k"][0]) for d in model(trace_batch.input_ids, trace_batch.attention_mask)[1]]
        for level in [lv for lv in range(4) for _ in range(2)]:
            b = task.sample(1, rng, levels=[level], length=T)
            feeds = {"input_ids": b.input_ids.numpy(), "attention_mask": b.attention_mask.numpy()}
            with torch.no_grad():
                ref, dec = model(b.input_ids, b.attention_mask)
            ks = [int(d["k"][0]) for d in dec]
            e_legacy = float(np.abs(s_legacy.run(None, feeds)[0] - ref.numpy()).max())
            e_ours = float(np.abs(s_ours.run(None, feeds)[0] - ref.numpy()).max())
            out["rows"].append((level, ks, e_legacy, e_ours))
        b = task.sample(1, rng, levels=[0], length=T + 3)
        try:
            s_legacy.run(None, {"input_ids": b.input_ids.numpy(), "attention_mask": b.attention_mask.numpy()})
            out["other_length"] = None
        except Exception as e:
            out["other_length"] = str(e).split("Status Message:")[0].strip()
    return out


def main() -> None:
    task = GradedCues()
    r = compare()
    print(f"traced on a level-0 input with k = {r['traced_k']}; max |logits error| against eager PyTorch:")
    print(f"{'input':<26} {'k (eager)':<10} {'legacy':>10} {'adaptex':>10}")
    for level, ks, e_legacy, e_ours in r["rows"]:
        print(f"level {level} ({task.levels[level]})".ljust(26) + f" {str(ks):<10} {e_legacy:10.2e} {e_ours:10.2e}")
    if r["other_length"] is None:
        print("legacy graph at another length: ran")
    else:
        print(f"legacy graph at length 23: fails ({r['other_length'][:80]}...)")


if __name__ == "__main__":
    main()
