"""What every command shares: one-line errors, messages on stderr, thread settings."""
from __future__ import annotations

import sys

from adaptex.graphs.errors import AdaptexError

EXIT_ERROR, EXIT_FAILED = 2, 1


class UsageError(AdaptexError):
    """A flag or argument the command cannot use, named with the fix."""


def err(msg: str) -> None:
    print(f"adaptex: error: {msg}", file=sys.stderr)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def set_threads(n: int | None) -> None:
    import torch

    from adaptex.runtimes.base import check_threads

    check_threads(n)
    if n:
        torch.set_num_threads(n)


def count(text: str) -> int:
    """An argparse type for whole numbers that also takes exact scientific notation (1e6)."""
    import argparse

    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if v != v or v in (float("inf"), float("-inf")) or v != int(v):
        raise argparse.ArgumentTypeError(f"invalid whole number: {text!r}")
    return int(v)


def add_memory_flag(s) -> None:
    s.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="the memory adaptex may plan for, e.g. 8G or 512M (default: half of this machine's, or "
                        "$ADAPTEX_MAX_MEMORY); larger requests are refused before any work, naming what fits")


def at_least(args, **bounds) -> None:
    """Refuse numeric flags below their bound, and NaN or infinite ones: at_least(args, samples=1)."""
    import math

    for name, low in bounds.items():
        v = getattr(args, name, None)
        flag = f"--{name.replace('_', '-')}"
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"{flag} {v}: must be a finite number (at least {low})")
        if v is not None and v < low:
            raise UsageError(f"{flag} {v}: must be at least {low}")


def load_model(spec: str | None):
    """A model for export, check or bench: a shipped name or checkpoint directory (None: the default
    model), or `package.module:function` naming a function of yours that returns the model, or the
    model and its example inputs. Returns (model, example inputs or None)."""
    import importlib
    import os

    if spec is not None and not spec.strip():
        raise UsageError("the model is an empty name; pass a shipped model ('adaptex models' lists them), a "
                         "checkpoint directory or MODULE:FUNCTION, or leave it out for the default model")
    if spec and ":" in spec and not os.path.exists(spec):
        mod_name, _, fn_name = spec.partition(":")
        if not mod_name.strip() or not fn_name.strip():
            raise UsageError(f"{spec}: MODULE:FUNCTION needs both names (my_package.models:build), or pass a "
                             "shipped model or a checkpoint directory")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError, ValueError, TypeError) as e:  # ValueError, TypeError: a name
            # importlib refuses as it stands (".relative" without a package)
            raise UsageError(f"{spec}: cannot import {fn_name!r} from {mod_name!r} ({e}); pass MODULE:FUNCTION "
                             "importable from here (set PYTHONPATH), or a checkpoint") from None
        if not callable(fn):
            raise UsageError(f"{spec}: {fn_name!r} is a {type(fn).__name__}, not a function; name a function that "
                             "returns the model (or the model and its example inputs)")
        built = fn()
        model, example = built if isinstance(built, tuple) else (built, None)
        if not hasattr(model, "forward"):
            raise UsageError(f"{spec} returned a {type(model).__name__}, not a torch module (or (module, "
                             "example_inputs))")
        return model.eval(), (tuple(example) if isinstance(example, (tuple, list)) else example)
    from adaptex.api import load

    return load(spec), None


def read_inputs(path: str | None, names: list[str] | None = None, batch: int = 8,
                specs: dict | None = None) -> list[dict] | None:
    """--inputs FILE.npz: arrays by input name (or arr_0, arr_1, ... in the model's argument order),
    sharing their first axis, the batch; split into batches of `batch` rows. specs (an artifact's
    metadata inputs): each array's rank is checked against its input's, on the whole array."""
    if path is None:
        return None
    import numpy as np

    try:
        data = np.load(path, allow_pickle=False)
    except Exception as e:
        raise UsageError(f"--inputs {path}: not a readable .npz of arrays ({type(e).__name__}); write one with "
                         "numpy.savez(path, input_ids=..., attention_mask=...)") from None
    try:
        arrays = dict(data.items())
    except ValueError as e:
        if "pickle" not in str(e):
            raise UsageError(f"--inputs {path}: an array cannot be read ({str(e)[:100]}); write it again with "
                             "numpy.savez") from None
        raise UsageError(f"--inputs {path}: holds a pickled (object) array, and adaptex never unpickles a file; "
                         "save numeric arrays (numpy.savez(path, input_ids=ids.astype('int64'), ...))") from None
    except Exception as e:
        raise UsageError(f"--inputs {path}: not a readable .npz of arrays ({type(e).__name__}); write one with "
                         "numpy.savez(path, input_ids=..., attention_mask=...)") from None
    if names and not set(names) <= set(arrays):
        if all(f"arr_{i}" in arrays for i in range(len(names))):
            arrays = {n: arrays[f"arr_{i}"] for i, n in enumerate(names)}
        else:
            raise UsageError(f"--inputs {path}: holds {sorted(arrays)}, the model takes {names}; name the arrays "
                             "after the inputs")
    keys = names or list(arrays)
    if not keys:
        raise UsageError(f"--inputs {path}: holds no arrays; write one with numpy.savez(path, input_ids=..., ...)")
    scalars = [k for k in keys if arrays[k].ndim == 0]
    if scalars:
        raise UsageError(f"--inputs {path}: {scalars[0]} is a scalar; every array needs a first axis, the batch")
    rows = {arrays[k].shape[0] for k in keys}
    if len(rows) != 1:
        raise UsageError(f"--inputs {path}: the arrays' first axes (the batch) differ: {sorted(rows)}")
    n = rows.pop()
    if n == 0:
        raise UsageError(f"--inputs {path}: the arrays hold no rows (a batch of 0); pass at least one input")
    for k in keys:
        spec = (specs or {}).get(k)
        rank = len(spec["shape"]) if isinstance(spec, dict) and isinstance(spec.get("shape"), list) else None
        if rank is not None and arrays[k].ndim != rank:
            axes = ", ".join(str(d) for d in spec["shape"])
            raise UsageError(f"--inputs {path}: {k} has shape {list(arrays[k].shape)} (rank {arrays[k].ndim}); this "
                             f"artifact takes {k} as [{axes}] (rank {rank})")
        if 0 in arrays[k].shape:
            raise UsageError(f"--inputs {path}: {k} has shape {list(arrays[k].shape)}, an axis of length 0 (a "
                             "sequence of no tokens); pass at least one token per row")
    return [{k: arrays[k][i:i + batch] for k in keys} for i in range(0, n, batch)]


class _Bar:
    """A tqdm bar on stderr (absent: every call does nothing)."""

    def __init__(self, bar):
        self.bar = bar

    def to(self, value):
        """A progress callback that moves the bar to value(arg) (e.g. the report's sample count)."""
        def update(arg) -> None:
            if self.bar is not None:
                self.bar.n = value(arg)
                self.bar.refresh()
        return update

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, msg: str) -> None:
        """A line above the bar (or on stderr when there is none)."""
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            say(msg)


def progress_bar(desc: str, total: int | None = None, unit: str = "it", enabled: bool = True):
    """A context manager yielding a _Bar: tqdm on stderr when enabled and stderr is a terminal
    (tqdm's disable=None), nothing otherwise (--quiet, --json, a log file)."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        bar = None
        if enabled:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False)
        try:
            yield _Bar(bar)
        finally:
            if bar is not None:
                bar.close()
    return cm()
