"""The runner interface every runtime implements (Polygraphy-like), and input validation.

Runtime imports (onnxruntime, coremltools, tensorrt) live inside the runner that needs them, so
`import runtimes` works without any of them installed.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from adaptex.graphs.errors import InputError


@dataclass(frozen=True)
class IOSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple  # ints, or names of dynamic axes


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

    @abc.abstractmethod
    def _infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def _activate(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


def validate_feeds(feeds: dict, specs: dict[str, IOSpec], limits: ModelLimits | None) -> None:
    """Raise InputError (one line: the problem and the fix) unless `feeds` fit the model."""
    missing = [n for n in specs if n not in feeds]
    unknown = [n for n in feeds if n not in specs]
    if missing or unknown:
        raise InputError(f"inputs must be exactly {sorted(specs)}: missing {missing}, unknown {unknown}")
    decoder = any(n.startswith("past_key_values.") for n in specs)
    batch_seq = None
    for name, spec in specs.items():
        a = feeds[name]
        if not isinstance(a, np.ndarray):
            raise InputError(f"{name}: expected a numpy array, got {type(a).__name__}")
        if a.dtype.name != spec.dtype:
            raise InputError(f"{name}: dtype {a.dtype.name}, expected {spec.dtype}; "
                             f"convert with .astype(np.{spec.dtype})")
        if a.ndim != len(spec.shape):
            raise InputError(f"{name}: rank {a.ndim} (shape {list(a.shape)}), expected rank {len(spec.shape)} "
                             f"{list(spec.shape)}; add the batch axis with [None] for one sequence")
        for i, (got, want) in enumerate(zip(a.shape, spec.shape)):
            if isinstance(want, int) and want and got != want:
                raise InputError(f"{name}: axis {i} has size {got}, expected {want}")
        if a.ndim == 2 and not decoder:
            if batch_seq is not None and a.shape != batch_seq:
                raise InputError(f"{name}: shape {list(a.shape)} differs from the other input's "
                                 f"{list(batch_seq)}; ids and mask must have the same (batch, sequence)")
            batch_seq = a.shape
    if decoder:
        return _validate_decoder(feeds, limits)
    if batch_seq is None or limits is None:
        return
    B, T = batch_seq
    if B == 0 or T == 0:
        raise InputError(f"empty input of shape {[B, T]}: pass at least one token per sequence")
    if T > limits.max_sequence:
        raise InputError(f"sequence length {T} exceeds the model's maximum {limits.max_sequence}; "
                         f"truncate the input to {limits.max_sequence} tokens")
    ids = feeds.get("input_ids")
    if ids is not None and (ids.min() < 0 or ids.max() >= limits.vocab_size):
        raise InputError(f"input_ids: values must lie in [0, {limits.vocab_size}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]; re-tokenise with the model's vocabulary")
    mask = feeds.get("attention_mask")
    if mask is not None and (mask.sum(-1) == 0).any():
        row = int(np.flatnonzero(mask.sum(-1) == 0)[0])
        raise InputError(f"attention_mask: row {row} has no real token; every sequence needs at least one")


def _validate_decoder(feeds: dict, limits: ModelLimits | None) -> None:
    """A decoder step: ids (B, T), past keys/values (B, H, P, dh), mask (B, P + T), P + T <= the cache bound."""
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    B, T = ids.shape
    if T == 0 or B == 0:
        raise InputError(f"empty prompt (input_ids of shape {[B, T]}): pass at least one token")
    pasts = {n: a for n, a in feeds.items() if n.startswith("past_key_values.")}
    shapes = {a.shape for a in pasts.values()}
    if len(shapes) != 1:
        raise InputError(f"past_key_values: every layer's key and value must have one shape, got {sorted(shapes)}; "
                         "feed back the previous step's present.* outputs unchanged")
    Bp, _, P, _ = next(iter(shapes))
    if Bp != B:
        raise InputError(f"past_key_values: batch {Bp} differs from input_ids' batch {B}")
    if mask.shape != (B, P + T):
        raise InputError(f"attention_mask: shape {list(mask.shape)}, expected {[B, P + T]} (past {P} + new {T} "
                         "tokens); extend the previous mask by the new tokens")
    if limits is None:
        return
    if P + T > limits.max_sequence:
        raise InputError(f"{P} cached + {T} new tokens = {P + T} exceeds the KV cache bound {limits.max_sequence}; "
                         f"keep prompt plus generated tokens within {limits.max_sequence}")
    if ids.min() < 0 or ids.max() >= limits.vocab_size:
        raise InputError(f"input_ids: values must lie in [0, {limits.vocab_size}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]; re-tokenise with the model's vocabulary")
