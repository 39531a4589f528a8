"""Large calls in chunks of whole samples (ONNX Runtime on a CPU). Imports numpy alone, so the
peak-memory worker (runtimes/_memworker.py) runs a call the way the runner does without torch."""
from __future__ import annotations

import numpy as np

# A call of more than CHUNK_ROWS token rows (batch x sequence) runs as calls of whole samples of at
# most CHUNK_ROWS rows each (at least one sample), its outputs joined on the batch axis: a chunk's
# activations stay in the CPU's caches from one kernel to the next, where a whole large batch streams
# every one through memory. Samples are computed independently, so the outputs are the same. Measured
# (2026-12-05, 1 thread, the runner's way, interleaved, whole batch = 1.000): elastic-minilm 0.80 at
# B64, T = 128 and 0.87 at B8, T = 512; elastic-charlm 0.85 and 0.75 at B64, T = 128 and 512;
# tsa-charlm 0.89 at B64, T = 128; budgetformer-graded 0.82 at B64, T = 128; B64, T = 32 even (0.996).
# The fastest dense graphs gain as much (elastic-minilm's yardstick 0.85 at B8, T = 512), so
# `adaptex bench` runs every graph this way (docs/benchmarking.md#how-it-times).
CHUNK_ROWS = 512


def sample_chunks(feeds: dict, rows_input: str, limit: int | None) -> list[slice] | None:
    """The slices of the batch a call of these feeds runs in (CHUNK_ROWS), or None to run it whole:
    with no limit, one sample, or at most `limit` rows (batch x axis 1 of `rows_input`)."""
    ids = feeds.get(rows_input)
    if not limit or ids is None or np.ndim(ids) < 1 or np.shape(ids)[0] < 2:
        return None
    batch, seq = np.shape(ids)[0], (np.shape(ids)[1] if np.ndim(ids) > 1 else 1)
    if batch * seq <= limit:
        return None
    n = max(1, limit // max(seq, 1))
    return [slice(i, i + n) for i in range(0, batch, n)]


def run_in_chunks(run, feeds: dict, chunks: list[slice] | None) -> list:
    """run(feeds) -> a list of batch-first outputs, called once per chunk of samples and joined on
    the batch axis (or once, where chunks is None)."""
    if chunks is None:
        return run(feeds)
    parts = [run({k: v[c] for k, v in feeds.items()}) for c in chunks]
    return [np.concatenate(same, axis=0) for same in zip(*parts)]


def chunk_plan(meta: dict, rows: int | None) -> tuple[str, int] | None:
    """(the input whose axis 1 counts a call's token rows, rows) for an artifact with this metadata,
    or None (no rows given, or not every input and output batch-first: its calls run whole).
    sample_chunks(feeds, *plan) then splits a call."""
    specs = [s for side in ("inputs", "outputs") for s in meta.get(side, {}).values()]
    if not rows or not specs or not all(isinstance(s, dict) and s.get("shape", [None])[:1] == ["batch"]
                                        for s in specs):
        return None
    return next(iter(meta["inputs"])), rows


def samples(n: int) -> str:
    """'1 sample', 'n samples' (bench's words for a chunk)."""
    return f"{n} sample{'' if n == 1 else 's'}"
