"""Language-modelling tasks for decoders: generated copy and sort, and a character LM on text every
machine has offline (the Python standard library's own source).

Each yields `LMBatch`es: input_ids and targets (shifted by one), a loss mask saying which targets
count (copy/sort: the answer half only), and an attention mask (all ones: sequences have one length).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from adaptex.graphs.errors import AdaptexError


@dataclass
class LMBatch:
    input_ids: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64: the next token at each position
    loss_mask: torch.Tensor  # (B, T) bool: targets that count
    attention_mask: torch.Tensor  # (B, T) int64, 1 = real token


class SequenceTransduction:
    """BOS x_1..x_n SEP y_1..y_n, with y = x (copy) or sorted(x) (sort); the loss and the accuracy are
    on the y half. Vocabulary: 0 pad, 1 BOS, 2 SEP, 3..V-1 symbols. Length 10, vocabulary 32 (the
    setting of the TSA paper, arXiv:2605.05222)."""

    PAD, BOS, SEP = 0, 1, 2

    def __init__(self, name: str, length: int = 10, vocab_size: int = 32):
        self.name, self.length, self.vocab_size = name, length, vocab_size
        self.seq_len = 2 * length + 1  # model input length (the last token is only a target)

    def tokenizer(self) -> dict:
        return {"kind": "ids", "pad": self.PAD, "bos": self.BOS, "sep": self.SEP}

    def answer(self, x: np.ndarray) -> np.ndarray:
        return np.sort(x, axis=-1) if self.name == "sort" else x

    def sample(self, n: int, rng: np.random.Generator) -> LMBatch:
        x = rng.integers(3, self.vocab_size, size=(n, self.length))
        seq = np.concatenate([np.full((n, 1), self.BOS), x, np.full((n, 1), self.SEP), self.answer(x)], axis=1)
        ids, tgt = seq[:, :-1], seq[:, 1:]
        loss_mask = np.zeros_like(tgt, dtype=bool)
        loss_mask[:, self.length:] = True  # targets from SEP onwards: the answer tokens
        return LMBatch(torch.from_numpy(ids), torch.from_numpy(tgt), torch.from_numpy(loss_mask),
                       torch.ones(n, ids.shape[1], dtype=torch.int64))

    def prompt(self, x: np.ndarray) -> np.ndarray:
        """BOS x SEP for each row of x: what generation starts from."""
        n = x.shape[0]
        return np.concatenate([np.full((n, 1), self.BOS), x, np.full((n, 1), self.SEP)], axis=1)


class StdlibChars:
    """Character LM on the Python standard library's source (held-out files for validation).

    Characters are bytes of printable ASCII, newline and tab, mapped to ids 1..; anything else is 1.
    """

    name = "charlm"
    packages_val = ("json", "email")  # held out
    splits = True  # sample() takes split="train" | "val"

    def __init__(self, context: int = 128):
        self.seq_len = context
        chars = "\t\n" + "".join(chr(c) for c in range(32, 127))
        self.itos = ["<pad>", "<unk>"] + [c for c in chars]
        self.stoi = {c: i for i, c in enumerate(self.itos) if i >= 2}
        self.vocab_size = len(self.itos)
        root = os.path.dirname(os.__file__)
        train, val = [], []
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
            rel = os.path.relpath(dirpath, root).split(os.sep)[0]
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                        (val if rel in self.packages_val else train).append(fh.read())
        if sum(map(len, train)) < 1_000_000 or sum(map(len, val)) < 50_000:
            raise AdaptexError(f"the charlm task needs CPython's Lib/ sources under {root}; use --task copy")
        self.train = np.array(self.encode("\n".join(train)), dtype=np.int64)
        self.val = np.array(self.encode("\n".join(val)), dtype=np.int64)

    def tokenizer(self) -> dict:
        """What an app needs to encode and decode: id i is the character itos[i] (0 pad, 1 unknown)."""
        return {"kind": "chars", "pad": 0, "unk": 1, "itos": self.itos}

    def encode(self, s: str) -> list[int]:
        return [self.stoi.get(c, 1) for c in s]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] if i >= 2 else ("" if i == 0 else "?") for i in ids)

    def sample(self, n: int, rng: np.random.Generator, split: str = "train") -> LMBatch:
        data = self.train if split == "train" else self.val
        starts = rng.integers(0, len(data) - self.seq_len - 1, size=n)
        seq = np.stack([data[s: s + self.seq_len + 1] for s in starts])
        ids, tgt = seq[:, :-1], seq[:, 1:]
        return LMBatch(torch.from_numpy(ids), torch.from_numpy(tgt), torch.ones_like(torch.from_numpy(tgt), dtype=torch.bool),
                       torch.ones(n, self.seq_len, dtype=torch.int64))


LM_TASKS = ("copy", "sort", "charlm")


def get_lm_task(name: str, **kw):
    if name in ("copy", "sort"):
        return SequenceTransduction(name, **kw)
    if name == "charlm":
        return StdlibChars(**kw)
    raise AdaptexError(f"unknown task {name!r} for a decoder; choose one of {', '.join(LM_TASKS)}")
