"""`adaptex bench`: latency of an artifact against the dense graphs of the same weights."""
from __future__ import annotations

import json

from adaptex.cli._util import UsageError, at_least, load_model, read_inputs, say, set_threads


def add_parser(sub) -> None:
    s = sub.add_parser("bench", help="latency against the dense counterpart and the naive export")
    s.add_argument("artifact")
    s.add_argument("--model", default=None,
                   help="the source: a checkpoint or shipped name, or MODULE:FUNCTION for a model of your own "
                        "(default: the checkpoint the artifact records)")
    s.add_argument("--inputs", default=None, help="an .npz of the inputs to time (a model of your own needs it)")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--seq", default="128", help="new tokens per run (a decoder's prefill length); a list such as "
                                                 "128,512,2048 sweeps the lengths")
    s.add_argument("--past", type=int, default=0,
                   help="decoders: cached tokens before the timed step (decode: --seq 1 --past N)")
    s.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (0: runtime default)")
    s.add_argument("--warmup", type=int, default=10)
    s.add_argument("--runs", type=int, default=None, help="timed rounds (default: as many as fit in ~8 s, 30..500)")
    s.add_argument("--compute-units", default=None, choices=["cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"],
                   help="Core ML packages on macOS: which units Core ML may use (default all)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=run)


def _lengths(text: str) -> list[int]:
    try:
        seqs = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--seq {text!r}: expected a length or a comma-separated list (e.g. --seq 128,512,2048)") from None
    if any(s < 1 for s in seqs):
        raise UsageError(f"--seq {text!r}: every length must be at least 1")
    return seqs


def run(args) -> int:
    from adaptex.runtimes import coreml
    from adaptex.runtimes.bench import format_bench, run_bench
    from adaptex.runtimes.open import artifact_kind, open_artifact
    from adaptex.runtimes.source import load_source_model

    at_least(args, runs=1, warmup=0, threads=0, past=0, batch=1)
    seqs = _lengths(args.seq)
    if artifact_kind(args.artifact) == "coreml" and not coreml.available():
        raise UsageError("Core ML latency needs the Core ML runtime (macOS); on this machine 'adaptex check' verifies "
                         "the package by MIL reference evaluation, and 'adaptex bench' times .onnx artifacts")
    runner = open_artifact(args.artifact, args.threads, args.compute_units)
    set_threads(args.threads)
    if args.model and ":" in args.model or args.inputs:  # a model of your own: its inputs, timed as given
        from adaptex.api import _feeds, bench

        model = load_model(args.model)[0] if args.model else None
        inputs = read_inputs(args.inputs, list(runner.meta["inputs"]), batch=10**9)
        r = bench(args.artifact, model, _feeds(inputs, list(runner.meta["inputs"])) if inputs else None,
                  threads=args.threads, warmup=args.warmup, runs=args.runs, progress=None if args.json else say)
        print(json.dumps(r, indent=2) if args.json else format_bench(r))
        return 0
    model, info = load_source_model(runner.meta, args.model)
    if len(seqs) > 1:
        return _sweep(args, model, info, seqs)
    r = run_bench(args.artifact, model, info, batch=args.batch, seq=seqs[0], threads=args.threads,
                  warmup=args.warmup, runs=args.runs, progress=None if args.json else say,
                  compute_units=args.compute_units or "all", past=args.past)
    print(json.dumps(r, indent=2) if args.json else format_bench(r))
    return 0


def _sweep(args, model, info, seqs: list[int]) -> int:
    """One bench per length; lengths above the model's limit are reported, not run."""
    from adaptex.runtimes.bench import format_bench, format_sweep, run_bench

    rows, skipped = [], []
    for T in seqs:
        if T + args.past > model.cfg.max_len:
            skipped.append(f"T={T}: above the model's limit of {model.cfg.max_len} positions; not run")
            continue
        say(f"--- T={T} ---")
        r = run_bench(args.artifact, model, info, batch=args.batch, seq=T, threads=args.threads, warmup=args.warmup,
                      runs=args.runs, progress=None if args.json else say, past=args.past)
        rows.append(r)
        if not args.json:
            print(format_bench(r))
    if args.json:
        print(json.dumps({"sweep": rows, "skipped": skipped}, indent=2))
    else:
        print(f"sweep: {args.artifact} against the dense graph (batch {args.batch}, {args.threads} thread(s))")
        print(format_sweep(rows, skipped))
    return 0
