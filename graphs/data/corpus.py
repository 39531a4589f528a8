"""Plain text from a file or a directory of files, for decoders (next-token windows) and encoders
(passages of a few lines).

One streaming pass checks the text is UTF-8 (an error names the file and line), collects the
characters (for a character-level tokenizer) and indexes the lines; a window or passage is then read
back from a random line by seeking (graphs/data/lines.py), and tokenised as it is read. Held-out
text comes from --eval FILE|DIR, else from the data by the hash rule.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from adaptex.graphs.data.lines import LineIndex, data_files, decode, require_lines, text_rule
from adaptex.graphs.tokenizers import CharTokenizer, JsonTokenizer
from adaptex.graphs.lm_tasks import LMBatch


class TextFiles:
    """The indexed lines of --data (and --eval): `lines(split, k, limit)` gives decoded text."""

    def __init__(self, path: str | os.PathLike, eval_path: str | os.PathLike | None = None, collect_chars: bool = False):
        self.path, self.eval_path = str(path), eval_path and str(eval_path)
        self.chars: set[str] = set()

        def visit(split, raw, where):
            text = decode(raw, where)
            if collect_chars:
                self.chars.update(text)

        self.index = LineIndex(data_files(path), text_rule(holdout=eval_path is None), visit)
        require_lines(self.index, path, "train", "text")
        if eval_path is not None:
            self.eval_index = LineIndex(data_files(eval_path, "--eval"), text_rule(False, "val"),
                                        lambda s, raw, where: decode(raw, where))
        else:
            self.eval_index = self.index
        require_lines(self.eval_index, eval_path or path, "val", "text")
        if not any(c.strip() for c in self.chars) and collect_chars:
            from adaptex.graphs.errors import DataError

            raise DataError(f"{path}: holds only blank lines; put text in it")

    def _index(self, split: str) -> LineIndex:
        return self.index if split == "train" else self.eval_index

    def count(self, split: str) -> int:
        return self._index(split).splits[split].count

    def lines(self, split: str, k: int, limit: int | None = None):
        for raw, where in self._index(split).lines_from(split, k, limit):
            yield decode(raw, where)

    def describe(self) -> dict:
        d = {"data": self.index.describe()}
        if self.eval_path is not None:
            d["eval"] = self.eval_index.describe()
        return d


def text_tokenizer(files: TextFiles, tokenizer: str | os.PathLike | None):
    """A tokenizer.json when given, else characters collected from the data."""
    return JsonTokenizer.from_file(tokenizer) if tokenizer else CharTokenizer.from_chars(files.chars)


class TextCorpus:
    """Next-token windows of `context` tokens: `sample(n, rng, split)` gives graphs.lm_tasks.LMBatch
    rows, each read from a random line on (a random token offset into it), across the following
    lines of its split. A split shorter than a window gives shorter rows, left-padded (decoders
    take left padding), their padding out of the loss."""

    name = "file"
    splits = True  # sample() takes split="train" | "val"

    def __init__(self, files: TextFiles, tokenizer, context: int):
        self.files, self.tok, self.seq_len = files, tokenizer, context
        self.vocab_size = tokenizer.vocab_size
        self.pad_id = tokenizer.pad_id

    def tokenizer(self) -> dict:
        return self.tok.spec()

    def _window(self, split: str, rng: np.random.Generator) -> list[int]:
        need = self.seq_len + 1
        out: list[int] = []
        offset = None
        for text in self.files.lines(split, int(rng.integers(0, self.files.count(split)))):
            ids = self.tok.encode(text)
            if offset is None and ids:  # start somewhere inside the first line, not always at its start
                offset = int(rng.integers(0, len(ids)))
            out += ids
            if len(out) >= need + (offset or 0):
                break
        start = min(offset or 0, max(0, len(out) - need))  # a split shorter than a window keeps all it has
        return out[start:start + need]

    def sample(self, n: int, rng: np.random.Generator, split: str = "train") -> LMBatch:
        T = self.seq_len
        ids = np.full((n, T + 1), self.pad_id, dtype=np.int64)
        real = np.zeros((n, T + 1), dtype=bool)
        for i in range(n):
            w = self._window(split, rng)
            if len(w) < 2:  # a split of one token: nothing to predict; pad it out of the loss
                w = w[:1]
            ids[i, T + 1 - len(w):] = w
            real[i, T + 1 - len(w):] = True
        inp, tgt = ids[:, :-1], ids[:, 1:]
        loss_mask = real[:, :-1] & real[:, 1:]
        return LMBatch(torch.from_numpy(inp.copy()), torch.from_numpy(tgt.copy()), torch.from_numpy(loss_mask),
                       torch.from_numpy(real[:, :-1].astype(np.int64)))


class TextPassages:
    """Passages for an encoder: consecutive lines of a split from a random one, joined until at
    least `min_chars` characters (or 64 lines). The interface of graphs.elastic.StdlibText."""

    def __init__(self, files: TextFiles, min_chars: int = 400):
        self.files, self.min_chars = files, min_chars

    def sample(self, n: int, rng: np.random.Generator, split: str = "train", join: int = 3) -> list[str]:
        out = []
        for _ in range(n):
            parts, size = [], 0
            for text in self.files.lines(split, int(rng.integers(0, self.files.count(split))), limit=64):
                text = " ".join(text.split())
                if text:
                    parts.append(text)
                    size += len(text) + 1
                if size >= self.min_chars:
                    break
            out.append(" ".join(parts) or " ")
        return out
