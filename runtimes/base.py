"""The runner interface every runtime implements (Polygraphy-like), and input validation.

Runtime imports (onnxruntime, coremltools, tensorrt) live inside the runner that needs them, so
`import runtimes` works without any of them installed.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from adaptex.graphs.errors import AdaptexError, InputError


@dataclass(frozen=True)
class IOSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple  # ints, or names of dynamic axes


def max_threads() -> int:
    """The most threads a runtime is asked for: beyond a few per core a runtime only starts threads
    (ONNX Runtime hangs at a thousand and crashes at a hundred thousand)."""
    import os

    return max(64, 4 * (os.cpu_count() or 1))


def check_threads(n: int | None, flag: str = "--threads") -> None:
    """Refuse a thread count a runtime cannot use, naming the range."""
    if n is not None and not 0 <= n <= max_threads():
        raise AdaptexError(f"{flag} {n}: must lie in 0..{max_threads()} (0: the runtime's default; this machine "
                           f"has {__import__('os').cpu_count()} cores)")


@dataclass(frozen=True)
class ModelLimits:
    """What valid inputs look like beyond their declared specs."""
    max_sequence: int
    vocab_size: int


def limits_of(meta: dict) -> ModelLimits | None:
    """An artifact's input limits from its metadata (a model of your own states none)."""
    cfg = meta.get("config") or {}
    L, V = meta.get("max_sequence") or cfg.get("max_len"), cfg.get("vocab_size")
    return ModelLimits(int(L), int(V)) if L and V else None


class Runner(abc.ABC):
    """activate() -> infer(feeds) ... -> deactivate(); also a context manager."""

    name = "runner"

    def __init__(self, limits: ModelLimits | None = None):
        self.limits = limits
        self.active = False

    def activate(self) -> "Runner":
        if not self.active:
            self._activate()
            self.active = True
        return self

    def deactivate(self) -> None:
        if self.active:
            self._deactivate()
            self.active = False

    def __enter__(self):
        return self.activate()

    def __exit__(self, *exc):
        self.deactivate()

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate `feeds` against input_metadata() and run; returns outputs by name."""
        validate_feeds(feeds, self.input_metadata(), self.limits)
        self.activate()
        return self._infer(feeds)

    @abc.abstractmethod
    def input_metadata(self) -> dict[str, IOSpec]: ...

    def findings(self) -> list[str]:
        """Problems the last runs met that their outputs cannot show (a check fails on them); cleared."""
        return []

    @abc.abstractmethod
    def _infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def _activate(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


def _axis_terms(dim) -> list[str] | None:
    """'past_sequence + sequence' -> ['past_sequence', 'sequence']; a plain axis name -> [name]."""
    if not isinstance(dim, str):
        return None
    terms = [t.strip() for t in dim.split("+")]
    return terms if all(t.isidentifier() for t in terms) else None


def validate_feeds(feeds: dict, specs: dict[str, IOSpec], limits: ModelLimits | None) -> None:
    """Raise InputError (one line: the problem and the fix) unless `feeds` fit the model. Sizes are
    checked through the inputs' named axes: an axis name is one size across inputs, and an axis that
    is a sum ('past_sequence + sequence', a decoder's mask) equals the sum of its parts."""
    missing = [n for n in specs if n not in feeds]
    unknown = [n for n in feeds if n not in specs]
    if missing or unknown:
        raise InputError(f"inputs must be exactly {sorted(specs)}: missing {missing}, unknown {unknown}")
    sizes: dict[str, tuple[int, str]] = {}
    sums = []
    for name, spec in specs.items():
        a = feeds[name]
        if not isinstance(a, np.ndarray):
            raise InputError(f"{name}: expected a numpy array, got {type(a).__name__}")
        if a.dtype.name != spec.dtype:
            raise InputError(f"{name}: dtype {a.dtype.name}, expected {spec.dtype}; "
                             f"convert with .astype(np.{spec.dtype})")
        if not a.dtype.isnative:  # a big-endian array: a runtime would read its bytes as other numbers
            raise InputError(f"{name}: {a.dtype.name} in non-native byte order ({a.dtype.str}); convert with "
                             f".astype(np.{spec.dtype})")
        if a.ndim != len(spec.shape):
            raise InputError(f"{name}: rank {a.ndim} (shape {list(a.shape)}), expected rank {len(spec.shape)} "
                             f"{list(spec.shape)}; add the batch axis with [None] for one sequence")
        for i, (got, want) in enumerate(zip(a.shape, spec.shape)):
            terms = _axis_terms(want)
            if isinstance(want, int) and want and got != want:
                raise InputError(f"{name}: axis {i} has size {got}, expected {want}")
            if terms and len(terms) > 1:
                sums.append((name, i, got, terms))
            elif terms:
                seen = sizes.setdefault(terms[0], (got, name))
                if seen[0] != got:
                    raise InputError(_mismatch(terms[0], name, a, seen, feeds))
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise InputError(f"{name}: holds NaN or infinite values; pass finite inputs (a cache fed back "
                             "from a previous step must be its present.* outputs unchanged)")
    for name, i, got, terms in sums:
        if all(t in sizes for t in terms) and got != sum(sizes[t][0] for t in terms):
            parts = " + ".join(f"{t} {sizes[t][0]}" for t in terms)
            raise InputError(f"{name}: shape {list(feeds[name].shape)}, expected {[*feeds[name].shape[:i], sum(sizes[t][0] for t in terms)]} "
                             f"({parts}); extend the previous mask by the new tokens")
    _check_values(feeds, sizes, limits)


def _mismatch(axis: str, name: str, a: np.ndarray, seen: tuple, feeds: dict) -> str:
    other = feeds[seen[1]]
    if axis in ("batch", "sequence") and a.ndim == 2 and other.ndim == 2:
        return (f"{name}: shape {list(a.shape)} differs from the other input's {list(other.shape)}; ids and mask "
                "must have the same (batch, sequence)")
    if axis == "past_sequence":
        return ("past_key_values: every layer's key and value must have one past length; feed back the previous "
                "step's present.* outputs unchanged")
    return (f"{name}: its {axis} axis is {a.shape} where {seen[1]} says {seen[0]}; inputs sharing an axis must "
            "agree on its size")


def _check_values(feeds: dict, sizes: dict, limits: ModelLimits | None) -> None:
    """Empty inputs, the sequence bound, token ids and the attention mask's values."""
    T = sizes.get("sequence", (None,))[0]
    P = sizes.get("past_sequence", (0,))[0]
    B = sizes.get("batch", (None,))[0]
    if T == 0 or B == 0:
        what = "empty prompt" if "past_sequence" in sizes else "empty input"
        raise InputError(f"{what} (input_ids of shape {[B, T]}): pass at least one token per sequence")
    if limits is not None and T is not None:
        if "past_sequence" in sizes and P + T > limits.max_sequence:
            raise InputError(f"{P} cached + {T} new tokens = {P + T} exceeds the KV cache bound {limits.max_sequence}; "
                             f"keep prompt plus generated tokens within {limits.max_sequence}")
        if "past_sequence" not in sizes and T > limits.max_sequence:
            raise InputError(f"sequence length {T} exceeds the model's maximum {limits.max_sequence}; "
                             f"truncate the input to {limits.max_sequence} tokens")
    ids = feeds.get("input_ids")
    if limits is not None and ids is not None and ids.size and (ids.min() < 0 or ids.max() >= limits.vocab_size):
        raise InputError(f"input_ids: values must lie in [0, {limits.vocab_size}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]; re-tokenise with the model's vocabulary")
    mask = feeds.get("attention_mask")
    if mask is not None and mask.size:
        if not np.isin(mask, (0, 1)).all():
            raise InputError(f"attention_mask: values must be 0 (padding) or 1 (a real token), got "
                             f"{sorted(set(np.unique(mask).tolist()) - {0, 1})[:3]}; pass a 0/1 mask")
        if (mask.reshape(len(mask), -1).sum(-1) == 0).any():
            row = int(np.flatnonzero(mask.reshape(len(mask), -1).sum(-1) == 0)[0])
            raise InputError(f"attention_mask: row {row} has no real token; every sequence needs at least one")
