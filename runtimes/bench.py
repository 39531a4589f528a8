"""Latency: an adaptive artifact against the dense counterpart and the naive stock export.

- dense counterpart: the same weights as an ordinary dense Transformer (fused QKV, every head, every
  token, full attention, no routers), exported by the stock exporter with its optimiser on, and run
  with ONNX Runtime's optimisations on: the fastest ordinary graph, not the adaptive graph at k = H.
- naive export: the stock exporter on the model's plain PyTorch inference path (every head computed,
  unselected ones masked), which is what a user gets without adaptex.
Timing interleaves the sessions in one process (a round of each per iteration), so drifting load on
a shared machine hits all of them alike; peak memory is measured per artifact in a process of its
own, so one session does not hide another's.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaptex.graphs import files
from adaptex.graphs.errors import AdaptexError
from adaptex.graphs.family import family_contract
from adaptex.runtimes.onnxruntime import session_options


@dataclass
class Timing:
    name: str
    path: str | None
    times_ms: list = field(default_factory=list)
    reason: str | None = None  # why there is no measurement
    peak_rss_mb: float | None = None
    size_mb: float | None = None

    def pct(self, q: float) -> float | None:
        return float(np.percentile(self.times_ms, q)) if self.times_ms else None


def _peak_rss(path: str, inputs: str, threads: int, compute_units: str = "all") -> float | None:
    r = subprocess.run([sys.executable, "-m", "adaptex.runtimes._memworker", path, inputs, str(threads), compute_units],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def _size_mb(path: str) -> float:
    p = Path(path)
    if p.is_dir():  # an .mlpackage is a directory
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20
    return p.stat().st_size / 2**20


def _onnx_graphs(artifact, model, contract, tmp: Path, threads: int, say) -> tuple[list[Timing], dict, str]:
    import onnxruntime as ort

    from adaptex.exporter.counterparts import onnx_counterparts

    say("exporting the dense counterpart and the naive stock export ...")
    counterparts = onnx_counterparts(model, contract, tmp)
    timings = [Timing("adaptive", str(artifact))]
    for name in ("dense", "naive"):
        path, reason = counterparts[name]
        timings.append(Timing(name, path, reason=reason))
    runs = {}
    for t in timings:
        if t.path:
            sess = ort.InferenceSession(t.path, session_options(threads), providers=["CPUExecutionProvider"])
            names = [o.name for o in sess.get_outputs()]
            takes = {i.name for i in sess.get_inputs()}  # a dense graph takes no decisions (head_modes)
            runs[t.name] = (lambda feeds, sess=sess, names=names, takes=takes:
                            dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in takes}))))
    return timings, runs, f"onnxruntime {ort.__version__} (CPU)"


def _coreml_graphs(artifact, model, contract, meta: dict, tmp: Path, compute_units: str, say):
    import coremltools as ct

    from adaptex.exporter.counterparts import coreml_counterparts
    from adaptex.runtimes import coreml

    if not coreml.available():
        raise AdaptexError("Core ML latency needs the Core ML runtime (macOS); on this machine 'adaptex check' "
                           "verifies the package by MIL reference evaluation, and 'adaptex bench' times .onnx artifacts")
    say(f"converting the dense counterpart and the naive export with stock coremltools ({meta.get('precision')}) ...")
    counterparts = coreml_counterparts(model, contract, tmp, meta.get("precision", "fp16"),
                                       meta.get("min_target", "iOS17"))
    timings = [Timing("adaptive", str(artifact))]
    for name in ("dense", "naive"):
        path, reason = counterparts[name]
        timings.append(Timing(name, path, reason=reason))
    adaptive = coreml.CoreMLRunner(artifact, compute_units)
    adaptive.activate()
    runs = {"adaptive": adaptive.infer}
    for t in timings[1:]:
        if t.path:
            runs[t.name] = coreml.load_predictor(t.path, compute_units)
    return timings, runs, f"Core ML runtime ({compute_units}), coremltools {ct.__version__}"


def _tensorrt_graphs(artifact, model, contract, info: dict, meta: dict, tmp: Path, say):
    """The engine, against a dense engine built from the same checkpoint with the same profile and
    precision, and the stock export's engine where TensorRT builds one. Timed by CUDA events."""
    from adaptex.exporter.counterparts import onnx_counterparts
    from adaptex.exporter.metadata import source_of
    from adaptex.exporter.targets import tensorrt
    from adaptex.exporter.targets.tensorrt.engine import build_engine
    from adaptex.runtimes.tensorrt import TensorRTRunner

    prof, precision = meta["tensorrt"]["profile"], meta.get("precision", "fp32")
    say(f"building the dense counterpart engine ({precision}) ...")
    timings = [Timing("adaptive", str(artifact))]
    data, dmeta = tensorrt.bound_onnx(model, contract, source_of(model, info), variant="dense")
    dmeta["tensorrt"]["profile"] = prof
    dense = tmp / "dense.plan"
    build_engine(data, dmeta, dense, precision=precision, timing_cache=None, say=say)
    timings.append(Timing("dense", str(dense)))
    naive, reason = onnx_counterparts(model, contract, tmp)["naive"]
    if naive:
        try:
            build_engine(Path(naive).read_bytes(), dmeta, tmp / "naive.plan", precision=precision,
                         timing_cache=None, say=say, pin=False)
            timings.append(Timing("naive", str(tmp / "naive.plan")))
        except Exception as e:
            timings.append(Timing("naive", None, reason=f"TensorRT did not build the stock export: "
                                                        f"{str(e).splitlines()[0][:160]}"))
    else:
        timings.append(Timing("naive", None, reason=reason))
    runs, clocks = {}, {}
    for t in timings:
        if t.path:
            r = TensorRTRunner(t.path).activate()
            runs[t.name], clocks[t.name] = r.run_raw, (lambda r=r: r.last_ms)
    import tensorrt as trt

    return timings, runs, f"TensorRT {trt.__version__} ({precision}, CUDA-event timing)", clocks


def _typed(feeds: dict, specs: dict) -> dict:
    """Feeds in the artifact's dtypes (Core ML takes int32 ids and float32 0/1 modes); nested prefill too."""
    return {k: _typed(v, specs) if isinstance(v, dict) else
            (v.astype(specs[k].dtype) if k in specs else v) for k, v in feeds.items()}


def run_bench(artifact: str | Path, model, info: dict, *, batch: int = 1, seq: int = 128, threads: int = 1,
              warmup: int = 10, runs: int | None = None, time_budget_s: float = 8.0,
              progress=None, compute_units: str = "all", past: int = 0, feeds: dict | None = None,
              contract=None) -> dict:
    """Time the artifact against its dense counterpart and the naive stock export, interleaved; the
    FLOP ratio its decisions imply (where its contract has a FLOP model) and the realisation."""
    from adaptex.runtimes.open import artifact_kind, open_artifact

    kind = artifact_kind(artifact)
    runner = open_artifact(artifact, threads) if kind != "coreml" else None
    meta = runner.meta if runner is not None else _coreml_meta(artifact)
    contract = contract or family_contract(model)
    if past and not contract.decoder:
        raise AdaptexError("--past applies to decoders only: it times decode steps on a KV cache")
    say = progress or (lambda msg: None)
    task = (info.get("training") or {}).get("task")
    if feeds is None:
        feeds = contract.bench_feeds(task, batch, seq, past)
        if feeds is None:
            raise AdaptexError("this model has no input generator for benchmarks; pass the inputs to time "
                               "(adaptex.bench(path, model, inputs=[...]))")
    else:
        batch, seq = _batch_seq(feeds, batch, seq)
    if runner is not None:
        specs = runner.input_metadata()
    else:
        from adaptex.runtimes.coreml_mil import input_specs

        specs = input_specs(meta)
    feeds = _typed(feeds, specs)
    from adaptex.runtimes.base import limits_of, validate_feeds

    if "_prefill" not in feeds:
        validate_feeds({k: v for k, v in feeds.items()}, specs, limits_of(meta))
    elif past + seq > (limits_of(meta).max_sequence if limits_of(meta) else past + seq):
        raise AdaptexError(f"{past} cached + {seq} new tokens = {past + seq} exceed the model's maximum "
                           f"{limits_of(meta).max_sequence}; lower --past or --seq")
    with files.temp_dir("bench") as tmp:
        clocks = {}  # name -> the device time of its last run (TensorRT: CUDA events), else wall time
        if kind == "coreml":
            timings, fns, runtime = _coreml_graphs(artifact, model, contract, meta, tmp, compute_units, say)
        elif kind == "tensorrt":
            timings, fns, runtime, clocks = _tensorrt_graphs(artifact, model, contract, info, meta, tmp, say)
        else:
            timings, fns, runtime = _onnx_graphs(artifact, model, contract, tmp, threads, say)
        live = [t for t in timings if t.name in fns]
        if "_prefill" in feeds:  # a realistic cache: the adaptive artifact's own prefill of the preceding text
            pre_feeds = feeds.pop("_prefill")
            pre = fns["adaptive"](pre_feeds)
            feeds.update({k.replace("present.", "past_key_values."): v for k, v in pre.items() if k.startswith("present.")})
            extra = {k: v for k, v in pre_feeds.items() if k in contract.extra_inputs()} if contract.decoder else {}
            feeds.update(_typed(contract.next_extra(pre, 0, extra), specs) if contract.decoder else {})
        adaptive_out = fns["adaptive"](feeds)
        say(f"warming up ({warmup} runs each) ...")
        per_round = 0.0
        for t in live:
            t0 = time.perf_counter()
            for _ in range(warmup):
                fns[t.name](feeds)
            per_round += (time.perf_counter() - t0) / max(warmup, 1)
        n = runs or int(min(500, max(30, time_budget_s / max(per_round, 1e-6))))
        say(f"timing {n} interleaved rounds ...")
        for _ in range(n):
            for t in live:
                t0 = time.perf_counter_ns()
                fns[t.name](feeds)
                wall = (time.perf_counter_ns() - t0) / 1e6
                t.times_ms.append(clocks[t.name]() if t.name in clocks else wall)
        del fns
        say("measuring peak memory in separate processes ...")
        npz = tmp / "inputs.npz"
        np.savez(npz, **feeds)
        for t in live:
            t.size_mb = _size_mb(t.path)
            t.peak_rss_mb = _peak_rss(t.path, str(npz), threads, compute_units)

    # FLOPs implied by the decisions (per sample: the saving the model asked for) and executed by the
    # artifact (what its graph computes: the dense variant everything; the sparse one, in a batch, the
    # batch's largest count for every sample). Realisation is measured against the decisions, so
    # work a lowering wastes counts against it.
    flops = contract.flops({k: np.asarray(v) for k, v in adaptive_out.items()}, meta.get("variant"), seq, past) or {}
    flop_ratio = flops.pop("flop_ratio", None)
    executed_ratio = flops.pop("executed_flop_ratio", None)
    ad, de, na = timings
    lat_ratio = ad.pct(50) / de.pct(50) if de.times_ms else None
    realisation = ((1 - lat_ratio) / (1 - flop_ratio)) if lat_ratio is not None and flop_ratio is not None \
        and flop_ratio < 0.99 else None
    return {
        "artifact": str(artifact), "runtime": runtime, "variant": meta.get("variant"), "family": meta.get("family"),
        "batch": batch, "seq": seq, "threads": threads, "runs": len(ad.times_ms), "warmup": warmup,
        "p50_ms": ad.pct(50), "p90_ms": ad.pct(90), "p99_ms": ad.pct(99),
        "throughput_seq_per_s": batch * 1000.0 / ad.pct(50),
        "dense_p50_ms": de.pct(50), "dense_p90_ms": de.pct(90), "dense_p99_ms": de.pct(99),
        "dense_reason": de.reason,
        "naive_p50_ms": na.pct(50), "naive_p90_ms": na.pct(90), "naive_p99_ms": na.pct(99),
        "naive_reason": na.reason,
        "past": past, **flops,
        "flop_ratio": flop_ratio, "executed_flop_ratio": executed_ratio,
        "latency_ratio": lat_ratio, "realisation": realisation,
        "naive_latency_ratio": (na.pct(50) / de.pct(50)) if na.times_ms and de.times_ms else None,
        "size_mb": {t.name: t.size_mb for t in timings},
        "peak_rss_mb": {t.name: t.peak_rss_mb for t in timings},
    }


def _coreml_meta(artifact) -> dict:
    from adaptex.runtimes.open import read_metadata

    return read_metadata(artifact)


def _batch_seq(feeds: dict, batch: int, seq: int) -> tuple[int, int]:
    first = np.asarray(next(iter(feeds.values())))
    return (int(first.shape[0]), int(first.shape[1]) if first.ndim > 1 else seq) if first.ndim else (batch, seq)


def format_bench(r: dict) -> str:
    def f(x, spec="8.3f"):
        return format(x, spec) if x is not None else "     n/a"

    lines = [f"bench: {r['artifact']} ({r['variant']}) on {r['runtime']}",
             f"  batch={r['batch']} seq={r['seq']} threads={r['threads']} runs={r['runs']} "
             f"(interleaved, after {r['warmup']} warm-up runs each)",
             f"  {'graph':<10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'seq/s':>9} {'size MB':>8} {'peak RSS MB':>12}"]
    for name, key in (("adaptive", ""), ("dense", "dense_"), ("naive", "naive_")):
        p50 = r[f"{key}p50_ms"] if key else r["p50_ms"]
        if p50 is None:
            lines.append(f"  {name:<10} {'-':>8}  ({r[f'{name}_reason']})")
            continue
        p90 = r[f"{key}p90_ms"] if key else r["p90_ms"]
        p99 = r[f"{key}p99_ms"] if key else r["p99_ms"]
        lines.append(f"  {name:<10} {p50:8.3f} {p90:8.3f} {p99:8.3f} {r['batch'] * 1000 / p50:9.1f} "
                     f"{f(r['size_mb'][name], '8.2f')} {f(r['peak_rss_mb'][name], '12.1f')}")
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
                     f"{r['variant']} graph: {r['executed_flop_ratio']:.3f})")
    else:
        lines.append("  FLOP ratio: no FLOP model for this model (the latency ratio stands alone)")
    lines.append(f"  latency ratio (p50 adaptive / dense): {f(r['latency_ratio'], '.3f')}")
    lines.append(f"  realisation (1 - latency ratio) / (1 - FLOP ratio): {f(r['realisation'], '.3f')}")
    if r.get("naive_latency_ratio") is not None:
        lines.append(f"  naive export latency ratio: {r['naive_latency_ratio']:.3f}")
    return "\n".join(lines)


def format_sweep(rows: list[dict], skipped: list[str]) -> str:
    """The artifact against the dense graph across sequence lengths, and where the curves cross."""
    def f(x, spec):
        return format(x, spec) if x is not None else "n/a".rjust(int(spec.split(".")[0]))

    lines = [f"  {'T':>6} {'adaptive ms':>11} {'dense ms':>9} {'ratio':>7} {'FLOP ratio':>11} {'SA heads':>9}"]
    for r in rows:
        sa = f"{100 * r['sa_fraction']:8.1f}%" if "sa_fraction" in r else f"{'-':>9}"
        lines.append(f"  {r['seq']:6d} {r['p50_ms']:11.3f} {f(r['dense_p50_ms'], '9.3f')} "
                     f"{f(r['latency_ratio'], '7.3f')} {f(r['flop_ratio'], '11.3f')} {sa}")
    rows = [r for r in rows if r["latency_ratio"] is not None]
    lines += [f"  {s}" for s in skipped]
    rows = sorted(rows, key=lambda r: r["seq"])
    cross = [(x["seq"], y["seq"]) for x, y in zip(rows, rows[1:])
             if (x["latency_ratio"] < 1) != (y["latency_ratio"] < 1)]
    if cross:
        where = "; ".join(f"between T={x} and T={y}" for x, y in cross)
        lines.append(f"  the curves cross {where}: the adaptive graph is "
                     f"{'faster' if rows[-1]['latency_ratio'] < 1 else 'slower'} from T={cross[-1][1]}")
    elif rows:
        lines.append(f"  no crossing in the sweep: the adaptive graph is "
                     f"{'faster' if rows[0]['latency_ratio'] < 1 else 'slower'} than the dense one at every length "
                     "measured")
    return "\n".join(lines)
