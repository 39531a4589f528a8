"""`adaptex bench`: latency of an artifact against the fastest dense graph of the same weights."""
from __future__ import annotations

import json
from pathlib import Path

from adaptex.cli._util import (UsageError, add_memory_flag, at_least, load_model, progress_bar, read_inputs, say,
                               set_threads)
from adaptex.runtimes.base import check_threads
from adaptex.runtimes.chunks import CHUNK_ROWS


def add_parser(sub) -> None:
    s = sub.add_parser("bench", help="latency against the fastest dense graph of the same weights",
                       description="Time an artifact against every dense graph a user could ship for the same "
                                   "weights (stock and legacy exports, the original checkpoint's export, ONNX "
                                   "Runtime's transformer optimizer), interleaved in independent blocks; the "
                                   "fastest is the yardstick. Lists (--seq 32,128,512) sweep a grid.")
    s.add_argument("artifact")
    s.add_argument("--model", default=None,
                   help="the source: a checkpoint or shipped name, or MODULE:FUNCTION for a model of your own "
                        "(default: the checkpoint the artifact records)")
    s.add_argument("--inputs", default=None, help="an .npz of the inputs to time (a model of your own needs it)")
    s.add_argument("--batch", default="1", help="samples per run; a list such as 1,8,64 sweeps")
    s.add_argument("--seq", default="128", help="new tokens per run (a decoder's prefill length); a list such as "
                                                 "128,512,2048 sweeps the lengths")
    s.add_argument("--past", default="0",
                   help="decoders: cached tokens before the timed step (decode: --seq 1 --past 511); a list sweeps")
    s.add_argument("--threads", default="1",
                   help="ONNX Runtime intra-op threads (0: runtime default); a list such as 1,2 reports each")
    s.add_argument("--warmup", type=int, default=10)
    s.add_argument("--runs", type=int, default=None,
                   help="timed rounds per point (default: as many as fit in ~8 s, 30..500)")
    s.add_argument("--blocks", type=int, default=5,
                   help="independent blocks the rounds fall into; ratios are reported as the median and the "
                        "min-max over blocks (default 5)")
    s.add_argument("--distinct-inputs", type=int, default=None, metavar="N",
                   help="generated inputs the rounds cycle through, every graph the same one in a round, as an "
                        "app meets a new input each call (default 8, fewer for a large point; 1: one input "
                        "repeated; --inputs: those given)")
    s.add_argument("--profile", action="store_true",
                   help="ONNX Runtime's profiler on the adaptive graph and the yardstick: kernel time by op type, "
                        "adaptive ops against the rest")
    s.add_argument("--plot", default=None, metavar="PNG",
                   help="draw latency against sequence length (adaptive, yardstick, naive) with the realisation")
    s.add_argument("--csv", default=None, metavar="CSV", help="write every graph's figures at every point")
    s.add_argument("--chunk-rows", default=str(CHUNK_ROWS), metavar="N|off",
                   help="ONNX: a call of more token rows (batch x seq) runs in chunks of whole samples, every graph "
                        f"alike, as adaptex's runner runs the artifact (default {CHUNK_ROWS}; off: every call whole)")
    s.add_argument("--no-cache", action="store_true",
                   help="export the dense graphs again instead of reading them from the cache "
                        "(~/.cache/adaptex, or $ADAPTEX_CACHE_DIR)")
    s.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement (one process per graph)")
    s.add_argument("--compute-units", default=None, choices=["cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"],
                   help="Core ML packages on macOS: which units Core ML may use (default all)")
    s.add_argument("--quiet", action="store_true", help="no progress messages or bar")
    s.add_argument("--json", action="store_true")
    add_memory_flag(s)
    s.set_defaults(run=run)


def _ints(flag: str, text: str, low: int, example: str) -> list[int]:
    from adaptex.cli._util import count

    try:
        values = [count(x) for x in str(text).split(",")]
    except Exception:
        raise UsageError(f"{flag} {text!r}: expected a number or a comma-separated list (e.g. {flag} {example})") \
            from None
    if any(v < low for v in values):
        raise UsageError(f"{flag} {text!r}: every value must be at least {low}")
    return values


def _bound_points(meta: dict, batches: list[int], seqs: list[int], pasts: list[int]) -> None:
    """Refuse, before any setup, a point past the model's positions (every point, when there is one)
    or one whose inputs and activations would pass the memory limit, naming the largest that fits."""
    from adaptex.graphs import memory

    limit = meta.get("max_sequence")
    if isinstance(limit, int) and limit > 0 and all(s + p > limit for s in seqs for p in pasts):
        p = min(pasts)
        raise UsageError(f"--seq {','.join(map(str, seqs))}: above the model's limit of "
                         f"{limit} positions" + (f" with --past {p}" if p else "") + "; the largest --seq that fits "
                         f"is {max(limit - p, 0)}")
    sizes = memory.config_sizes(meta.get("config") or {})

    def need(B, T):
        return 3 * memory.activation_bytes(B, T, sizes["d"], sizes["heads"], sizes["layers"], backward=False)
    for B in batches:
        for T in seqs:
            for p in pasts:
                if need(B, 1 + p) > memory.limit():  # too large at any length: the batch
                    memory.require("--batch", B, lambda b: need(b, T + p), f"timing at --seq {T}")
                memory.require("--seq", T, lambda t: need(B, t + p), f"timing a batch of {B}")


def run(args) -> int:
    from adaptex.runtimes import coreml
    from adaptex.runtimes.bench import Bench
    from adaptex.runtimes.bench_report import format_bench, format_sweep, plot, write_csv
    from adaptex.runtimes.open import artifact_kind, open_artifact, read_metadata
    from adaptex.runtimes.source import load_source_model

    at_least(args, runs=1, warmup=0, blocks=1, distinct_inputs=1)
    seqs = _ints("--seq", args.seq, 1, "128,512,2048")
    batches = _ints("--batch", args.batch, 1, "1,8,64")
    pasts = _ints("--past", args.past, 0, "127,511")
    threads = _ints("--threads", args.threads, 0, "1,2")
    chunk_rows = None if str(args.chunk_rows).strip().lower() == "off" else \
        _ints("--chunk-rows", args.chunk_rows, 1, "512")
    if chunk_rows is not None and len(chunk_rows) > 1:
        raise UsageError(f"--chunk-rows {args.chunk_rows!r}: give one number of token rows, or off")
    for t in threads:  # every value before any point is timed
        check_threads(t)
    if not args.inputs:
        _bound_points(read_metadata(args.artifact), batches, seqs, pasts)
    kind = artifact_kind(args.artifact)
    if kind == "coreml" and not coreml.available():
        raise UsageError("Core ML latency needs the Core ML runtime (macOS); on this machine 'adaptex check' verifies "
                         "the package by MIL reference evaluation, and 'adaptex bench' times .onnx artifacts")
    if args.profile and kind != "onnx":
        raise UsageError("--profile reads ONNX Runtime's profiler: it applies to .onnx artifacts")
    runner = open_artifact(args.artifact, threads[0], args.compute_units)
    set_threads(threads[0])
    progress = None if args.json or args.quiet else say
    feeds, contract = None, None
    if args.model and ":" in args.model or args.inputs:  # a model of your own: its inputs, timed as given
        from adaptex.api import _feeds, _reference

        if len(seqs) * len(batches) * len(pasts) > 1:
            raise UsageError("--inputs times the inputs as given: drop the --seq/--batch/--past lists")
        inputs = read_inputs(args.inputs, list(runner.meta["inputs"]), batch=10**9,
                             specs=runner.meta["inputs"]) if args.inputs else None
        model = load_model(args.model)[0] if args.model else None
        _, reference, fl, info = _reference(args.artifact, model, _feeds(inputs, list(runner.meta["inputs"]))
                                            if inputs else None, threads[0])
        model, contract, feeds = reference.model, reference.contract, (fl[0] if fl else None)
    else:
        model, info = load_source_model(runner.meta, args.model)
    limit = getattr(getattr(model, "cfg", None), "max_len", None)
    rows, skipped = [], []
    points = [(t, b, s, p) for t in threads for b in batches for p in pasts for s in seqs]
    with Bench(args.artifact, model, info, contract=contract, compute_units=args.compute_units or "all",
               progress=progress, cache=not args.no_cache, chunk_rows=chunk_rows[0] if chunk_rows else None) as bench, \
            progress_bar("bench", total=len(points), unit="point",
                         enabled=len(points) > 1 and progress is not None) as bar:
        for i, (thr, B, T, past) in enumerate(points):
            bar.step(0)
            if limit and T + past > limit and feeds is None and len(points) > 1:  # one point: its error
                skipped.append(f"batch={B} T={T} past={past}: above the model's limit of {limit} positions; not run")
                continue
            if len(points) > 1 and progress:
                progress(f"--- point {i + 1}/{len(points)}: threads={thr} batch={B} T={T}"
                         + (f" past={past}" if past else "") + " ---")
            r = bench.run(batch=B, seq=T, past=past, threads=thr, feeds=feeds, warmup=args.warmup, runs=args.runs,
                          blocks=args.blocks, memory=not args.no_memory, profile=args.profile,
                          **({"distinct": args.distinct_inputs} if args.distinct_inputs else {}))
            rows.append(r)
            bar.step()
            if not args.json:
                print(format_bench(r), flush=True)
    if not rows:
        raise UsageError(f"every point is above the model's limit of {limit} positions: lower --seq/--past")
    if args.csv:
        write_csv([{"model": Path(args.artifact).name, **r} for r in rows], args.csv)
    if args.plot:
        plot(rows, args.plot, title=f"{args.artifact}: adaptive against the fastest dense graph")
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 and not skipped else {"sweep": rows, "skipped": skipped}, indent=2))
    elif len(points) > 1:
        print(f"sweep: {args.artifact} against the fastest dense graph at each point")
        print(format_sweep(rows, skipped))
    if args.csv and not args.json:
        print(f"wrote {args.csv}")
    if args.plot and not args.json:
        print(f"wrote {args.plot}")
    return 0
