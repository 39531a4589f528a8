"""Your data, end to end: write a JSONL file of labelled texts and a tokenizer.json for it, train an
adaptive classifier on them, export it to ONNX, check the artifact against the eager model, and
classify new texts with ONNX Runtime, the tokenizer and the label names read from the artifact
itself (no torch, no adaptex).

    .venv/bin/python examples/bring_your_data.py            # under a minute on 2 CPU cores
    .venv/bin/python examples/bring_your_data.py --steps 20 --out /tmp/byd

Each step is the command a user would type; the script prints it before running it.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

TOPICS = {  # a support inbox: the topic is in a few cue words among common ones
    "billing": "invoice charge refund payment card price receipt",
    "shipping": "parcel delivery courier tracking address late package",
    "account": "password login email username locked profile reset",
}
COMMON = ("the my a i please it was is not to for and of on with can you help today again since "
          "order thanks hello why when").split()


def write_data(path: Path, n: int, seed: int = 0) -> None:
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            topic = r.choice(sorted(TOPICS))
            words = [r.choice(COMMON) for _ in range(r.randint(4, 16))]
            for _ in range(r.randint(1, 2)):
                words.insert(r.randint(0, len(words)), r.choice(TOPICS[topic].split()))
            f.write(json.dumps({"text": " ".join(words), "label": topic}) + "\n")


def write_tokenizer(data: Path, path: Path) -> None:
    """A word-level tokenizer.json trained on the texts (the tokenizers library): yours may be any."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = (json.loads(line)["text"] for line in open(data))
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    tok.save(str(path))


def adaptex(*args: str) -> None:
    """The command a user would type, run in this process (the CLI's main: same output, one start-up)."""
    from adaptex.cli import main as cli

    print("$ adaptex " + " ".join(args), flush=True)
    rc = cli(list(args))
    if rc:
        sys.exit(rc)


def classify(artifact: Path, texts: list[str]) -> None:
    """ONNX Runtime, numpy and tokenizers: the tokenizer and the labels come from the artifact's metadata."""
    import numpy as np
    import onnxruntime as ort
    from tokenizers import Tokenizer

    sess = ort.InferenceSession(str(artifact), providers=["CPUExecutionProvider"])
    meta = json.loads(sess.get_modelmeta().custom_metadata_map["adaptex"])
    spec, labels = meta["tokenizer"], meta["config"]["labels"]
    tok = Tokenizer.from_str(spec["json"])
    seqs = [e.ids for e in tok.encode_batch(texts)]
    T = max(map(len, seqs))
    ids = np.full((len(texts), T), spec["pad"], dtype=np.int64)
    mask = np.zeros((len(texts), T), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, {"input_ids": ids, "attention_mask": mask})))
    ks = [n for n in names if n.endswith(".k")]
    for i, text in enumerate(texts):
        heads = ", ".join(f"{int(out[k][i])}" for k in ks)
        print(f"  {labels[int(out['logits'][i].argmax())]:<9} heads per layer [{heads}] of "
              f"{meta['config']['num_heads']}  <- {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/bring_your_data", help="where the data, checkpoint and artifact go")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lines", type=int, default=1200)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "tickets.jsonl"
    write_data(data, a.lines)
    tokenizer = out / "tokenizer.json"
    write_tokenizer(data, tokenizer)
    print(f"wrote {a.lines} labelled texts to {data} (about 10% held out by a hash of each line) and {tokenizer}")
    ckpt, art = out / "checkpoint", out / "classifier.onnx"
    adaptex("train", "budgetformer", "--data", str(data), "--tokenizer", str(tokenizer), "--steps", str(a.steps),
            "--batch-size", "32",
            "--d-model", "64", "--heads", "4", "--layers", "2", "--d-ff", "128", "--eval-size", "500",
            "--no-baseline", "-o", str(ckpt))
    adaptex("export", str(ckpt), "--target", "onnx", "-o", str(art))
    adaptex("check", str(art), "--samples", "100")
    print(f"classifying new texts with ONNX Runtime ({art}):")
    classify(art, ["hello my card was charged twice for the order", "the parcel is late and tracking says nothing",
                   "i can not login since the password reset", "thanks"])


if __name__ == "__main__":
    main()
