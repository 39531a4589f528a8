"""How bench's results read: the text report of one point and of a sweep, the profile, the CSV and
the plot (runtimes/bench.py measures them)."""
from __future__ import annotations

from pathlib import Path

from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.bench_accounting import ONE_SESSION
from adaptex.runtimes.chunks import samples

# --- printing ----------------------------------------------------------------------------------------

def _f(x, spec="8.3f"):
    return format(x, spec) if x is not None else "n/a".rjust(int(spec.split(".")[0] or 0))


def _iv(x, iv, spec=".3f") -> str:
    if x is None:
        return "n/a"
    return f"{x:{spec}} [{iv[0]:{spec}}, {iv[1]:{spec}}]" if iv else f"{x:{spec}} (one block: no interval)"


def format_bench(r: dict) -> str:
    variant = r["variant"]
    if r.get("program"):
        variant += f"; this call ran its {r['program']} program ({r['ran_variant']})"
    lines = [f"bench: {r['artifact']} ({variant}) on {r['runtime']}, {r['cpu']}" if r.get("cpu") else
             f"bench: {r['artifact']} ({variant}) on {r['runtime']}",
             f"  batch={r['batch']} seq={r['seq']}" + (f" past={r['past']}" if r.get("past") else "")
             + f" threads={r['threads']}: {r['runs']} rounds in {r['blocks']} interleaved block(s) "
             f"(order shuffled each round), after {r['warmup']} warm-up runs each"
             + (f"; {r['distinct_inputs']} distinct inputs in turn, every graph the same one in a round"
                if r["distinct_inputs"] > 1 else "; one input repeated")
             + (f"; every graph ran the batch in calls of at most {samples(r['chunk_samples'])} "
                f"({r['chunk_rows']} token rows; --chunk-rows off: whole)" if r.get("chunk_samples") else ""),
             f"  {'graph':<24} {'p50 ms':>8} {'p90 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'mean':>8} {'std':>7} {'min':>8} "
             f"{'vs fastest':>10} {'size MB':>8} {'peak RSS MB':>11}"]
    untimed = []
    for name in ["adaptive"] + [c["name"] for c in r["candidates"]]:
        s = r["stats"].get(name)
        cand = next((c for c in r["candidates"] if c["name"] == name), None)
        if s is None:
            untimed.append(f"    {name}: {cand['reason'] if cand else 'not timed'}")
            continue
        ratio = cand["ratio_to_fastest"] if cand else (r["p50_ms"] / r["dense_p50_ms"] if r["dense_p50_ms"] else None)
        mark = "  <- yardstick" if name == r["dense_name"] else ""
        lines.append(f"  {name:<24} {s['p50_ms']:8.3f} {s['p90_ms']:8.3f} {s['p95_ms']:8.3f} {s['p99_ms']:8.3f} {s['mean_ms']:8.3f} "
                     f"{s['std_ms']:7.3f} {s['min_ms']:8.3f} {_f(ratio, '10.3f')} "
                     f"{_f(r['size_mb'].get(name), '8.2f')} {_f(r['peak_rss_mb'].get(name), '11.1f')}{mark}")
    if untimed:
        lines += ["  not timed:"] + untimed
    if r["dense_name"]:
        lines.append(f"  yardstick: {r['dense_name']}, the fastest dense graph ({r['dense_how']})")
    else:
        lines.append(f"  no dense graph could be timed: {r['dense_reason']}")
    if "sa_fraction" in r:
        layers = ", ".join(f"{x:.2f}" for x in r["sa_fraction_per_layer"])
        lines.append(f"  SA heads: {100 * r['sa_fraction']:.1f}% (per layer: {layers}); dense = every head full attention")
    elif "keep_rate_per_block" in r:
        rates = ", ".join(f"{k:.2f}" for k in r["keep_rate_per_block"])
        step = f"decode step: {r['seq']} new tokens after {r['past']} cached" if r.get("past") else "prefill"
        lines.append(f"  {step}; tokens running each gated block's queries and FFN: {rates}")
    elif "mean_k_per_layer" in r:
        lines.append(f"  mean k per layer: {', '.join(f'{k:.2f}' for k in r['mean_k_per_layer'])}")
    if r["flop_ratio"] is not None:
        lines.append(f"  FLOP ratio implied by the decisions: {r['flop_ratio']:.3f}   (executed by this "
                     f"{r.get('ran_variant', r['variant'])} graph: {r['executed_flop_ratio']:.3f})")
    else:
        lines.append("  FLOP ratio: no FLOP model for this model (the latency ratio stands alone)")
    lines.append(f"  latency ratio (adaptive / yardstick), median [min, max] over blocks: "
                 f"{_iv(r['latency_ratio'], r['latency_ratio_interval'])}")
    lines.append(f"  realisation (1 - latency ratio) / (1 - FLOP ratio): "
                 f"{_iv(r['realisation'], r['realisation_interval'])}")
    if r.get("naive_latency_ratio") is not None:
        lines.append(f"  naive export / yardstick: {r['naive_latency_ratio']:.3f}")
    if r.get("one_session_ratio") is not None:
        lines.append(f"  the artifact in one session (its Ifs choosing the program, as an app that loads the file "
                     f"itself runs it) / adaptive: {r['one_session_ratio']:.3f}")
    if r.get("softmax_floor"):
        lines.append(format_floor(r["softmax_floor"]))
    if r.get("profile"):
        lines.append(format_profile(r["profile"]))
    lines += [f"  note: {w}" for w in r.get("warnings", [])]
    return "\n".join(lines)


def format_floor(f: dict) -> str:
    """Whether the softmax floor pays on this CPU, and what to export (runtimes/cpu.py, floor_probe)."""
    shape = ", ".join(map(str, f["shape"]))
    verdict = "pays" if f["pays"] else "costs"
    advice = ("keep it" if f["in_artifact"] else "export with --softmax-floor on for this CPU") if f["pays"] else \
        ("export with --softmax-floor off for this CPU" if f["in_artifact"] else "as exported")
    return (f"  softmax floor: {'in' if f['in_artifact'] else 'not in'} this artifact; this CPU ran a causal ({shape}) "
            f"Softmax in {f['plain_ms']:.3f} ms plain, {f['floored_ms']:.3f} ms floored: the floor {verdict} here "
            f"({advice})")


def format_profile(profiles: dict, top: int = 12) -> str:
    lines = ["  profile (ONNX Runtime's profiler, medians per run: kernel ms and kernels by op type):"]
    for name, p in profiles.items():
        lines.append(f"    {name}: {p['total_ms']:.3f} ms in {p['kernels']} kernels (adaptive ops "
                     f"{p['adaptive_ms']:.3f}, the rest {p['rest_ms']:.3f}), {p['outside_ms']:.3f} ms "
                     f"outside them, of a {p['run_ms']:.3f} ms run")
        for op, ms in list(p["by_op_ms"].items())[:top]:
            lines.append(f"      {op:<32} {ms:8.3f}  {100 * ms / max(p['total_ms'], 1e-9):5.1f}%  "
                         f"{p['by_op_kernels'][op]:>5}")
    return "\n".join(lines)


def format_sweep(rows: list[dict], skipped: list[str]) -> str:
    """The artifact against the yardstick at each point, and where the curves cross."""
    lines = [f"  {'thr':>3} {'B':>4} {'T':>5} {'past':>5} {'adaptive ms':>11} {'dense ms':>9} {'yardstick':<22} "
             f"{'ratio [min, max]':>22} {'FLOP ratio':>10} {'realisation':>11}"]
    for r in rows:
        iv = r["latency_ratio_interval"]
        ratio = (f"{r['latency_ratio']:.3f} [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else _f(r["latency_ratio"], "6.3f")) \
            if r["latency_ratio"] is not None else "n/a"
        lines.append(f"  {r['threads']:3d} {r['batch']:4d} {r['seq']:5d} {r.get('past', 0):5d} {r['p50_ms']:11.3f} "
                     f"{_f(r['dense_p50_ms'], '9.3f')} {str(r['dense_name']):<22} {ratio:>22} "
                     f"{_f(r['flop_ratio'], '10.3f')} {_f(r['realisation'], '11.3f')}")
    lines += [f"  {s}" for s in skipped]
    groups = {}
    for r in rows:
        if r["latency_ratio"] is not None:
            groups.setdefault((r["threads"], r["batch"], r.get("past", 0)), []).append(r)
    for (thr, B, past), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["seq"])
        if len(rs) < 2:
            continue
        cross = [(x["seq"], y["seq"]) for x, y in zip(rs, rs[1:]) if (x["latency_ratio"] < 1) != (y["latency_ratio"] < 1)]
        where = f"threads={thr} batch={B}" + (f" past={past}" if past else "")
        if cross:
            spans = "; ".join(f"between T={x} and T={y}" for x, y in cross)
            lines.append(f"  {where}: the curves cross {spans}; the adaptive graph is "
                         f"{'faster' if rs[-1]['latency_ratio'] < 1 else 'slower'} from T={cross[-1][1]}")
        else:
            lines.append(f"  {where}: no crossing; the adaptive graph is "
                         f"{'faster' if rs[0]['latency_ratio'] < 1 else 'slower'} at every length measured")
    return "\n".join(lines)


CSV_COLUMNS = ["model", "threads", "batch", "seq", "past", "graph", "role", "yardstick", "n", "p50_ms", "p90_ms", "p95_ms",
               "p99_ms", "mean_ms", "std_ms", "min_ms", "ratio_to_yardstick", "latency_ratio", "latency_ratio_lo",
               "latency_ratio_hi", "flop_ratio", "realisation", "realisation_lo", "realisation_hi"]


def write_csv(rows: list[dict], path: str | Path) -> None:
    """One row per graph per point (atomically: the file is whole or absent)."""
    import csv
    import io

    from adaptex.exporter.metadata import atomic_path

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS)
    w.writeheader()
    for r in rows:
        liv, riv = r["latency_ratio_interval"] or [None, None], r["realisation_interval"] or [None, None]
        for name, s in r["stats"].items():
            if s is None:
                continue
            cand = next((c for c in r["candidates"] if c["name"] == name), None)
            role = ("adaptive" if name == "adaptive" else "one-session" if name == ONE_SESSION else
                    "dense" if cand and cand["dense"] else "naive")
            w.writerow({"model": r.get("model", ""), "threads": r["threads"], "batch": r["batch"], "seq": r["seq"], "past": r.get("past", 0),
                        "graph": name, "role": role, "yardstick": name == r["dense_name"], "n": s["n"],
                        **{k: round(s[k], 4) for k in ("p50_ms", "p90_ms", "p95_ms", "p99_ms", "mean_ms", "std_ms",
                                                      "min_ms")},
                        "ratio_to_yardstick": round(s["p50_ms"] / r["dense_p50_ms"], 4) if r["dense_p50_ms"] else None,
                        "latency_ratio": r["latency_ratio"], "latency_ratio_lo": liv[0], "latency_ratio_hi": liv[1],
                        "flop_ratio": r["flop_ratio"], "realisation": r["realisation"],
                        "realisation_lo": riv[0], "realisation_hi": riv[1]})
    with atomic_path(Path(path)) as tmp:
        Path(tmp).write_text(buf.getvalue())


def plot(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Latency against sequence length for the adaptive graph, the yardstick and the naive export
    (p50, bars: min-max of the block medians), with the realisation on a second axis; one panel per
    (threads, batch, past)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise AdaptexError("--plot needs matplotlib: pip install 'adaptex[bench]' (or pip install matplotlib)") from None
    from adaptex.exporter.metadata import atomic_path

    groups = {}
    for r in rows:
        groups.setdefault((r["threads"], r["batch"], r.get("past", 0)), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, ((thr, B, past), rs) in zip(axes[0], sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["seq"])
        T = [r["seq"] for r in rs]
        for label, key, style in (("adaptive", "p50_ms", "o-"), ("fastest dense", "dense_p50_ms", "s-"),
                                  ("naive", "naive_p50_ms", "^--")):
            ys = [r[key] for r in rs]
            if all(y is not None for y in ys):
                ax.plot(T, ys, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T" + (f" (after {past} cached)" if past else ""))
        ax.set_ylabel("p50 latency (ms)")
        ax.set_title(f"batch {B}, {thr} thread(s)")
        ax.grid(alpha=0.3)
        rz = [(r["seq"], r["realisation"]) for r in rs if r["realisation"] is not None]
        if rz:
            ax2 = ax.twinx()
            ax2.plot([x for x, _ in rz], [y for _, y in rz], "k:", marker="x", label="realisation")
            ax2.set_ylabel("realisation")
            ax2.axhline(1.0, color="grey", lw=0.5)
            ax2.legend(loc="lower right", fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(str(tmp), dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
