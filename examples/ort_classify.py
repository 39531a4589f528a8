"""Run an exported BudgetFormer with onnxruntime and numpy only (no torch), reading the decisions.

    python examples/ort_classify.py build/demo/budgetformer.onnx

Without an argument it runs the artifact `make demo` writes (build/demo/budgetformer.onnx).
"""
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort


def main(path: str) -> None:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    meta = json.loads(sess.get_modelmeta().custom_metadata_map["adaptex"])
    cfg = meta["config"]
    rng = np.random.default_rng(0)
    # Graded-task vocabulary: 0 pad, 1 marker A, 2 marker B, 3..6 values 0..3, 7.. filler.
    filler = lambda n: list(rng.integers(7, cfg["vocab_size"], size=n))
    examples = {
        "single cue (value 2)": filler(6) + [3 + 2] + filler(8),
        "bound cue (A 1, distractor 3)": filler(4) + [1, 3 + 1] + filler(3) + [3 + 3] + filler(5),
        "two cues (A 1, A 2 -> 3)": filler(3) + [1, 3 + 1] + filler(4) + [1, 3 + 2] + filler(5),
        "ordered pair (A 3, B 1 -> 2)": filler(2) + [1, 3 + 3] + filler(5) + [2, 3 + 1] + filler(6),
    }
    T = max(len(s) for s in examples.values())
    ids = np.zeros((len(examples), T), dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, seq in enumerate(examples.values()):
        ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, {"input_ids": ids, "attention_mask": mask})))
    layers = cfg["num_layers"]
    print(f"{'input':<32} {'class':>5}  k per layer (of {cfg['num_heads']} heads)")
    for i, name in enumerate(examples):
        ks = [int(out[f"decisions.layer{l}.k"][i]) for l in range(layers)]
        print(f"{name:<32} {int(out['logits'][i].argmax()):>5}  {ks}")


DEMO = Path(__file__).resolve().parent.parent / "build" / "demo" / "budgetformer.onnx"

if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEMO
    if not path.is_file():
        sys.exit(f"ort_classify.py: {path} does not exist; run 'make demo' first (it writes {DEMO.relative_to(DEMO.parents[2])}), "
                 "or pass an artifact from 'adaptex export budgetformer-graded -o m.onnx'")
    main(str(path))
