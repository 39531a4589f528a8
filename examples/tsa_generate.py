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
import os
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort


class GenerateError(Exception):
    """A model file or prompt this script cannot use: printed as one line, exit status 2."""


class Generator:
    def __init__(self, path: str, threads: int = 1):
        if not os.path.isfile(path):
            what = "a directory" if os.path.isdir(path) else "no such file"
            raise GenerateError(f"{path}: {what}; pass an .onnx decoder written by "
                                "'adaptex export tsa-charlm --target onnx -o tsa.onnx'")
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise GenerateError(f"{path}: not a readable ONNX model ({first}); re-export it with "
                                "'adaptex export ... --target onnx'") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if "adaptex" not in meta:
            raise GenerateError(f"{path}: no adaptex metadata; export it with 'adaptex export ... --target onnx'")
        try:
            self.meta = json.loads(meta["adaptex"])
            self.family = self.meta.get("family")
            if self.family not in ("tsa", "elastic_decoder"):
                raise GenerateError(f"{path}: a {self.family} artifact, not a TSA or elastic decoder; export "
                                    "tsa-charlm or elastic-charlm")
            cfg = self.meta["config"]
            self.layers, self.heads = int(cfg["num_layers"]), int(cfg["num_heads"])
            self.head_dim, self.bound = int(cfg["d_model"]) // self.heads, int(cfg["max_len"])
            self.vocab = int(cfg["vocab_size"])
        except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
            raise GenerateError(f"{path}: its adaptex metadata is unreadable ({type(e).__name__}: {e}); "
                                "re-export it with adaptex") from None
        self.outputs = [o.name for o in self.session.get_outputs()]
        want = {"input_ids", "attention_mask", *(f"past_key_values.{i}.{kv}" for i in range(self.layers)
                                                 for kv in ("key", "value"))}
        if self.family == "elastic_decoder":
            want |= {f"head_modes.{i}" for i in range(self.layers)}
        got = {i.name for i in self.session.get_inputs()}
        if got != want:
            raise GenerateError(f"{path}: the graph's inputs {sorted(got - want)[:3] or sorted(got)[:3]} are not the "
                                f"{self.family} decoder's its metadata describes; re-export it with adaptex")
        self.modes = {}  # an elastic decoder's head modes: zeros at prefill (ignored), then the prefill's
        self.tokenizer = self.meta.get("tokenizer") or {"kind": "ids"}

    def unknown(self, text: str) -> list[str]:
        """The characters of `text` the model's vocabulary lacks (each once, in order)."""
        known = set((self.tokenizer.get("itos") or [])[2:])
        return list(dict.fromkeys(c for c in text if c not in known))

    def encode(self, text: str) -> list[int]:
        itos = self.tokenizer.get("itos")
        if not itos:
            raise GenerateError("this model's tokenizer is id-level: pass --prompt-ids")
        stoi = {c: i for i, c in enumerate(itos) if i >= 2}
        return [stoi.get(c, self.tokenizer.get("unk", 1)) for c in text]

    def decode(self, ids: list[int]) -> str:
        itos = self.tokenizer.get("itos")
        return "".join(itos[i] for i in ids) if itos else " ".join(map(str, ids))

    def step(self, ids: np.ndarray, past: dict, past_len: int) -> dict:
        feeds = {"input_ids": ids, "attention_mask": np.ones((ids.shape[0], past_len + ids.shape[1]), np.int64),
                 **past, **self.modes}
        try:
            return dict(zip(self.outputs, self.session.run(None, feeds)))
        except Exception as e:  # a graph that does not take what its metadata says
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise GenerateError(f"ONNX Runtime failed on the decoder ({first}); re-export it with adaptex") from None

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


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1 (the number of tokens to generate)")
    return n


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


DEMO = Path(__file__).resolve().parent / "web" / "models" / "tsa-charlm.onnx"  # written by make demo


def main(argv=None) -> int:
    ap = _Parser(prog="tsa_generate", description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None,
                    help="a TSA or elastic decoder exported with adaptex export --target onnx (default: the "
                         "tsa-charlm artifact make demo writes)")
    ap.add_argument("--prompt", default=None, help="text (character-level models)")
    ap.add_argument("--prompt-ids", default=None, help="space-separated token ids")
    ap.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens to generate (at least 1)")
    args = ap.parse_args(argv)
    if args.model is None:
        if not DEMO.is_file():
            print(f"tsa_generate: error: no model given and {DEMO.relative_to(DEMO.parents[3])} does not exist; run "
                  "'make demo' first, or 'adaptex export tsa-charlm --target onnx -o tsa.onnx' and pass tsa.onnx",
                  file=sys.stderr)
            return 2
        args.model = str(DEMO)
    try:
        gen = Generator(args.model)
        if args.prompt_ids is not None:
            bad = [t for t in args.prompt_ids.split() if not t.lstrip("-").isdigit()]
            if bad:
                raise GenerateError(f"--prompt-ids: {bad[0]!r} is not a token id; pass space-separated integers")
            prompt = [int(t) for t in args.prompt_ids.split()]
        else:
            text = args.prompt if args.prompt is not None else "def "
            prompt = gen.encode(text)
            missing = gen.unknown(text)
            if missing:
                codes = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in missing[:8]) + (" ..." if len(missing) > 8 else "")
                print(f"tsa_generate: warning: the model's vocabulary lacks {codes}; they are fed as <unk>",
                      file=sys.stderr)
        ids, keep = gen.generate(prompt, args.max_new_tokens)
    except (GenerateError, ValueError) as e:
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
