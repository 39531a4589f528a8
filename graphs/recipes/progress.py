"""Training progress on stderr, through tqdm: a live bar on a terminal, a line every 30 s in a log."""
from __future__ import annotations

import sys


class Progress:
    """`update(step, **fields)` moves the bar to `step` and shows the fields beside it."""

    def __init__(self, total: int, desc: str, stream=None, quiet: bool = False):
        from tqdm.auto import tqdm

        stream = stream or sys.stderr
        tty = hasattr(stream, "isatty") and stream.isatty()
        self.bar = None if quiet else tqdm(total=total, desc=desc.strip(), file=stream, dynamic_ncols=tty,
                                           mininterval=0.5 if tty else 30.0, ascii=not tty)

    def update(self, step: int, **fields):
        if self.bar is None:
            return
        if fields:
            self.bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in fields.items()},
                                 refresh=False)
        self.bar.update(step - self.bar.n)
        if step >= self.bar.total:
            self.bar.close()
