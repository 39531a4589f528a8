"""A user's data files, read line by line and never whole: one streaming pass builds a sparse index
(the byte offset of every BLOCK-th line of each split), and training reads random lines back by
seeking to their block. Memory stays a few bytes per BLOCK lines, whatever the file's size.

The train/eval split is a rule on each line's own bytes, so it does not depend on the order of the
lines, the seed or the machine: a line is held out when crc32(line) % HOLDOUT == 0 (about 10%),
duplicates land on the same side. A blank line of a text corpus goes with the line before it (a
paragraph break stays inside its split); a blank line of a JSONL file is skipped.
"""
from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from adaptex.graphs.errors import DataError

HOLDOUT = 10
BLOCK = 32
SPLITS = ("train", "val")


def data_files(path: str | os.PathLike, what: str = "--data") -> list[Path]:
    """A file, or every regular file under a directory (recursively, in sorted order; names starting
    with '.' and __pycache__ are skipped)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.exists():
        raise DataError(f"{what} {p}: no such file or directory; pass a text or JSONL file (or a directory of them)")
    if not p.is_dir():
        raise DataError(f"{what} {p}: not a regular file or directory")
    out = []
    for dirpath, dirs, files in os.walk(p):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        out += [Path(dirpath, f) for f in sorted(files) if not f.startswith(".")]
    if not out:
        raise DataError(f"{what} {p}: the directory holds no files; put the text files in it")
    return out


def held_out(raw: bytes) -> bool:
    return zlib.crc32(raw.strip()) % HOLDOUT == 0


def decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        "convert the file to UTF-8") from None


@dataclass
class Split:
    """One split's lines: how many, and where every BLOCK-th one starts (file index, byte offset,
    line number)."""
    name: str
    count: int = 0
    blocks: list[tuple[int, int, int]] = field(default_factory=list)


class LineIndex:
    """One streaming pass over `files`, each line given a split (or None: skipped) by `rule(raw,
    previous split)`; `visit(split, raw, where)` sees every kept line (validation, vocabulary).
    Records each split's count and block offsets, the files' sha256 and the number of lines."""

    def __init__(self, files: list[Path], rule: Callable[[bytes, str | None], str | None],
                 visit: Callable[[str, bytes, str], None] | None = None):
        self.files, self.rule = files, rule
        self.splits = {s: Split(s) for s in SPLITS}
        h = hashlib.sha256()
        self.lines = 0
        for fi, path in enumerate(files):
            prev = None
            with open(path, "rb") as f:
                offset, lineno = 0, 0
                for raw in f:  # binary iteration reads buffered chunks: memory stays one line
                    lineno += 1
                    h.update(raw)
                    split = rule(raw, prev)
                    if split is not None:
                        s = self.splits[split]
                        if s.count % BLOCK == 0:
                            s.blocks.append((fi, offset, lineno))
                        s.count += 1
                        if visit is not None:
                            visit(split, raw, f"{path}:{lineno}")
                        prev = split
                    offset += len(raw)
            self.lines += lineno
        self.sha256 = h.hexdigest()

    def lines_from(self, split: str, k: int, limit: int | None = None) -> Iterator[tuple[bytes, str]]:
        """The lines of `split` from its k-th on (wrapping to the first after the last), at most
        `limit` of them (default: the split's count), as (raw bytes, 'file:line')."""
        s = self.splits[split]
        if s.count == 0:
            return
        k %= s.count
        limit = s.count if limit is None else limit
        fi, offset, lineno = s.blocks[k // BLOCK]
        skip, given = k % BLOCK, 0
        prev = split  # a block starts on a line of this split (a blank one took it from its predecessor)
        while given < limit:
            path = self.files[fi]
            with open(path, "rb") as f:
                f.seek(offset)
                for raw in f:
                    r = self.rule(raw, prev)
                    if r == split:
                        if skip:
                            skip -= 1
                        else:
                            yield raw, f"{path}:{lineno}"
                            given += 1
                            if given >= limit:
                                return
                    prev = r if r is not None else prev
                    lineno += 1
            fi, offset, lineno, prev = (fi + 1) % len(self.files), 0, 1, None

    def describe(self) -> dict:
        return {"files": [str(p) for p in self.files], "sha256": self.sha256, "lines": self.lines,
                "train_lines": self.splits["train"].count, "eval_lines": self.splits["val"].count}


def text_rule(holdout: bool, split: str = "train") -> Callable[[bytes, str | None], str | None]:
    """Text corpora: every line kept; held out by its hash, a blank line with the line before it
    (without holdout: every line in `split`)."""
    if not holdout:
        return lambda raw, prev: split

    def rule(raw: bytes, prev: str | None) -> str:
        if not raw.strip():
            return prev or "train"
        return "val" if held_out(raw) else "train"
    return rule


def jsonl_rule(holdout: bool, split: str = "train") -> Callable[[bytes, str | None], str | None]:
    """JSONL: blank lines skipped, the others held out by their hash (without holdout: all in `split`)."""
    def rule(raw: bytes, prev: str | None) -> str | None:
        if not raw.strip():
            return None
        return ("val" if held_out(raw) else "train") if holdout else split
    return rule


def require_lines(index: LineIndex, path, split: str, what: str) -> None:
    """A split with no line is an error naming the file and the fix."""
    n = index.splits[split].count
    if n:
        return
    if index.lines == 0 or all(s.count == 0 for s in index.splits.values()):
        raise DataError(f"{path}: empty (no {what}); put at least a few lines in it")
    if split == "val":
        raise DataError(f"{path}: none of its {index.splits['train'].count} lines fell in the held-out split (a line "
                        f"is held out when crc32(line) % {HOLDOUT} == 0); pass --eval FILE or more lines")
    raise DataError(f"{path}: every line fell in the held-out split; pass more lines")
