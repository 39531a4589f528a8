"""What a bench point's report says: which program a call ran, and the latency ratios, realisation and
FLOPs per block."""
from __future__ import annotations

import os

import numpy as np

from adaptex.runtimes import cpu
from adaptex.runtimes.timing import Timing, fastest_dense, interval

# The artifact run as one session (an artifact with programs: runtimes/onnxruntime.py): what an app
# that loads the file in ONNX Runtime itself gets, timed beside the runner's way
ONE_SESSION = "adaptive-one-session"


def program_entry(meta: dict, feeds: dict) -> dict | None:
    """The metadata's entry of the program a call with these feeds runs (its name, variant and
    whether it attends every key masked), chosen by the guards the artifact stores; None for an
    artifact of one program."""
    if not meta.get("programs"):
        return None
    from adaptex.exporter.targets.onnx.guards import chosen, read_programs

    shapes = {k: np.shape(v) for k, v in feeds.items() if not isinstance(v, dict)}
    return meta["programs"][chosen(read_programs(meta), shapes)]


def bench_report(bench, graphs: list[Timing], flops: dict, *, batch, seq, past, threads, warmup, blocks,
            profiles, call_batch=None, distinct: int = 1, program: dict | None = None) -> dict:
    """FLOPs implied by the decisions (per sample: the saving the model asked for) and executed by the
    artifact (the dense variant everything; the sparse one, in a batch, the batch's largest count for
    every sample). Realisation is measured against the decisions, so work a lowering wastes counts
    against it; ratios per block, reported as the median and the min-max over blocks. call_batch: the
    samples a call held (fewer than batch where every graph ran the batch in chunks); distinct: the
    inputs the rounds cycled through; program: the metadata's entry of the program the call ran."""
    call_batch = call_batch or batch
    flops = dict(flops)
    flop_ratio = flops.pop("flop_ratio", None)
    executed_ratio = flops.pop("executed_flop_ratio", None)
    ad = graphs[0]
    fastest = fastest_dense(graphs)
    naive = next((t for t in graphs if t.name == "naive"), None)

    def per_block(t: Timing) -> list[float]:
        return [a / f for a, f in zip(ad.block_medians(), fastest.block_medians())] if fastest else []

    ratios = per_block(ad)
    lat_ratio = float(np.median(ratios)) if ratios else None
    realisations = [(1 - r) / (1 - flop_ratio) for r in ratios] if flop_ratio is not None and flop_ratio < 0.99 else []
    realisation = float(np.median(realisations)) if realisations else None
    naive_ratio = None
    if naive is not None and naive.times_ms and fastest:
        naive_ratio = float(np.median([a / f for a, f in zip(naive.block_medians(), fastest.block_medians())]))
    one = next((t for t in graphs if t.name == ONE_SESSION and t.times_ms), None)
    one_ratio = float(np.median([a / b for a, b in zip(one.block_medians(), ad.block_medians())])) if one else None
    warnings = []
    if ad.times_ms and len(ad.times_ms) < 100:
        warnings.append(f"{len(ad.times_ms)} runs per graph: p99 is close to the maximum; time more runs "
                        "(--runs) for tail percentiles")
    if blocks < 3:
        warnings.append(f"{blocks} block(s): the interval needs at least 3 (more --runs)")
    iv = interval(ratios)
    if iv and iv[0] <= 1 <= iv[1]:
        warnings.append("the latency ratio's interval reaches 1.0: no speed difference is established at this point")
    if realisation is not None and realisation > 1:
        warnings.append("realisation above 1: the artifact saves more time than its FLOPs predict; the FLOP model "
                        "leaves out memory-bound work (softmax, elementwise traffic): see --profile")
    cores = os.cpu_count() or 1
    if threads and threads > cores:
        warnings.append(f"{threads} threads on {cores} cores: the runs compete for cores")
    stats = {t.name: t.stats() for t in graphs}
    candidates = [{"name": t.name, "how": t.how, "dense": t.dense, "reason": t.reason,
                   "p50_ms": t.pct(50), "ratio_to_fastest": (t.pct(50) / fastest.pct(50))
                   if t.times_ms and fastest else None} for t in graphs[1:]]

    def p(t, q):
        return t.pct(q) if t is not None else None
    return {
        "artifact": bench.artifact, "runtime": bench.runtime, "cpu": cpu.describe(),
        "variant": bench.meta.get("variant"),
        "ran_variant": (program or {}).get("variant", bench.meta.get("variant")),
        "chunk_samples": call_batch if call_batch < batch else None,
        "chunk_rows": bench.chunks[1] if bench.chunks else None,
        "program": program["name"] if program else None,
        "family": bench.meta.get("family"), "batch": batch, "seq": seq, "past": past, "threads": threads,
        "runs": len(ad.times_ms), "warmup": warmup, "blocks": blocks, "distinct_inputs": distinct,
        "p50_ms": ad.pct(50), "p90_ms": ad.pct(90), "p99_ms": ad.pct(99),
        "throughput_seq_per_s": batch * 1000.0 / ad.pct(50),
        "dense_name": fastest.name if fastest else None, "dense_how": fastest.how if fastest else None,
        "dense_p50_ms": p(fastest, 50), "dense_p90_ms": p(fastest, 90), "dense_p99_ms": p(fastest, 99),
        "dense_reason": None if fastest else "; ".join(f"{t.name}: {t.reason}" for t in graphs if t.dense),
        "naive_p50_ms": p(naive, 50) if naive and naive.times_ms else None,
        "naive_p90_ms": p(naive, 90) if naive and naive.times_ms else None,
        "naive_p99_ms": p(naive, 99) if naive and naive.times_ms else None,
        "naive_reason": naive.reason if naive else "no naive path for this model",
        **flops,
        "flop_ratio": flop_ratio, "executed_flop_ratio": executed_ratio,
        "latency_ratio": lat_ratio, "latency_ratio_interval": iv,
        "realisation": realisation, "realisation_interval": interval(realisations),
        "naive_latency_ratio": naive_ratio, "one_session_ratio": one_ratio,
        "candidates": candidates, "stats": stats,
        "size_mb": {t.name: t.size_mb for t in graphs if t.size_mb is not None},
        "peak_rss_mb": {t.name: t.peak_rss_mb for t in graphs if t.peak_rss_mb is not None},
        "warnings": warnings, "profile": profiles,
    }
