"""Generate text from an exported TSA or elastic decoder with ONNX Runtime and numpy only (no torch).

    adaptex export tsa-charlm --target onnx -o tsa.onnx
    python examples/tsa_generate.py tsa.onnx --prompt "def main(" --max-new-tokens 80
    python examples/tsa_generate.py copy.onnx --prompt-ids "1 5 9 4 2"      # id-level tasks
    adaptex export elastic-charlm --target onnx -o el.onnx
    python examples/tsa_generate.py el.onnx --prompt "def main(" --max-new-tokens 80

The artifact takes Optimum-style inputs (input_ids, attention_mask, past_key_values.{i}.key/value)
and returns logits, present.{i}.key/value and each gated block's keep decisions: prefill runs the
prompt once, then each step feeds one token and the previous step's presents. The keep decisions
say which tokens ran each block's FFN; the rest skipped it for real. An elastic decoder also takes
head_modes.{i}: its routers pick each head's mode (full or streaming attention) at prefill, and every
decode step feeds those decisions.layer{i}.sa back, as it feeds the presents back.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import onnxruntime as ort


class Generator:
    def __init__(self, path: str, threads: int = 1):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        if "adaptex" not in meta:
            raise SystemExit(f"{path}: no adaptex metadata; export it with 'adaptex export ... --target onnx'")
        self.meta = json.loads(meta["adaptex"])
        self.family = self.meta.get("family")
        if self.family not in ("tsa", "elastic_decoder"):
            raise SystemExit(f"{path}: a {self.family} artifact, not a TSA or elastic decoder")
        cfg = self.meta["config"]
        self.layers, self.heads = cfg["num_layers"], cfg["num_heads"]
        self.head_dim, self.bound, self.vocab = cfg["d_model"] // cfg["num_heads"], cfg["max_len"], cfg["vocab_size"]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.modes = {}  # an elastic decoder's head modes: zeros at prefill (ignored), then the prefill's
        self.tokenizer = self.meta.get("tokenizer") or {"kind": "ids"}

    def encode(self, text: str) -> list[int]:
        itos = self.tokenizer.get("itos")
        if not itos:
            raise SystemExit("this model's tokenizer is id-level: pass --prompt-ids")
        stoi = {c: i for i, c in enumerate(itos) if i >= 2}
        return [stoi.get(c, self.tokenizer.get("unk", 1)) for c in text]

    def decode(self, ids: list[int]) -> str:
        itos = self.tokenizer.get("itos")
        return "".join(itos[i] for i in ids) if itos else " ".join(map(str, ids))

    def step(self, ids: np.ndarray, past: dict, past_len: int) -> dict:
        feeds = {"input_ids": ids, "attention_mask": np.ones((ids.shape[0], past_len + ids.shape[1]), np.int64),
                 **past, **self.modes}
        return dict(zip(self.outputs, self.session.run(None, feeds)))

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy decoding; returns the new ids and each step's keep rate (mean over gated blocks; an
        elastic decoder: the fraction of streaming heads, fixed at prefill)."""
        if not prompt:
            raise ValueError("empty prompt: pass at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ValueError(f"prompt ids must lie in [0, {self.vocab}); got [{min(prompt)}, {max(prompt)}]")
        if len(prompt) + max_new_tokens > self.bound:
            raise ValueError(f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens exceed the KV cache "
                             f"bound {self.bound}; shorten the prompt or ask for fewer tokens")
        past = {f"past_key_values.{i}.{kv}": np.zeros((1, self.heads, 0, self.head_dim), np.float32)
                for i in range(self.layers) for kv in ("key", "value")}
        elastic = self.family == "elastic_decoder"
        if elastic:
            self.modes = {f"head_modes.{i}": np.zeros((1, self.heads), bool) for i in range(self.layers)}
        out = self.step(np.array([prompt], np.int64), past, 0)
        if elastic:  # decode steps reuse the modes the routers picked at prefill
            self.modes = {f"head_modes.{i}": out[f"decisions.layer{i}.sa"] for i in range(self.layers)}
        new, keep = [], []
        n = len(prompt)
        for _ in range(max_new_tokens):
            nxt = int(out["logits"][0, -1].argmax())
            new.append(nxt)
            if elastic:
                keep.append(float(np.mean([m for m in self.modes.values()])))
            else:
                keeps = [out[f"decisions.layer{li}.keep"][0, -1] for li in range(1, self.layers)]
                keep.append(float(np.mean(keeps)) if keeps else 1.0)
            if len(new) == max_new_tokens:
                break
            past = {f"past_key_values.{i}.{kv}": out[f"present.{i}.{kv}"] for i in range(self.layers) for kv in ("key", "value")}
            out = self.step(np.array([[nxt]], np.int64), past, n)
            n += 1
        return new, keep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a TSA or elastic decoder exported with adaptex export --target onnx")
    ap.add_argument("--prompt", default=None, help="text (character-level models)")
    ap.add_argument("--prompt-ids", default=None, help="space-separated token ids")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    gen = Generator(args.model)
    try:
        if args.prompt_ids is not None:
            prompt = [int(t) for t in args.prompt_ids.split()]
        else:
            prompt = gen.encode(args.prompt if args.prompt is not None else "def ")
        ids, keep = gen.generate(prompt, args.max_new_tokens)
    except ValueError as e:
        print(f"tsa_generate: error: {e}", file=sys.stderr)
        return 2
    sep = "" if gen.tokenizer.get("itos") else " | "
    print(gen.decode(prompt) + sep + gen.decode(ids))
    blocks = gen.layers
    if gen.family == "elastic_decoder":
        print(f"\n[{len(ids)} tokens; {100 * keep[0]:.1f}% of the heads ran streaming attention (sink "
              f"{gen.meta['sink']}, window {gen.meta['window']}), chosen at prefill]", file=sys.stderr)
        return 0
    print(f"\n[{len(ids)} tokens; each token ran the FFN of {1 + (blocks - 1) * np.mean(keep):.2f} of {blocks} blocks "
          f"on average ({100 * (1 - np.mean(keep)):.1f}% of gated FFNs skipped)]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
