"""Classification tasks generated in code or built from text every machine has offline.

Each task yields batches of (input_ids, attention_mask, labels, difficulty) with right padding.
`difficulty` is a known integer level per example, so budgets can be reported against it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64, 1 = real token
    labels: torch.Tensor  # (B,) int64
    difficulty: torch.Tensor  # (B,) int64


def _pad(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    T = length or max(len(s) for s in seqs)
    ids = np.full((len(seqs), T), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), T), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


class GradedCues:
    """Sum-of-cues classification with four difficulty levels, from one cue to a composition.

    Vocabulary: 0 pad, 1 marker A, 2 marker B, 3..3+C-1 value tokens (value v = id-3), the rest
    filler. Label in 0..C-1.
      level 0  single cue:     one value token among fillers; label = its value
      level 1  bound cue:      "A v" plus unmarked distractor values; label = v (needs the marker)
      level 2  two cues:       "A v1" ... "A v2" plus distractors; label = (v1 + v2) mod C
      level 3  ordered pair:   "A a" ... "B b" plus distractors; label = (a - b) mod C
    Harder levels need attention to bind markers to values and to compose two bindings.
    """

    name = "graded"
    levels = ("single cue", "bound cue", "two cues", "ordered pair")
    PAD, MARK_A, MARK_B, VALUE0 = 0, 1, 2, 3

    def __init__(self, num_classes: int = 4, vocab_size: int = 64, min_len: int = 10, max_len: int = 24):
        self.num_classes = num_classes
        self.vocab_size = vocab_size
        self.min_len, self.max_len = min_len, max_len
        self.filler0 = self.VALUE0 + num_classes

    def tokenizer(self) -> dict:
        """Text for apps: words "A" and "B" are the markers, "0".."C-1" the values, and any other
        word is filler (graphs.tokenizers, kind `words`)."""
        from adaptex.graphs.tokenizers import words_spec

        vocab = {"A": self.MARK_A, "B": self.MARK_B, **{str(v): self.VALUE0 + v for v in range(self.num_classes)}}
        return words_spec(vocab, self.PAD, (self.filler0, self.vocab_size - 1))

    def _example(self, rng: np.random.Generator, level: int, length: int) -> tuple[list[int], int]:
        C = self.num_classes
        seq = list(rng.integers(self.filler0, self.vocab_size, size=length))
        vals = rng.integers(0, C, size=2)
        if level == 0:
            seq[rng.integers(0, length)] = self.VALUE0 + vals[0]
            return seq, int(vals[0])
        # distractors: unmarked values that must be ignored
        n_distract = int(rng.integers(1, 4))
        pairs = {1: [(self.MARK_A, vals[0])], 2: [(self.MARK_A, vals[0]), (self.MARK_A, vals[1])],
                 3: [(self.MARK_A, vals[0]), (self.MARK_B, vals[1])]}[level]
        label = {1: vals[0], 2: (vals[0] + vals[1]) % C, 3: (vals[0] - vals[1]) % C}[level]
        # pick non-overlapping slots: pairs occupy (i, i+1), distractors one slot, never after a marker
        slots = rng.permutation(length // 2)[: len(pairs) + n_distract] * 2
        for (marker, v), i in zip(pairs, slots[: len(pairs)]):
            seq[i], seq[i + 1] = marker, self.VALUE0 + v
        for i in slots[len(pairs):]:
            seq[i + 1] = self.VALUE0 + int(rng.integers(0, C))
        return seq, int(label)

    def sample(self, n: int, rng: np.random.Generator, levels: list[int] | None = None,
               length: int | None = None) -> Batch:
        levels = list(rng.integers(0, len(self.levels), size=n)) if levels is None else levels
        seqs, labels = [], []
        for lv in levels:
            L = length or int(rng.integers(self.min_len, self.max_len + 1))
            s, y = self._example(rng, int(lv), L)
            seqs.append(s)
            labels.append(y)
        ids, mask = _pad(seqs, self.PAD)
        return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.tensor(labels),
                     torch.tensor([int(lv) for lv in levels]))


class StdlibSource:
    """Real text: which of four standard-library packages a character snippet comes from.

    The corpus is the Python standard library's own source on this machine (no download). Levels are
    snippet lengths, long to short: shorter snippets carry fewer cues, so they are harder.
    """

    name = "stdlib"
    packages = ("email", "asyncio", "json", "unittest")
    level_lengths = (96, 48, 24)
    levels = tuple(f"{n} chars" for n in level_lengths)
    PAD = 0

    def __init__(self, vocab_size: int = 128):
        self.vocab_size = vocab_size
        self.num_classes = len(self.packages)
        self.max_len = max(self.level_lengths)
        root = os.path.dirname(os.__file__)
        self.texts: list[str] = []
        for pkg in self.packages:
            chunks = []
            for dirpath, _, files in os.walk(os.path.join(root, pkg)):
                if os.path.basename(dirpath) in ("test", "tests"):
                    continue
                for f in sorted(files):
                    if f.endswith(".py"):
                        with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                            chunks.append(fh.read())
            text = "\n".join(chunks)
            if len(text) < 10_000:
                from adaptex.graphs.errors import AdaptexError

                raise AdaptexError(f"standard library package {pkg!r} not found under {root}: "
                                   "the stdlib task needs CPython's Lib/ sources; use --task graded")
            self.texts.append(text)

    def encode(self, s: str) -> list[int]:
        # printable ASCII maps to itself; everything else (and 0) to 1
        return [c if 1 < (c := ord(ch)) < self.vocab_size else 1 for ch in s]

    def sample(self, n: int, rng: np.random.Generator, levels: list[int] | None = None,
               length: int | None = None) -> Batch:
        levels = list(rng.integers(0, len(self.levels), size=n)) if levels is None else levels
        labels = rng.integers(0, self.num_classes, size=n)
        seqs = []
        for lv, y in zip(levels, labels):
            L = length or self.level_lengths[int(lv)]
            text = self.texts[int(y)]
            start = int(rng.integers(0, len(text) - L))
            seqs.append(self.encode(text[start:start + L]))
        ids, mask = _pad(seqs, self.PAD)
        return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(labels.astype(np.int64)),
                     torch.tensor([int(lv) for lv in levels]))


TASKS = {"graded": GradedCues, "stdlib": StdlibSource}


def get_task(name: str):
    from adaptex.graphs.errors import AdaptexError

    if name not in TASKS:
        raise AdaptexError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]()
