"""Training progress on stderr."""
from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr (a plain log line every 10% when stderr is not a tty)."""

    def __init__(self, total: int, desc: str, stream=None):
        self.total, self.desc, self.stream = total, desc, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.last_decile = -1

    def update(self, step: int, **fields):
        frac = step / self.total
        extra = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(frac, 1e-9) - elapsed
        line = f"{self.desc} {step}/{self.total} [{elapsed:5.0f}s<{eta:4.0f}s] {extra}"
        if self.tty:
            bar = "#" * int(20 * frac)
            self.stream.write(f"\r{self.desc} [{bar:<20}] {line[len(self.desc) + 1:]}\033[K")
            if step == self.total:
                self.stream.write("\n")
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()
