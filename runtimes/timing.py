"""A graph's timings and the choices made from warm-up: which graphs are timed, and the fastest."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from adaptex.graphs.errors import AdaptexError

PRUNE_FACTOR = 1.15  # a dense candidate this much slower than the fastest in warm-up is not timed


@dataclass
class Timing:
    name: str
    path: str | None
    how: str = ""
    dense: bool = True  # a candidate for the yardstick
    times_ms: list = field(default_factory=list)
    block_of: list = field(default_factory=list)  # the block each time belongs to
    reason: str | None = None  # why there is no measurement
    peak_rss_mb: float | None = None
    size_mb: float | None = None

    def pct(self, q: float) -> float | None:
        return float(np.percentile(self.times_ms, q)) if self.times_ms else None

    def block_medians(self) -> list[float]:
        t, b = np.asarray(self.times_ms), np.asarray(self.block_of)
        return [float(np.median(t[b == i])) for i in sorted(set(self.block_of))]

    def stats(self) -> dict | None:
        if not self.times_ms:
            return None
        t = np.asarray(self.times_ms)
        return {"n": int(t.size), "mean_ms": float(t.mean()), "std_ms": float(t.std(ddof=1)) if t.size > 1 else 0.0,
                "min_ms": float(t.min()), "p50_ms": self.pct(50), "p90_ms": self.pct(90), "p95_ms": self.pct(95),
                "p99_ms": self.pct(99), "max_ms": float(t.max())}


def warm_up(live: list[Timing], fns: dict, inputs: list[dict], warmup: int,
            clock=time.perf_counter) -> dict[str, float]:
    """Each graph's best warm-up time in ms. Its first run allocates and runs alone; the rest are
    interleaved in shuffled rounds like the timed ones, so that a burst of load on a shared machine
    slows every graph alike instead of pruning the fastest candidate. Round r runs inputs[r % len]."""
    ts: dict[str, list[float]] = {t.name: [] for t in live}
    order = np.random.default_rng(1)
    for r in range(max(warmup, 1)):
        for i in (range(len(live)) if r == 0 else order.permutation(len(live))):
            t = live[i]
            t0 = clock()
            fns[t.name](inputs[r % len(inputs)])
            ts[t.name].append((clock() - t0) * 1e3)
    return {name: min(v[1:] or v) for name, v in ts.items()}


def prune_slow(live: list[Timing], warm: dict[str, float]) -> list[Timing]:
    """Drop the dense candidates whose warm-up is above PRUNE_FACTOR x the fastest dense one's; each
    dropped one records why (and its figure) in its reason."""
    dense = [warm[t.name] for t in live if t.dense]
    if not dense:
        return live
    best = min(dense)
    for t in live:
        if t.dense and warm[t.name] > PRUNE_FACTOR * best:
            t.reason = (f"not timed: {warm[t.name]:.2f} ms in warm-up, {warm[t.name] / best:.2f}x the "
                        f"fastest dense candidate (pruned above {PRUNE_FACTOR}x)")
    return [t for t in live if t.reason is None]


def fit_memory(live: list[Timing], warm: dict[str, float], need: dict[str, float], budget_mb: float) -> list[Timing]:
    """The graphs whose sessions fit in `budget_mb` together (`need`: each one's MB at this point),
    chosen in this order: the adaptive artifact, the dense candidates fastest first (`warm`: warm-up
    ms), then the graphs reported beside them (naive, the artifact in one session). One left out
    records why in its reason. Raises AdaptexError when the artifact and the fastest dense
    candidate do not fit on their own: then there is no ratio to measure here."""
    order = sorted(live, key=lambda t: (t.name != "adaptive", not t.dense, warm[t.name]))
    used, kept = 0.0, []
    for t in order:
        if used + need[t.name] <= budget_mb:
            kept.append(t.name)
            used += need[t.name]
        else:
            t.reason = (f"not timed: its session took {need[t.name]:.0f} MB at this point; beside the "
                        f"{used:.0f} MB of the graphs chosen before it, more than the {budget_mb:.0f} MB "
                        f"the timed sessions may take together")
    essential = [t for t in order if t.name == "adaptive"] + [t for t in order if t.dense][:1]
    if any(t.name not in kept for t in essential):
        raise AdaptexError(f"this point needs about {sum(need[t.name] for t in essential):.0f} MB for the artifact "
                           f"and the fastest dense graph together, more than the {budget_mb:.0f} MB available for "
                           f"them here; lower --batch or --seq")
    return [t for t in live if t.name in kept]


def fastest_dense(graphs: list[Timing]) -> Timing | None:
    timed = [t for t in graphs if t.dense and t.times_ms]
    return min(timed, key=lambda t: t.pct(50)) if timed else None


def interval(values: list[float]) -> list[float] | None:
    return [float(min(values)), float(max(values))] if len(values) > 1 else None
