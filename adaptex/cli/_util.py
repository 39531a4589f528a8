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

    if n:
        torch.set_num_threads(n)


def at_least(args, **bounds) -> None:
    """Refuse numeric flags below their bound: at_least(args, samples=1, threads=0)."""
    for name, low in bounds.items():
        v = getattr(args, name, None)
        if v is not None and v < low:
            raise UsageError(f"--{name.replace('_', '-')} {v}: must be at least {low}")
