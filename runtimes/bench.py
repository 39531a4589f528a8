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
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaptex.graphs.budgetformer import flops_per_sample
from adaptex.exporter.trace import is_decoder
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner, session_options


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


# The model mode each counterpart exports: dense = every head / token / block, no routers; naive =
# the plain PyTorch inference path (the decisions taken, everything computed, the rest masked).
COUNTERPART_MODES = {"budgetformer": {"dense": "dense", "naive": "naive"},
                     "tsa": {"dense": "dense", "naive": "hard_dense"},
                     "elastic": {"dense": "full", "naive": "hard_dense"},
                     "elastic_decoder": {"dense": "full", "naive": "hard_dense"}}


def export_counterparts(model, workdir: Path) -> dict[str, tuple[str | None, str | None]]:
    """Dense counterpart and naive export as ONNX files: name -> (path, reason if none)."""
    import logging

    import torch

    from adaptex.exporter.trace import dynamic_shapes, example_inputs, export_wrapper, io_names

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out = {}
    for name, mode in COUNTERPART_MODES[model.cfg.family].items():
        path = workdir / f"{name}.onnx"
        try:
            wrapper = export_wrapper(model, mode)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ep = torch.export.export(wrapper, example_inputs(model.cfg, mode=mode),
                                        dynamic_shapes=dynamic_shapes(model.cfg, mode))
                inputs, names = io_names(model.cfg, mode)
                prog = torch.onnx.export(ep, (), dynamo=True, optimize=True, verbose=False,
                                         input_names=inputs, output_names=names)
            prog.save(str(path))
            out[name] = (str(path), None)
        except Exception as e:
            out[name] = (None, f"stock export failed: {str(e).strip().splitlines()[0][:200]}")
    return out


def bench_inputs(cfg, task_name: str | None, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Task inputs at the requested length where the task can make them, else random tokens."""
    from adaptex.graphs.tasks import get_task

    rng = np.random.default_rng(seed)
    try:
        task = get_task(task_name) if task_name else None
        b = task.sample(batch, rng, length=seq) if task else None
    except Exception:  # an unknown or unavailable task: random tokens
        b = None
    if b is not None and b.input_ids.shape[1] == seq:
        return {"input_ids": b.input_ids.numpy(), "attention_mask": b.attention_mask.numpy()}
    ids = rng.integers(1, cfg.vocab_size, size=(batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}


def elastic_bench_inputs(cfg, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Held-out stdlib text of exactly `seq` tokens (passages joined until long enough); random
    tokens for an inline (test) backbone."""
    rng = np.random.default_rng(seed)
    if cfg.backbone == "minilm":
        from adaptex.graphs.elastic import StdlibText
        from adaptex.graphs.minilm import MiniLMTokenizer, default_model_dir

        tok = MiniLMTokenizer(default_model_dir() / "tokenizer.json", max_positions=cfg.max_len)
        ids, _ = tok.encode(StdlibText().sample(batch, rng, split="val", join=40), max_length=seq)
        if ids.shape[1] == seq:
            return {"input_ids": ids.numpy(), "attention_mask": np.ones((batch, seq), dtype=np.int64)}
    ids = rng.integers(1, cfg.vocab_size, size=(batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}


def elastic_flops(cfg, sa: np.ndarray, T: int) -> float:
    """FLOPs of one sequence of T tokens with head modes sa (L, H) (1 = SA): projections and FFN as
    in the backbone, FA heads 4 T^2 dh, SA heads 4 T min(T, sink + window + 1) dh."""
    b = cfg.backbone_config or {}
    d = cfg.num_heads * cfg.head_dim
    d_ff = b.get("d_ff", 4 * d)
    linear = 2 * T * (4 * d * d + 2 * d * d_ff)
    ctx_sa = min(T, cfg.sink + cfg.window + 1)
    att = 4 * T * cfg.head_dim * np.where(sa, ctx_sa, T)  # (L, H)
    return float(cfg.num_layers * linear + att.sum())


def decoder_bench_inputs(cfg, task_name: str | None, batch: int, seq: int, past: int, seed: int = 0) -> dict:
    """Feeds for a decoder step of `seq` new tokens after `past` cached ones; the cache itself is filled
    by a prefill of the preceding text (key "_prefill"), run on the adaptive artifact by run_bench."""
    from adaptex.graphs.lm_tasks import get_lm_task

    rng = np.random.default_rng(seed)
    n = past + seq
    try:
        task = get_lm_task(task_name) if task_name else None
        if getattr(task, "val", None) is not None and len(task.val) > n:  # a text corpus: held-out windows of n tokens
            starts = rng.integers(0, len(task.val) - n, size=batch)
            text = np.stack([task.val[s:s + n] for s in starts]).astype(np.int64)
        else:
            text = task.sample(batch, rng).input_ids.numpy() if task is not None else None
    except Exception:
        text = None
    if text is None or text.shape[1] < n:  # random tokens: routing on them says little; prefer a task
        text = rng.integers(1, cfg.vocab_size, size=(batch, n)).astype(np.int64)
    text = text[:, :n]
    H, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
    empty = {f"past_key_values.{i}.{kv}": np.zeros((batch, H, 0, dh), np.float32)
             for i in range(cfg.num_layers) for kv in ("key", "value")}
    if cfg.family == "elastic_decoder":  # ignored at prefill; decode steps get the prefill's decisions
        empty.update({f"head_modes.{i}": np.zeros((batch, H), bool) for i in range(cfg.num_layers)})
    feeds = {"input_ids": np.ascontiguousarray(text[:, past:]), "attention_mask": np.ones((batch, n), np.int64), **empty}
    if past:
        feeds["_prefill"] = {"input_ids": np.ascontiguousarray(text[:, :past]),
                             "attention_mask": np.ones((batch, past), np.int64), **empty}
    return feeds


def _decoder_flops(cfg, out: dict, meta: dict, seq: int, past: int) -> tuple[float, float, dict]:
    """TSA: the FFN and the query side of attention of each gated block scale with its keep rate
    (keys and values are computed for every token). The mean attention context of a step is
    past + (seq + 1) / 2 (causal). The sparse graph runs each block's FFN on exactly its kept tokens
    but its queries on the batch's largest per-sample kept count in every sample."""
    from adaptex.graphs.tsa import flops_per_token

    keeps = [np.asarray(out[f"decisions.layer{li}.keep"]).reshape(-1, seq) for li in range(1, cfg.num_layers)]
    rates = [float(k.mean()) for k in keeps]
    ctx = past + (seq + 1) / 2
    dense = flops_per_token(cfg, ctx, None)
    flop_ratio = flops_per_token(cfg, ctx, rates) / dense
    if meta.get("variant") == "dense":
        executed = flops_per_token(cfg, ctx, [1.0] * len(rates))
    else:
        # at least one query row: a step whose every token skips still attends one (ungated) row
        executed = flops_per_token(cfg, ctx, rates, [max(1.0, float(k.sum(1).max())) / seq for k in keeps])
    return flop_ratio, executed / dense, {"keep_rate_per_block": rates}


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


def _onnx_graphs(artifact, model, tmp: Path, threads: int, say) -> tuple[list[Timing], dict, str]:
    import onnxruntime as ort

    say("exporting the dense counterpart and the naive stock export ...")
    counterparts = export_counterparts(model, tmp)
    timings = [Timing("adaptive", str(artifact))]
    for name in ("dense", "naive"):
        path, reason = counterparts[name]
        timings.append(Timing(name, path, reason=reason))
    runs = {}
    for t in timings:
        if t.path:
            sess = ort.InferenceSession(t.path, session_options(threads), providers=["CPUExecutionProvider"])
            names = [o.name for o in sess.get_outputs()]
            takes = {i.name for i in sess.get_inputs()}  # the dense graph has no head_modes inputs
            runs[t.name] = (lambda feeds, sess=sess, names=names, takes=takes:
                            dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in takes}))))
    return timings, runs, f"onnxruntime {ort.__version__} (CPU)"


def export_coreml_counterparts(model, workdir: Path, precision: str, min_target: str) -> dict:
    """Dense counterpart and naive export as Core ML packages by stock coremltools: name -> (path, reason)."""
    from adaptex.exporter.targets import coreml as target

    out = {}
    for name in ("dense", "naive"):
        try:
            out[name] = (str(target.export_stock(model, workdir / f"{name}.mlpackage", name,
                                                 precision=precision, min_target=min_target)), None)
        except Exception as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            out[name] = (None, f"stock coremltools conversion failed: {first}")
    return out


def _coreml_graphs(artifact, model, meta: dict, tmp: Path, compute_units: str, say) -> tuple[list[Timing], dict, str]:
    import coremltools as ct

    from adaptex.runtimes import coreml

    if not coreml.available():
        raise AdaptexError("Core ML latency needs the Core ML runtime (macOS); on this machine 'adaptex check' "
                           "verifies the package by MIL reference evaluation, and 'adaptex bench' times .onnx artifacts")
    say(f"converting the dense counterpart and the naive export with stock coremltools ({meta.get('precision')}) ...")
    counterparts = export_coreml_counterparts(model, tmp, meta.get("precision", "fp16"),
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


def _tensorrt_graphs(artifact, model, info: dict, meta: dict, tmp: Path, say):
    """The engine, against a dense engine built from the same checkpoint with the same profile and
    precision, and the stock export's engine where TensorRT builds one. Timed by CUDA events."""
    from adaptex.exporter.targets import tensorrt
    from adaptex.runtimes.tensorrt import TensorRTRunner

    prof, precision = meta["tensorrt"]["profile"], meta.get("precision", "fp32")
    say(f"building the dense counterpart engine ({precision}) ...")
    timings = [Timing("adaptive", str(artifact))]
    data, dmeta = tensorrt.bound_onnx(model, info, variant="dense", prof=prof)
    dense = tmp / "dense.plan"
    tensorrt.build_engine(data, dmeta, dense, precision=precision, timing_cache=None, say=say)
    timings.append(Timing("dense", str(dense)))
    naive, reason = export_counterparts(model, tmp)["naive"]
    if naive:
        try:
            nmeta = {**dmeta, "tensorrt": {**dmeta["tensorrt"], "routing_values": []}}
            tensorrt.build_engine(Path(naive).read_bytes(), nmeta, tmp / "naive.plan", precision=precision,
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


def run_bench(artifact: str | Path, model, info: dict, *, batch: int = 1, seq: int = 128, threads: int = 1,
              warmup: int = 10, runs: int | None = None, time_budget_s: float = 8.0,
              progress=None, compute_units: str = "all", past: int = 0) -> dict:
    from adaptex.runtimes.coreml_mil import read_package_meta

    is_coreml = Path(artifact).suffix == ".mlpackage"
    is_trt = Path(artifact).suffix in (".plan", ".engine")
    if is_trt:
        from adaptex.runtimes.tensorrt import read_plan_meta

        meta = read_plan_meta(artifact)
    else:
        meta = read_package_meta(artifact) if is_coreml else OnnxRuntimeRunner(artifact).meta
    cfg = model.cfg
    decoder = is_decoder(cfg)
    if past and not decoder:
        raise AdaptexError("--past applies to decoders (tsa, elastic_decoder) only: it times decode steps on a KV cache")
    if seq + past > cfg.max_len:
        raise AdaptexError(f"--seq {seq}{f' + --past {past}' if past else ''} exceeds the model's maximum sequence "
                           f"length {cfg.max_len}; use at most {cfg.max_len} tokens in all")
    if batch < 1 or seq < 1 or threads < 0:
        raise AdaptexError("--batch and --seq must be at least 1 and --threads at least 0")
    say = progress or (lambda msg: None)
    task_name = (info.get("training") or {}).get("task")
    if decoder:
        feeds = decoder_bench_inputs(cfg, task_name, batch, seq, past)
    elif cfg.family == "elastic":
        feeds = elastic_bench_inputs(cfg, batch, seq)
    else:
        feeds = bench_inputs(cfg, task_name, batch, seq)
    if is_coreml:  # Core ML packages take int32 ids and masks (caches stay float32)
        def int32_ids(f: dict) -> dict:
            return {k: int32_ids(v) if isinstance(v, dict) else v.astype(np.int32)
                    if k in ("input_ids", "attention_mask") else v for k, v in f.items()}
        feeds = int32_ids(feeds)
    with tempfile.TemporaryDirectory(prefix="adaptex-bench-") as tmp:
        tmp = Path(tmp)
        clocks = {}  # name -> the device time of its last run (TensorRT: CUDA events), else wall time
        if is_coreml:
            timings, fns, runtime = _coreml_graphs(artifact, model, meta, tmp, compute_units, say)
        elif is_trt:
            timings, fns, runtime, clocks = _tensorrt_graphs(artifact, model, info, meta, tmp, say)
        else:
            timings, fns, runtime = _onnx_graphs(artifact, model, tmp, threads, say)
        live = [t for t in timings if t.name in fns]
        if decoder and past:  # a realistic cache: the adaptive artifact's own prefill of the preceding text
            pre = fns["adaptive"](feeds.pop("_prefill"))
            feeds.update({k.replace("present.", "past_key_values."): v for k, v in pre.items() if k.startswith("present.")})
            # an elastic decoder's steps reuse the prefill's head modes
            feeds.update({f"head_modes.{k.split('.')[1][5:]}": v for k, v in pre.items() if k.endswith(".sa")})
        feeds.pop("_prefill", None)
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
    # artifact (what its graph computes: the dense variant every head; the sparse one, in a batch, the
    # batch's largest k for every sample). Realisation is measured against the decisions (DESIGN §5),
    # so work a lowering wastes counts against it.
    if cfg.family == "elastic_decoder":
        from adaptex.graphs.elastic_decoder import attention_flops

        sa = np.stack([adaptive_out[f"decisions.layer{i}.sa"] for i in range(cfg.num_layers)], axis=1)  # (B, L, H)
        flops = np.array([attention_flops(cfg, row, seq, past) for row in sa])
        flop_ratio = float(flops[:, 0].mean() / flops[:, 1].mean())
        executed_ratio = 1.0 if meta.get("variant") == "dense" else flop_ratio
        decision_summary = {"sa_fraction": float(sa.mean()),
                            "sa_fraction_per_layer": [float(x) for x in sa.mean(axis=(0, 2))]}
    elif decoder:
        flop_ratio, executed_ratio, decision_summary = _decoder_flops(cfg, adaptive_out, meta, seq, past)
    elif cfg.family == "elastic":
        sa = np.stack([adaptive_out[f"decisions.layer{i}.sa"] for i in range(cfg.num_layers)], axis=1)  # (B, L, H)
        full = elastic_flops(cfg, np.zeros(sa.shape[1:], bool), seq)
        flop_ratio = float(np.mean([elastic_flops(cfg, row, seq) for row in sa]) / full)
        executed_ratio = 1.0 if meta.get("variant") == "dense" else flop_ratio
        decision_summary = {"sa_fraction": float(sa.mean()),
                            "sa_fraction_per_layer": [float(x) for x in sa.mean(axis=(0, 2))]}
    else:
        L, H, T = cfg.num_layers, cfg.num_heads, seq
        dense_flops = flops_per_sample(cfg, T, None)
        ks = np.stack([adaptive_out[f"decisions.layer{i}.k"] for i in range(L)], axis=1)  # (B, L)
        flop_ratio = float(np.mean([flops_per_sample(cfg, T, list(map(float, row))) for row in ks]) / dense_flops)
        executed = [float(H)] * L if meta.get("variant") == "dense" else [float(x) for x in ks.max(axis=0)]
        executed_ratio = flops_per_sample(cfg, T, executed) / dense_flops
        decision_summary = {"mean_k_per_layer": [float(x) for x in ks.mean(axis=0)]}
    ad, de, na = timings
    lat_ratio = ad.pct(50) / de.pct(50) if de.times_ms else None
    realisation = ((1 - lat_ratio) / (1 - flop_ratio)) if lat_ratio is not None and flop_ratio < 0.99 else None
    result = {
        "artifact": str(artifact), "runtime": runtime, "variant": meta.get("variant"),
        "batch": batch, "seq": seq, "threads": threads, "runs": len(ad.times_ms), "warmup": warmup,
        "p50_ms": ad.pct(50), "p90_ms": ad.pct(90), "p99_ms": ad.pct(99),
        "throughput_seq_per_s": batch * 1000.0 / ad.pct(50),
        "dense_p50_ms": de.pct(50), "dense_p90_ms": de.pct(90), "dense_p99_ms": de.pct(99),
        "dense_reason": de.reason,
        "naive_p50_ms": na.pct(50), "naive_p90_ms": na.pct(90), "naive_p99_ms": na.pct(99),
        "naive_reason": na.reason,
        "past": past, **decision_summary,
        "flop_ratio": flop_ratio, "executed_flop_ratio": executed_ratio,
        "latency_ratio": lat_ratio, "realisation": realisation,
        "naive_latency_ratio": (na.pct(50) / de.pct(50)) if na.times_ms and de.times_ms else None,
        "size_mb": {t.name: t.size_mb for t in timings},
        "peak_rss_mb": {t.name: t.peak_rss_mb for t in timings},
    }
    return result


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
    else:
        lines.append(f"  mean k per layer: {', '.join(f'{k:.2f}' for k in r['mean_k_per_layer'])}")
    lines.append(f"  FLOP ratio implied by the decisions: {r['flop_ratio']:.3f}   (executed by this "
                 f"{r['variant']} graph: {r['executed_flop_ratio']:.3f})")
    lines.append(f"  latency ratio (p50 adaptive / dense): {f(r['latency_ratio'], '.3f')}")
    lines.append(f"  realisation (1 - latency ratio) / (1 - FLOP ratio): {f(r['realisation'], '.3f')}")
    if r.get("naive_latency_ratio") is not None:
        lines.append(f"  naive export latency ratio: {r['naive_latency_ratio']:.3f}")
    return "\n".join(lines)


def format_sweep(rows: list[dict], skipped: list[str]) -> str:
    """Elastic against full attention across sequence lengths, and where the curves cross."""
    lines = [f"  {'T':>6} {'elastic ms':>11} {'full ms':>9} {'ratio':>7} {'FLOP ratio':>11} {'SA heads':>9}"]
    for r in rows:
        lines.append(f"  {r['seq']:6d} {r['p50_ms']:11.3f} {r['dense_p50_ms']:9.3f} {r['latency_ratio']:7.3f} "
                     f"{r['flop_ratio']:11.3f} {100 * r['sa_fraction']:8.1f}%")
    lines += [f"  {s}" for s in skipped]
    rows = sorted(rows, key=lambda r: r["seq"])
    cross = [(x["seq"], y["seq"]) for x, y in zip(rows, rows[1:])
             if (x["latency_ratio"] < 1) != (y["latency_ratio"] < 1)]
    if cross:
        where = "; ".join(f"between T={x} and T={y}" for x, y in cross)
        lines.append(f"  the curves cross {where}: elastic is "
                     f"{'faster' if rows[-1]['latency_ratio'] < 1 else 'slower'} from T={cross[-1][1]}")
    elif rows:
        lines.append(f"  no crossing in the sweep: elastic is {'faster' if rows[0]['latency_ratio'] < 1 else 'slower'} "
                     "than full attention at every length measured")
    return "\n".join(lines)
