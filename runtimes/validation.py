"""Export's own check: the artifact just written runs against the eager model before it takes its name.

The artifact is written beside its target under a staging name, checked (runtimes/parity.py, decisions
first), and only then moved into place; one that fails is moved to `<stem>.failed<suffix>` (kept for
`adaptex check` and `inspect`) and the export raises `ValidationFailed` with the check's report, so a
wrong artifact never sits at the name an app loads. The inputs:
- a shipped model: its family's generated parity inputs (varied batches, lengths, padding,
  difficulty), VALIDATION_SAMPLES[target] sequences;
- a model of your own: the example inputs and variations derived from them through the metadata's
  named axes: batch 1 and one more than the example, each sequence-like axis at 1, half and twice
  its length, and, for every input that reaches an adaptex op's key mask (exporter.trace.mask_inputs)
  and holds only 0 and 1, padded tails on every row but the first. A variation the eager model
  itself refuses (a length past its position table) is left out.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from adaptex.graphs import files
from adaptex.graphs.errors import AdaptexError

# A shipped model's generated sequences, by target: about 10% of the export's CPU time (budgetformer-graded
# ONNX: 1.4 s of 11 s; elastic-minilm Core ML, whose MIL evaluation is numpy: 32 took 16 s of 65 s)
VALIDATION_SAMPLES = {"onnx": 32, "tensorrt": 32, "coreml": 16, "openvino": 32}


class ValidationFailed(AdaptexError):
    """The artifact an export wrote does not compute what the eager model does; `report` says where."""

    def __init__(self, message: str, report=None, failed_path: Path | None = None):
        super().__init__(message)
        self.report, self.failed_path = report, failed_path


def failed_name(out: Path) -> Path:
    """Where an artifact that failed its check is kept: `model.onnx` -> `model.failed.onnx`."""
    return out.with_name(f"{out.stem}.failed{out.suffix}")


def _resized(feeds: dict[str, np.ndarray], shapes: dict[str, list], axis_name: str, size: int) -> dict:
    """`feeds` with every axis named `axis_name` cut to `size`, or grown by repeating its entries."""
    out = {}
    for name, a in feeds.items():
        for axis, dim in enumerate(shapes[name]):
            if dim == axis_name and a.shape[axis] != size:
                a = np.take(a, np.arange(size) % a.shape[axis], axis=axis)
        out[name] = a
    return out


def _padded(feeds: dict[str, np.ndarray], shapes: dict[str, list], masks: list[str], batch) -> dict | None:
    """`feeds` with the mask inputs' last sequence-like axis padded at the tail, each row but the first
    shorter than the one before (at least one real token a row); None if there is nothing to pad."""
    out, changed = dict(feeds), False
    for name in masks:
        a = np.array(feeds[name])
        axes = [i for i, d in enumerate(shapes[name]) if isinstance(d, str) and d != batch]
        if not axes or a.ndim < 2 or a.shape[0] < 2:
            continue
        axis, T, B = axes[-1], a.shape[axes[-1]], a.shape[0]
        for b in range(1, B):
            keep = max(1, T - (b * T) // B)
            index = [b] + [slice(None)] * (a.ndim - 1)
            index[axis] = slice(keep, None)
            a[tuple(index)] = 0
            changed = changed or keep < T
        out[name] = a
    return out if changed else None


def derived_inputs(meta: dict, example: tuple) -> list[dict[str, np.ndarray]]:
    """The example (one array or tensor per input, in the metadata's order) and its variations."""
    names = list(meta["inputs"])
    base = {n: (a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)) for n, a in zip(names, example)}
    shapes = {n: meta["inputs"][n]["shape"] for n in names}
    first = shapes[names[0]]
    batch = first[0] if first and isinstance(first[0], str) else None
    variants, wider = [base], None
    if batch is not None:
        B = base[names[0]].shape[0]
        wider = _resized(base, shapes, batch, B + 1)
        variants += [_resized(base, shapes, batch, 1)] if B != 1 else []
        variants.append(wider)
    axes = dict.fromkeys(d for n in names for d in shapes[n] if isinstance(d, str) and d != batch and d.isidentifier())
    for axis_name in axes:
        n = next(n for n in names if axis_name in shapes[n])
        T = base[n].shape[shapes[n].index(axis_name)]
        variants += [_resized(base, shapes, axis_name, t) for t in sorted({1, max(1, T // 2), 2 * T} - {T})]
    masks = [n for n in names if meta["inputs"][n].get("mask") and np.isin(base[n], (0, 1)).all()]
    padded = [_padded(v, shapes, masks, batch) for v in (base, wider) if v is not None]
    return variants + [p for p in padded if p is not None]


def _runs_eagerly(model, contract, feeds: dict[str, np.ndarray], names: list[str]) -> bool:
    """Whether the eager model takes these inputs (a derived length may pass its position table)."""
    import torch

    from adaptex.graphs.nn import adaptive_mode

    try:
        with torch.no_grad(), adaptive_mode("hard"):
            contract.call(model, tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names), "hard")
        return True
    except Exception:
        return False


def validation_inputs(meta: dict, model, contract, example) -> list[dict[str, np.ndarray]] | None:
    """What export checks its artifact on: None for a shipped model (its family generates them)."""
    if example is None:
        return None
    names = list(meta["inputs"])
    try:  # the contract's example: one tensor per input in the artifact's order, keyword arguments included
        example = contract.example_inputs()
    except NotImplementedError:
        pass
    return [f for f in derived_inputs(meta, example) if _runs_eagerly(model, contract, f, names)]


@contextlib.contextmanager
def staged(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a path to write the artifact at (in a work directory beside `out`, under `out`'s own
    name); the caller then calls `promote` or `reject` on it. The work directory goes on exit."""
    out = Path(out).absolute()
    files.recover(out)
    with files.owned(files.fresh_name(out.parent, files.sibling_prefix(out)), files.make_dir) as work:
        yield work / out.name


def _swap(new: Path, out: Path) -> None:
    """Put `new` at `out`; an existing `out` moves aside first and goes only once `new` is in place."""
    if out.is_dir() and not out.is_symlink():
        old = new.parent / "old"
        os.replace(out, old)
        try:
            os.replace(new, out)
        except BaseException:
            os.replace(old, out)
            raise
    else:
        os.replace(new, out)


def promote(staged_path: Path, out: str | os.PathLike, beside: tuple[Path, ...] = ()) -> None:
    """The checked artifact into place at `out`, the files it brings beside it (an IR's weights)
    first: an artifact in place always has them."""
    out = Path(out).absolute()
    for c in beside:
        _swap(staged_path.with_name(Path(c).name), Path(c).absolute())
    _swap(staged_path, out)


def reject(staged_path: Path, out: str | os.PathLike, beside: tuple[Path, ...] = ()) -> Path:
    """The artifact that failed its check to `failed_name(out)` (and the files beside it to theirs);
    returns that path."""
    failed = failed_name(Path(out).absolute())
    for c in beside:
        _swap(staged_path.with_name(Path(c).name), failed_name(Path(c).absolute()))
    _swap(staged_path, failed)
    return failed
