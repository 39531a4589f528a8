"""Tokenizers for a user's data, each with a spec that ships inside the checkpoint (and so inside
every artifact's metadata): an app decodes and encodes from the artifact alone.

Specs (JSON):
- {"kind": "chars", "pad": 0, "unk": 1, "itos": [...]}: id i is the character itos[i] (built from the data).
- {"kind": "tokenizer.json", "pad": id, "json": "<the tokenizer.json text>"}: load it with
  tokenizers.Tokenizer.from_str(spec["json"]).
- {"kind": "ids", "pad": 0, "vocab_size": n}: the data came as token ids.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from adaptex.graphs.errors import DataError

PAD, UNK = 0, 1
PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<|endoftext|>", "</s>")


class CharTokenizer:
    """Character level: ids 0 pad, 1 unknown, then the characters seen in the data, sorted."""

    kind = "chars"

    def __init__(self, itos: list[str]):
        if len(itos) < 3 or itos[0] != "<pad>" or itos[1] != "<unk>":
            raise DataError("a chars tokenizer needs itos = ['<pad>', '<unk>', characters...]")
        self.itos = list(itos)
        self.stoi = {c: i for i, c in enumerate(self.itos) if i >= 2}
        self.pad_id, self.unk_id = PAD, UNK

    @classmethod
    def from_chars(cls, chars) -> "CharTokenizer":
        return cls(["<pad>", "<unk>"] + sorted(set(chars)))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return [self.stoi.get(c, UNK) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] if i >= 2 else ("" if i == 0 else "?") for i in ids)

    def spec(self) -> dict:
        return {"kind": self.kind, "pad": PAD, "unk": UNK, "itos": self.itos}


class JsonTokenizer:
    """A `tokenizers` tokenizer.json. Padding and truncation it may configure are switched off:
    the data readers pad and cut themselves."""

    kind = "tokenizer.json"

    def __init__(self, text: str, where: str = "tokenizer.json", pad_id: int | None = None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise DataError(f"{where}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]}); pass a "
                            "tokenizer.json written by the tokenizers library (Tokenizer.save)") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        self.text, self.where = text, where
        self.pad_id = pad_id if pad_id is not None else self._find_pad()
        self.unk_id = self.pad_id

    @classmethod
    def from_file(cls, path: str | os.PathLike, pad_id: int | None = None) -> "JsonTokenizer":
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--tokenizer {p}: no such file; pass a tokenizer.json, or leave --tokenizer out for "
                            "a character-level tokenizer built from the data")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{p}: unreadable ({type(e).__name__}); pass a tokenizer.json") from None
        return cls(text, str(p), pad_id)

    def _find_pad(self) -> int:
        padding = json.loads(self.text).get("padding") or {}
        if isinstance(padding.get("pad_id"), int):
            return padding["pad_id"]
        for t in PAD_TOKENS:
            i = self._tok.token_to_id(t)
            if i is not None:
                return i
        return 0

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=special).ids

    def encode_batch(self, texts: list[str], special: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=special)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    def spec(self) -> dict:
        return {"kind": self.kind, "pad": self.pad_id, "json": self.text}


def from_spec(spec: dict, where: str = "the checkpoint"):
    """The tokenizer a checkpoint's (or an artifact's) spec describes."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "chars":
        return CharTokenizer(spec["itos"])
    if kind == "tokenizer.json":
        return JsonTokenizer(spec["json"], where, spec.get("pad"))
    raise DataError(f"{where}: its tokenizer is {kind!r}, which cannot encode text (chars or tokenizer.json can); "
                    "train on token ids, or on a checkpoint trained with a text tokenizer")
