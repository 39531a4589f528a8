"""Every latency table in the docs, regenerated: each shipped model's ONNX artifact against the
fastest dense graph of its weights, over the grid the docs quote.

    python examples/latency_tables.py --out docs/results/epyc-avx512 --images docs/images   # the docs' grid
    python examples/latency_tables.py --models tsa-charlm --threads 1
    python examples/latency_tables.py --quick              # batch 1, two lengths: a smoke run, into build/

Grid: batch {1, 8, 64} x sequence {32, 128, 512} (each model up to its position limit), plus the
decoders' steps (one new token) after {127, 511} cached, at each batch. Each point is one
interleaved bench (runtimes/bench.py): every graph once per round in shuffled order, the rounds
cycling through distinct generated inputs (8, fewer at the largest points), the rounds in blocks,
ratios as the median and min-max over blocks. Every dense candidate is warmed up at every point and
the bench times those within 1.15x of the fastest in warm-up (the fastest at batch 1 is not always
the fastest at batch 8). A point too large for every graph's session at once (elastic-minilm's B64,
T = 512) is warmed up one graph at a time and times the graphs that fit in memory together.
Writes OUT/latency.md (the tables), OUT/latency.csv (every graph at every point) and
IMAGES/latency-<model>.png (batch 1 against T); docs/results/ holds one grid per CPU, a folder each.
The full grid at one thread takes 35 to 50 minutes on 2 cores. Each artifact is exported as a user
serving from this CPU would export it: with the softmax floor where it pays here
(`--softmax-floor auto`, runtimes/cpu.py; `on` or `off` forces it), and latency.md's head names the
CPU and this command.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("budgetformer-graded", "tsa-charlm", "charlm-dense", "elastic-minilm", "elastic-charlm")


def points(model, quick: bool) -> list[tuple[int, int, int]]:
    """(batch, new tokens, cached tokens) for the model, within its limits."""
    from adaptex.graphs.family import family_contract

    limit = model.cfg.max_len
    batches, seqs = ((1,), (32, 128)) if quick else ((1, 8, 64), (32, 128, 512))
    out = [(b, t, 0) for b in batches for t in seqs if t <= limit]
    if family_contract(model).decoder:
        out += [(b, 1, p) for b in batches for p in ((127,) if quick else (127, 511)) if p + 1 <= limit]
    return out


def cell(x, iv=None, spec=".3f") -> str:
    if x is None:
        return "n/a"
    return f"{x:{spec}} [{iv[0]:{spec}}, {iv[1]:{spec}}]" if iv else f"{x:{spec}}"


def table(rows: list[dict]) -> list[str]:
    out = ["| batch | T | past | adaptive ms | yardstick | yardstick ms | latency ratio [min, max] | FLOP ratio | "
           "realisation [min, max] | naive / yardstick |",
           "|---:|---:|---:|---:|---|---:|---|---:|---|---:|"]
    for r in rows:
        out.append(f"| {r['batch']} | {r['seq']} | {r['past']} | {r['p50_ms']:.3f} | {r['dense_name']} | "
                   f"{cell(r['dense_p50_ms'])} | {cell(r['latency_ratio'], r['latency_ratio_interval'])} | "
                   f"{cell(r['flop_ratio'])} | {cell(r['realisation'], r['realisation_interval'])} | "
                   f"{cell(r['naive_latency_ratio'])} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", default="1")
    ap.add_argument("--quick", action="store_true", help="batch 1, T 32 and 128, one decode point")
    ap.add_argument("--out", default=str(ROOT / "build" / "latency"),
                    help="where latency.md and latency.csv go (the docs' grids: docs/results/<cpu>)")
    ap.add_argument("--images", default=None, help="where the figures go (default OUT/images; the docs': docs/images)")
    ap.add_argument("--softmax-floor", choices=("auto", "on", "off"), default="auto",
                    help="export the artifacts with the softmax floor (auto: where it pays on this CPU)")
    args = ap.parse_args(argv)
    command = " ".join(["python examples/latency_tables.py", *(sys.argv[1:] if argv is None else argv)])
    import adaptex
    from adaptex.runtimes.bench import Bench
    from adaptex.runtimes.bench_report import plot
    from adaptex.runtimes.cpu import floor_probe

    floor = args.softmax_floor if args.softmax_floor != "auto" else ("on" if floor_probe()["pays"] else "off")

    threads = [int(t) for t in args.threads.split(",")]
    out = Path(args.out)
    images = Path(args.images) if args.images else out / "images"
    out.mkdir(parents=True, exist_ok=True)
    images.mkdir(parents=True, exist_ok=True)
    all_rows, lines, failed = [], [], []
    for name in args.models.split(","):
        model = adaptex.load(name)
        info = model.adaptex_source
        grid = points(model, args.quick)
        lines += [f"## {name}", ""]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{name}.onnx"
            adaptex.export(model, None, path, softmax_floor=floor)
            lines += [f"Exported with `--softmax-floor {floor}`.", ""]
            with Bench(path, model, info, progress=lambda m: print(f"  {m}", file=sys.stderr)) as bench:
                for thr in threads:
                    rows = []
                    for batch, seq, past in sorted(grid):
                        print(f"{name}: threads={thr} batch={batch} T={seq} past={past}", file=sys.stderr, flush=True)
                        try:
                            r = bench.run(batch=batch, seq=seq, past=past, threads=thr, warmup=3, min_runs=10,
                                          time_budget_s=6.0, memory=False)
                        except Exception as e:  # one failed point is a line in the table, not a lost run
                            failed.append(f"{name}: threads={thr} batch={batch} T={seq} past={past}: "
                                          f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
                            print(f"  failed: {failed[-1]}", file=sys.stderr)
                            continue
                        r["model"] = name
                        rows.append(r)
                    rows.sort(key=lambda r: (r["past"] > 0, r["batch"], r["seq"], r["past"]))
                    all_rows += rows
                    lines += [f"{thr} thread(s):", ""] + table(rows) + [""]
                    b1 = [r for r in rows if r["batch"] == 1 and r["past"] == 0]
                    if thr == threads[0] and len(b1) > 1:
                        plot(b1, images / f"latency-{name}.png", title=name)  # the panel names batch and threads
        write(out, lines, all_rows, failed, command)  # after each model: a later failure loses nothing
    print(f"wrote {out / 'latency.md'} and {out / 'latency.csv'}")
    return 1 if failed else 0


def write(out: Path, lines: list[str], rows: list[dict], failed: list[str], command: str) -> None:
    import onnxruntime

    import adaptex
    from adaptex.runtimes.bench_report import write_csv
    from adaptex.runtimes.cpu import describe

    head = [
        "# Latency tables",
        "",
        f"Generated by `{command}` on {datetime.date.today()} ({describe()}, "
        f"ONNX Runtime {onnxruntime.__version__}, adaptex {adaptex.__version__}). "
        "Each row is one interleaved bench: the adaptive ONNX artifact against the fastest of the dense graphs "
        "of the same weights (the yardstick column names it; docs/benchmarking.md lists the candidates), "
        "the rounds cycling through distinct generated inputs (8, fewer where their caches would hold more "
        "than 256 MB), every graph the same one in a round; "
        "medians, and the latency ratio and realisation as the median and [min, max] over blocks (5, or one "
        "per 5 rounds where fewer rounds fit a point's time: 2 at the largest points; latency.csv's `n` is "
        "each point's rounds). "
        "`past` > 0 rows are decode steps (one new token after `past` cached). The naive column is the "
        "stock export of the model's masked inference path, what a user gets without adaptex.",
        "",
    ]
    tail = ["## Points that failed", ""] + [f"- {f}" for f in failed] + [""] if failed else []
    (out / "latency.md").write_text("\n".join(head + lines + tail) + "\n")
    write_csv(rows, out / "latency.csv")


if __name__ == "__main__":
    sys.exit(main())
