"""Text classification from a JSONL file: each line {"text": "...", "label": L} or {"ids": [...],
"label": L} (one kind per file), L a string or an integer. Other keys are ignored.

One streaming pass validates every line (an error names the file and line), collects the labels of
the training lines, the characters (for a character-level tokenizer) or the largest id, and indexes
the lines; batches then read random lines back (graphs/data/lines.py). Held-out lines come from
--eval FILE, else from the data by the hash rule; a held-out label that no training line has is an
error naming its line.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from adaptex.graphs.data.lines import LineIndex, data_files, decode, jsonl_rule, require_lines
from adaptex.graphs.tokenizers import CharTokenizer, JsonTokenizer
from adaptex.graphs.errors import DataError
from adaptex.graphs.tasks import Batch, _pad

FORMAT = 'each line must be {"text": "...", "label": ...} or {"ids": [1, 2, ...], "label": ...}'


def parse_line(raw: bytes, where: str) -> tuple[str, object, object]:
    """(kind, content, label) of one JSONL line: kind "text" (content a str) or "ids" (a list of ints)."""
    try:
        obj = json.loads(decode(raw, where))
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); {FORMAT}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object; {FORMAT}")
    if "label" not in obj:
        raise DataError(f"{where}: no \"label\" key (keys: {', '.join(sorted(obj)) or 'none'}); {FORMAT}")
    label = obj["label"]
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise DataError(f"{where}: label {json.dumps(label)[:40]} is a {type(label).__name__}; labels are strings or "
                        "integers")
    has_text, has_ids = "text" in obj, "ids" in obj
    if has_text == has_ids:
        raise DataError(f"{where}: {'both' if has_text else 'neither'} \"text\" {'and' if has_text else 'nor'} "
                        f"\"ids\"; {FORMAT}")
    if has_text:
        text = obj["text"]
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: \"text\" must be a non-empty string; {FORMAT}")
        return "text", text, label
    ids = obj["ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                        for i in ids):
        raise DataError(f"{where}: \"ids\" must be a non-empty list of non-negative integers; {FORMAT}")
    return "ids", ids, label


class JsonlClassification:
    """A classification task on a JSONL file: `sample` draws training batches (graphs.tasks.Batch,
    difficulty 0: the file gives no levels), `held_out` the evaluation view of the held-out lines."""

    name = "file"
    levels = ("all examples",)

    def __init__(self, path: str | os.PathLike, eval_path: str | os.PathLike | None = None,
                 tokenizer: str | os.PathLike | None = None, max_len: int = 256):
        self.path, self.eval_path, self.max_len = str(path), eval_path and str(eval_path), max_len
        self.kind: str | None = None
        self.train_labels: set = set()
        held: dict = {}  # label of a held-out line -> its first line, checked once the training labels are known
        chars: set[str] = set()
        self.max_id = -1

        def visit(split: str, raw: bytes, where: str, file_eval: bool = False) -> None:
            kind, content, label = parse_line(raw, where)
            if self.kind is None:
                self.kind = kind
            elif kind != self.kind:
                raise DataError(f"{where}: a line with \"{kind}\" where the earlier lines have \"{self.kind}\"; "
                                "use one kind per file")
            if self.train_labels or held:
                seen = next(iter(self.train_labels or held))
                if isinstance(seen, str) != isinstance(label, str):
                    raise DataError(f"{where}: label {json.dumps(label)} is a {type(label).__name__}, the earlier "
                                    f"labels are {type(seen).__name__}s; use one type")
            if kind == "ids":
                self.max_id = max(self.max_id, max(content))
            elif not file_eval:
                chars.update(content)
            if split == "train":
                self.train_labels.add(label)
            elif file_eval and label not in self.train_labels:
                raise self._unknown(label, where)
            else:
                held.setdefault(label, where)

        self.index = LineIndex(data_files(path), jsonl_rule(holdout=eval_path is None), visit)
        require_lines(self.index, path, "train", "examples")
        for label, where in held.items():
            if label not in self.train_labels:
                raise self._unknown(label, where)
        if eval_path is not None:
            self.eval_index = LineIndex(data_files(eval_path, "--eval"), jsonl_rule(False, "val"),
                                        lambda s, raw, where: visit(s, raw, where, file_eval=True))
        else:
            self.eval_index = self.index
        require_lines(self.eval_index, eval_path or path, "val", "examples")
        self.labels = sorted(self.train_labels)
        if len(self.labels) < 2:
            raise DataError(f"{path}: every training line has the label {json.dumps(self.labels[0])}; a classifier "
                            "needs at least two labels")
        self.label_index = {lab: i for i, lab in enumerate(self.labels)}
        self.num_classes = len(self.labels)
        if self.kind == "ids":
            if tokenizer is not None:
                raise DataError(f"--tokenizer {tokenizer}: {path} holds token ids, not text; leave --tokenizer out")
            self.tokenizer = None
            self.vocab_size = max(self.max_id + 1, 2)
            self.pad_id = 0
        else:
            self.tokenizer = JsonTokenizer.from_file(tokenizer) if tokenizer else CharTokenizer.from_chars(chars)
            self.vocab_size, self.pad_id = self.tokenizer.vocab_size, self.tokenizer.pad_id

    def _unknown(self, label, where: str) -> DataError:
        known = ", ".join(json.dumps(lab) for lab in sorted(self.train_labels)[:8])
        return DataError(f"{where}: label {json.dumps(label)} is in no training line (labels: {known}); add training "
                         "lines with it or drop the line")

    def tokenizer_spec(self) -> dict:
        if self.tokenizer is None:
            return {"kind": "ids", "pad": 0, "vocab_size": self.vocab_size}
        return self.tokenizer.spec()

    def describe(self) -> dict:
        d = {"data": self.index.describe(), "labels": self.labels, "format": self.kind}
        if self.eval_path is not None:
            d["eval"] = self.eval_index.describe()
        return d

    def _example(self, raw: bytes, where: str) -> tuple[list[int], int]:
        _, content, label = parse_line(raw, where)
        if label not in self.label_index:
            raise self._unknown(label, where)
        if self.tokenizer is None:
            if max(content) >= self.vocab_size:
                raise DataError(f"{where}: token id {max(content)} is outside the training vocabulary (0.."
                                f"{self.vocab_size - 1}); the ids of every line must come from one vocabulary")
            ids = content
        else:
            ids = self.tokenizer.encode(content, special=True) or [self.tokenizer.unk_id]
        return ids[: self.max_len], self.label_index[label]

    def _batch(self, index: LineIndex, split: str, ks) -> Batch:
        seqs, labels = [], []
        for k in ks:
            raw, where = next(index.lines_from(split, int(k), 1))
            ids, y = self._example(raw, where)
            seqs.append(ids)
            labels.append(y)
        ids, mask = _pad(seqs, self.pad_id)
        return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.tensor(labels, dtype=torch.int64),
                     torch.zeros(len(labels), dtype=torch.int64))

    def sample(self, n: int, rng: np.random.Generator, levels=None, length=None) -> Batch:
        """n random training lines (the stream is read back by seeking, never loaded)."""
        return self._batch(self.index, "train", rng.integers(0, self.index.splits["train"].count, size=n))

    @property
    def eval_count(self) -> int:
        return self.eval_index.splits["val"].count

    def held_out(self) -> "HeldOut":
        return HeldOut(self)


class HeldOut:
    """The held-out lines as a task: `sample(n, rng)` draws n of them (seeded, so every model is
    evaluated on the same lines)."""

    def __init__(self, task: JsonlClassification):
        self.task = task
        self.name, self.levels, self.num_classes = task.name, task.levels, task.num_classes

    def sample(self, n: int, rng: np.random.Generator, levels=None, length=None) -> Batch:
        t = self.task
        return t._batch(t.eval_index, "val", rng.integers(0, t.eval_count, size=n))
