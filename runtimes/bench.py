"""Latency: an adaptive artifact against the fastest dense graph a user could ship for its weights.

The yardstick is not one dense export but the fastest of several (exporter/counterparts.py): the
stock dynamo export, the legacy TorchScript export, the original pretrained module's export where
the model has one, and ONNX Runtime's transformer optimizer on each where it fuses. bench times them
all and reports every ratio against the fastest. The naive export (the model's masked inference
path) is reported beside them: it is what adaptex replaces, not a yardstick.

How it times (medians of interleaved runs, because these machines are shared and noisy):
- every graph runs once per round, in an order shuffled each round, so drifting load hits all alike;
- the rounds fall into independent blocks, and the latency ratio and realisation are computed per
  block: reported as the median over blocks with the min-max interval, never as one figure;
- each block creates its ONNX Runtime sessions afresh in a rotated order (a session created later
  in a process runs faster: Bench._fresh_sessions), so no graph keeps the first place;
- a dense candidate whose warm-up (interleaved too, after one allocating run each) is far behind the
  fastest one is dropped before timing (reported with its warm-up figure), so the time goes to the
  graphs that can be the yardstick;
- a point too large for every graph's session to hold its memory at once (a large batch of long
  sequences) is warmed up one graph at a time, each session released before the next, and only the
  graphs whose sessions fit in the memory available together are timed (`fit_memory`);
- peak memory is measured per graph in a process of its own, so one session does not hide another's.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaptex.graphs import files
from adaptex.graphs.errors import AdaptexError
from adaptex.graphs.family import family_contract
from adaptex.runtimes import cpu
from adaptex.runtimes._memworker import proc_mb
from adaptex.runtimes.chunks import CHUNK_ROWS, chunk_plan, run_in_chunks, sample_chunks, samples
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner, has_programs, session_options

PRUNE_FACTOR = 1.15  # a dense candidate this much slower than the fastest in warm-up is not timed
# The artifact run as one session (an artifact with programs: runtimes/onnxruntime.py): what an app
# that loads the file in ONNX Runtime itself gets, timed beside the runner's way
ONE_SESSION = "adaptive-one-session"
# How many times the adaptive artifact's memory a dense candidate may need at the same point: at
# elastic-minilm's B64, T = 512 the candidates' sessions peaked at up to 3.7 times the artifact's
# (8.1 GB against 2.2 GB, each in a process of its own: the stock exports hold every head's scores at
# once, the artifact attends a sample at a time). A point where the artifact's first run grew this
# process by more than the memory available / (graphs x this) is warmed up one graph at a time.
HEAVIEST_OVER_ADAPTIVE = 4
MEMORY_SHARE = 0.85  # of the memory available, what the sessions timed together may take
# Generated inputs the timed rounds cycle through. An app meets a new input each call, and an adaptive
# graph's intermediate shapes follow its decisions: ONNX Runtime plans a session's buffers per input
# shape (enable_mem_pattern), a plan that holds for a dense graph whatever the input and not for a
# sparse program whose kept counts change. tsa-charlm's sparse program at B1, T = 512 ran 1.051 of
# itself fed one input repeated when fed 8 in turn, the dense candidates 0.98 to 1.01 (AMD EPYC,
# 2026-12-06, docs/benchmarking.md#how-it-times): one input repeated flattered the artifact.
DISTINCT_INPUTS = 8
DISTINCT_BYTES = 256 << 20  # fewer inputs where they would hold more (a large batch's decode-step caches)


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


def _peak_rss(path: str, inputs: str, threads: int, compute_units: str = "all",
              chunks: tuple[str, int] | None = None) -> float | None:
    """chunks=(rows input, rows): the worker runs the call in chunks of samples, as bench timed it."""
    extra = [chunks[0], str(chunks[1])] if chunks else []
    r = subprocess.run([sys.executable, "-m", "adaptex.runtimes._memworker", path, inputs, str(threads), compute_units,
                        *extra], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def _size_mb(path: str) -> float:
    p = Path(path)
    if p.is_dir():  # an .mlpackage is a directory
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20
    return p.stat().st_size / 2**20


def _ort_runner(path: str, threads: int, programs: bool = False, chunks: tuple[str, int] | None = None,
                memory_plan: bool = True):
    """A callable from feeds to outputs by name: one session of the file, or with programs=True the
    adaptex runner's way (runtimes.onnxruntime.Programs: a session per program of a dispatching
    artifact). chunks=(rows input, rows): a call of more rows runs in chunks of whole samples
    (runtimes/chunks.py), whichever the graph, as the runner runs the artifact. memory_plan: see
    session_options (one session of the file only)."""
    import onnxruntime as ort

    if programs:
        if not memory_plan:
            raise ValueError("_ort_runner: memory_plan=False is for one session of the file, not the runner's programs")
        runner = OnnxRuntimeRunner(path, threads, chunk_rows=chunks[1] if chunks else None).activate()
        names, takes = runner.output_names(), set(runner.input_metadata())
        return lambda feeds: dict(zip(names, runner.run_raw({k: v for k, v in feeds.items() if k in takes})))
    sess = ort.InferenceSession(path, session_options(threads, memory_plan), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    takes = {i.name for i in sess.get_inputs()}  # a dense graph takes no decisions (head_modes)

    def run(feeds: dict) -> dict:
        mine = {k: v for k, v in feeds.items() if k in takes}
        split = sample_chunks(mine, *chunks) if chunks else None
        return dict(zip(names, run_in_chunks(lambda f: sess.run(None, f), mine, split)))
    return run


def _typed(feeds: dict, specs: dict) -> dict:
    """Feeds in the artifact's dtypes (Core ML takes int32 ids and float32 0/1 modes); nested prefill too."""
    return {k: _typed(v, specs) if isinstance(v, dict) else
            (v.astype(specs[k].dtype) if k in specs else v) for k, v in feeds.items()}


def _batch_seq(feeds: dict, batch: int, seq: int) -> tuple[int, int]:
    first = np.asarray(next(iter(feeds.values())))
    return (int(first.shape[0]), int(first.shape[1]) if first.ndim > 1 else seq) if first.ndim else (batch, seq)


def dense_rows(meta: dict) -> int | None:
    """The row count at or below which an artifact exported with dense_rows runs its dense graph."""
    return (meta.get("dispatch") or {}).get("dense_rows")


def ran_variant(meta: dict, batch: int, seq: int) -> str:
    """The lowering a call of (batch, seq) runs: an artifact exported with dense_rows runs its dense
    graph for calls of at most that many token rows."""
    rows = dense_rows(meta)
    if rows is not None and batch * seq <= rows:
        return "dense"
    return meta.get("variant", "sparse")


MASKED_PROGRAMS = ("near-cache decode-step", "masked short-call (attention by sample)", "masked short-call")


def ran_graph(meta: dict, seq: int, past: int, batch: int = 1) -> str | None:
    """Which graph of an artifact with decode-step, short-call or large-call graphs a call of `batch`
    x `seq` new tokens after `past` cached runs ("near-cache decode-step", "decode-step",
    "short-call", "masked short-call (attention by sample)", "masked short-call", "large-call
    (attention by sample)", else "general"), as its top-level Ifs choose (dispatch.taken); None for
    an artifact with none of them, and for a call its dense dispatch sends to the dense graph
    (ran_variant says so)."""
    step, within, large = meta.get("decode_step"), meta.get("short_call"), meta.get("large_call")
    dense_call = dense_rows(meta) is not None and ran_variant(meta, batch, seq) == "dense"
    if (not step and not within and not large) or dense_call:
        return None
    from adaptex.exporter.targets.onnx.dispatch import taken

    role = {"new_tokens_input": (batch, seq), "cache_input": (batch, 1, past, 1), "keys_input": (batch, past + seq),
            "ids_input": (batch, seq)}
    shapes = {name: role[k] for c in (step, within, large) if c for k, name in c.items() if k in role}
    graphs = (["near-cache decode-step"] if step and step.get("near_keys") else []) \
        + (["decode-step"] if step else []) + (["short-call"] if within else []) \
        + (["masked short-call (attention by sample)"] if within and within.get("masked_large_call") else []) \
        + (["masked short-call"] if within and within.get("masked_keys") else []) \
        + (["large-call (attention by sample)"] if large else [])
    path = taken(shapes, decode_step=step, short_call=within, large_call=large)
    return graphs[len(path) - 1] if path and path[-1] else "general"


class Bench:
    """One artifact against its dense candidates: the graphs are built (or read from the cache) once,
    then timed at any number of (batch, seq, past, threads) points. Use as a context manager."""

    def __init__(self, artifact: str | Path, model, info: dict, *, contract=None, compute_units: str = "all",
                 progress=None, cache: bool = True, chunk_rows: int | None = CHUNK_ROWS):
        """chunk_rows (ONNX): a call of more token rows runs in chunks of whole samples of at most that
        many, every graph alike, as adaptex's runner runs the artifact (runtimes/chunks.py; None or 0:
        every call whole)."""
        from adaptex.runtimes.open import artifact_kind, read_metadata

        self.artifact, self.model, self.info = str(artifact), model, info or {}
        self.kind = artifact_kind(artifact)
        self.meta = read_metadata(artifact)
        self.chunks = chunk_plan(self.meta, chunk_rows) if self.kind == "onnx" else None
        self.contract = contract or family_contract(model)
        self.compute_units, self.cache = compute_units, cache
        self.say = progress or (lambda msg: None)
        self._tmp_cm = files.temp_dir("bench")
        self.tmp = self._tmp_cm.__enter__()
        self.graphs: list[Timing] | None = None
        self.runtime = ""
        self._fns: dict = {}  # (name, threads) -> callable(feeds) -> outputs
        self._clocks: dict = {}  # name -> the device time of its last run (TensorRT: CUDA events)
        self._probe: dict | None = None  # cpu.floor_probe, ONNX artifacts only

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self._fns.clear()
        self._tmp_cm.__exit__(None, None, None)

    # --- the graphs --------------------------------------------------------------------------------
    def _build(self) -> None:
        if self.graphs is not None:
            return
        adaptive = Timing("adaptive", self.artifact, how=f"the {self.meta.get('variant')} artifact", dense=False)
        if self.kind == "coreml":
            self.graphs = [adaptive] + self._coreml_graphs()
        elif self.kind == "tensorrt":
            self.graphs = [adaptive] + self._tensorrt_graphs()
        else:
            import onnxruntime as ort

            from adaptex.exporter.counterparts import cached_onnx_candidates

            # the +rows candidates take the softmax floor where it pays on this CPU, as an artifact can
            cands = cached_onnx_candidates(self.model, self.contract, self.tmp, self.say, cache=self.cache,
                                           floor=self.floor_probe()["pays"])
            self.graphs = [adaptive] + [Timing(g.name, g.path, how=g.how, dense=g.dense, reason=g.reason)
                                        for g in cands]
            if has_programs(self.meta):  # what an app that loads the file in ONNX Runtime itself runs
                self.graphs.append(Timing(ONE_SESSION, self.artifact, dense=False,
                                          how="the artifact in one ONNX Runtime session, its top-level Ifs choosing "
                                              "the program"))
            self.runtime = f"onnxruntime {ort.__version__} (CPU)"

    def _coreml_graphs(self) -> list[Timing]:
        import coremltools as ct

        from adaptex.exporter.counterparts import coreml_counterparts
        from adaptex.runtimes import coreml

        if not coreml.available():
            raise AdaptexError("Core ML latency needs the Core ML runtime (macOS); on this machine 'adaptex check' "
                               "verifies the package by MIL reference evaluation, and 'adaptex bench' times .onnx "
                               "artifacts")
        meta = self.meta
        self.say(f"converting the dense counterpart and the naive export with stock coremltools "
                 f"({meta.get('precision')}) ...")
        counterparts = coreml_counterparts(self.model, self.contract, self.tmp, meta.get("precision", "fp16"),
                                           meta.get("min_target", "iOS17"))
        out = [Timing(name, path, how=f"stock coremltools conversion of the {name} model", dense=name != "naive",
                      reason=reason) for name, (path, reason) in counterparts.items()]
        adaptive = coreml.CoreMLRunner(self.artifact, self.compute_units)
        adaptive.activate()
        self._fns[("adaptive", None)] = adaptive.infer
        for t in out:
            if t.path:
                self._fns[(t.name, None)] = coreml.load_predictor(t.path, self.compute_units)
        self.runtime = f"Core ML runtime ({self.compute_units}), coremltools {ct.__version__}"
        return out

    def _tensorrt_graphs(self) -> list[Timing]:
        """A dense engine built from the same checkpoint with the same profile and precision, and the
        stock export's engine where TensorRT builds one. Timed by CUDA events."""
        import tensorrt as trt

        from adaptex.exporter.counterparts import onnx_counterparts
        from adaptex.exporter.metadata import source_of
        from adaptex.exporter.targets import tensorrt
        from adaptex.exporter.targets.tensorrt.engine import build_engine
        from adaptex.runtimes.tensorrt import TensorRTRunner

        meta, tmp, say = self.meta, self.tmp, self.say
        prof, precision = meta["tensorrt"]["profile"], meta.get("precision", "fp32")
        say(f"building the dense counterpart engine ({precision}) ...")
        data, dmeta = tensorrt.bound_onnx(self.model, self.contract, source_of(self.model, self.info), variant="dense")
        dmeta["tensorrt"]["profile"] = prof
        build_engine(data, dmeta, tmp / "dense.plan", precision=precision, timing_cache=None, say=say)
        out = [Timing("dense", str(tmp / "dense.plan"), how="the dense model's engine, same profile and precision")]
        naive, reason = onnx_counterparts(self.model, self.contract, tmp)["naive"]
        how = "TensorRT's engine of the stock export of the masked inference path"
        if naive:
            try:
                build_engine(Path(naive).read_bytes(), dmeta, tmp / "naive.plan", precision=precision,
                             timing_cache=None, say=say, pin=False)
                out.append(Timing("naive", str(tmp / "naive.plan"), how=how, dense=False))
            except Exception as e:
                out.append(Timing("naive", None, how=how, dense=False,
                                  reason=f"TensorRT did not build the stock export: {str(e).splitlines()[0][:160]}"))
        else:
            out.append(Timing("naive", None, how=how, dense=False, reason=reason))
        for t in [Timing("adaptive", self.artifact)] + out:
            if t.path:
                r = TensorRTRunner(t.path).activate()
                self._fns[(t.name, None)], self._clocks[t.name] = r.run_raw, (lambda r=r: r.last_ms)
        self.runtime = f"TensorRT {trt.__version__} ({precision}, CUDA-event timing)"
        return out

    def _fn(self, t: Timing, threads: int):
        if self.kind != "onnx":
            return self._fns.get((t.name, None))
        key = (t.name, threads)
        if key not in self._fns:
            self._fns[key] = _ort_runner(t.path, threads, programs=t.name == "adaptive", chunks=self.chunks)
        return self._fns[key]

    def _ran(self, t: Timing, feeds: dict) -> str:
        """The file of the graph `t` ran at these feeds: for an artifact with programs, the program
        the call took (written once to the work directory), which the runner runs as its session."""
        if t.name != "adaptive" or self.kind != "onnx" or not has_programs(self.meta):
            return t.path
        from adaptex.runtimes.onnxruntime import Programs

        programs = Programs(Path(t.path), self.meta, None)
        path = self.tmp / f"program-{'-'.join('then' if x else 'else' for x in programs.taken(feeds))}.onnx"
        if not path.exists():
            import onnx

            onnx.save(programs.model(feeds), str(path))
        return str(path)

    def _fresh_sessions(self, live: list[Timing], block: int, threads: int, feeds: dict, fns: dict) -> None:
        """New ONNX Runtime sessions in `fns` for the graphs of block `block`, created in the order of
        `live` rotated by `block` places, each run once before timing. A session runs faster the later
        it was created in a process: of four sessions of one dense graph created in a row, the last
        took 0.92 to 0.94 of the first's time a B1 decode step of tsa-charlm, and the ranking reversed
        when they were created again in the reverse order (ONNX Runtime 1.32, 1 thread; cause not
        found; docs/benchmarking.md#how-it-times). Rotating the order from block to block moves every
        graph through the positions, so the order falls into the interval over blocks instead of into
        one graph's figure (the adaptive artifact's, created first)."""
        self.say(f"block {block + 1}: new sessions, the order rotated by {block % len(live)} ...")
        self._release(threads, fns)  # the previous block's sessions go before the new ones take their memory
        order = live[block % len(live):] + live[:block % len(live)]
        for t in order:
            fns[t.name] = self._fn(t, threads)
            fns[t.name](feeds)

    def _release(self, threads: int, fns: dict) -> None:
        """Drop every session of `threads` threads (the pruned graphs' too) and the callables in `fns`."""
        for key in [k for k in self._fns if k[1] == threads]:
            del self._fns[key]
        fns.clear()
        gc.collect()

    def _warm_alone(self, live: list[Timing], threads: int, inputs: list[dict], warmup: int, fns: dict,
                    prune: bool) -> tuple[list[Timing], dict[str, float]]:
        """The warm-up of a point too large for every session to hold its memory at once: each graph's
        session is made, warmed up and released in turn, what it took measured as the growth of this
        process's resident set. After the slow candidates are pruned, the graphs timed are those
        whose sessions fit in the memory available together (`fit_memory`). (graphs, warm-up ms)"""
        self._release(threads, fns)
        budget = MEMORY_SHARE * proc_mb("/proc/meminfo", "MemAvailable")
        warm, need = {}, {}
        for t in live:
            base = proc_mb("/proc/self/status", "VmRSS")
            warm.update(warm_up([t], {t.name: self._fn(t, threads)}, inputs, warmup))
            need[t.name] = proc_mb("/proc/self/status", "VmRSS") - base
            self._release(threads, fns)
        if prune and warmup >= 3:
            live = prune_slow(live, warm)
        return fit_memory(live, warm, need, budget), warm

    # --- the inputs --------------------------------------------------------------------------------
    def _feeds(self, batch: int, seq: int, past: int, feeds: dict | None, specs: dict,
               seed: int = 0) -> tuple[dict, int, int]:
        from adaptex.runtimes.base import limits_of, validate_feeds

        contract, meta = self.contract, self.meta
        if past and not contract.decoder:
            raise AdaptexError("--past applies to decoders only: it times decode steps on a KV cache")
        if feeds is None:
            feeds = contract.bench_feeds((self.info.get("training") or {}).get("task"), batch, seq, past, seed=seed)
            if feeds is None:
                raise AdaptexError("this model has no input generator for benchmarks; pass the inputs to time "
                                   "(adaptex.bench(path, model, inputs=[...]))")
        else:
            batch, seq = _batch_seq(feeds, batch, seq)
        feeds = _typed(dict(feeds), specs)
        limits = limits_of(meta)
        if "_prefill" not in feeds:
            validate_feeds(dict(feeds), specs, limits)
        elif limits and past + seq > limits.max_sequence:
            raise AdaptexError(f"{past} cached + {seq} new tokens = {past + seq} exceed the model's maximum "
                               f"{limits.max_sequence}; lower --past or --seq")
        return feeds, batch, seq

    def _fill_cache(self, feeds: dict, run) -> dict:
        """A decode point's inputs with a realistic cache: `run` (the adaptive artifact) prefills the
        preceding text, and its present keys and values become the step's past."""
        if "_prefill" not in feeds:
            return feeds
        contract = self.contract
        pre_feeds = feeds.pop("_prefill")
        pre = run(pre_feeds)
        feeds.update({k.replace("present.", "past_key_values."): v for k, v in pre.items()
                      if k.startswith("present.")})
        if contract.decoder:
            extra = {k: v for k, v in pre_feeds.items() if k in contract.extra_inputs()}
            feeds.update(_typed(contract.next_extra(pre, 0, extra), self._specs()))
        return feeds

    def inputs(self, run, *, batch: int = 1, seq: int = 128, past: int = 0) -> dict:
        """The inputs bench times at one point, a decode step's cache prefilled by `run` (a callable
        from feeds to outputs by name, for the artifact or another of the same model)."""
        feeds, _, _ = self._feeds(batch, seq, past, None, self._specs())
        return self._fill_cache(feeds, run)

    def _specs(self) -> dict:
        if self.kind == "coreml":
            from adaptex.runtimes.coreml_mil import input_specs

            return input_specs(self.meta)
        from adaptex.runtimes.open import open_artifact

        return open_artifact(self.artifact, 1).input_metadata()

    def ran_variant(self, batch: int, seq: int) -> str:
        return ran_variant(self.meta, batch, seq)

    # --- one point ---------------------------------------------------------------------------------
    def run(self, *, batch: int = 1, seq: int = 128, past: int = 0, threads: int = 1, feeds: dict | None = None,
            warmup: int = 10, runs: int | None = None, blocks: int = 5, time_budget_s: float = 8.0,
            memory: bool = True, profile: bool = False, prune: bool = True, min_runs: int = 30,
            distinct: int = DISTINCT_INPUTS) -> dict:
        """Time every graph at one point; the dict `format_bench` prints. distinct: generated inputs
        (seeds 0, 1, ...) that the rounds cycle through, every graph the same one in a round; fewer
        where they would take more than DISTINCT_BYTES; 1 with given feeds."""
        self._build()
        say, contract = self.say, self.contract
        given = feeds is not None
        specs = self._specs()
        feeds, batch, seq = self._feeds(batch, seq, past, feeds, specs)
        graphs = [Timing(t.name, t.path, how=t.how, dense=t.dense, reason=t.reason) for t in self.graphs]
        fns = {t.name: self._fn(t, threads) for t in graphs if t.path and t.reason is None}
        fns = {k: v for k, v in fns.items() if v is not None}
        feeds = self._fill_cache(feeds, fns["adaptive"])
        nbytes = sum(np.asarray(v).nbytes for v in feeds.values())
        n_inputs = 1 if given else min(distinct, max(1, DISTINCT_BYTES // max(nbytes, 1)))
        inputs = [feeds] + [self._fill_cache(self._feeds(batch, seq, past, None, specs, seed=s)[0], fns["adaptive"])
                            for s in range(1, n_inputs)]
        if len(inputs) > 1:
            say(f"{len(inputs)} distinct inputs, cycled: every graph runs the same one in a round ...")
        chunks = sample_chunks(feeds, *self.chunks) if self.chunks else None
        # one call as the runner makes it (a chunk of a large batch): the program it takes, its profile
        call = {k: v[chunks[0]] for k, v in feeds.items()} if chunks else feeds
        call_batch = _batch_seq(call, batch, seq)[0] if chunks else batch
        if chunks:
            say(f"every graph runs this batch in calls of at most {samples(call_batch)} ({self.chunks[1]} token "
                "rows: --chunk-rows) ...")
        before = proc_mb("/proc/self/status", "VmRSS")
        # each input's outputs for the FLOP accounting, less a decoder's present caches (8 large batches' caches)
        adaptive_outs = [{k: v for k, v in fns["adaptive"](f).items() if not k.startswith("present.")}
                         for f in inputs]
        after, available = proc_mb("/proc/self/status", "VmRSS"), proc_mb("/proc/meminfo", "MemAvailable")

        live = [t for t in graphs if t.name in fns]
        bounded = (self.kind == "onnx" and None not in (before, after, available)
                   and (after - before) * len(live) * HEAVIEST_OVER_ADAPTIVE > available)
        if bounded:
            say(f"the artifact's first run took {after - before:.0f} MB: warming up the {len(live)} graphs one at "
                f"a time ({warmup} runs each) and timing those whose sessions fit in memory together ...")
            live, warm = self._warm_alone(live, threads, inputs, warmup, fns, prune)
        else:
            say(f"warming up {len(live)} graphs ({warmup} runs each) ...")
            warm = warm_up(live, fns, inputs, warmup)
            if prune and warmup >= 3:
                live = prune_slow(live, warm)
        per_round = sum(warm[t.name] for t in live) / 1e3
        n = runs or int(min(500, max(min_runs, time_budget_s / max(per_round, 1e-6))))
        nblocks = max(1, min(blocks, n // 5))
        sizes = [n // nblocks + (1 if i < n % nblocks else 0) for i in range(nblocks)]
        say(f"timing {n} rounds of {len(live)} graphs in {nblocks} interleaved blocks ...")
        rng = np.random.default_rng(0)
        for b, size in enumerate(sizes):
            if (b or bounded) and self.kind == "onnx":  # bounded: the warm-up released every session
                self._fresh_sessions(live, b, threads, feeds, fns)
            first = sum(sizes[:b])  # the rounds before this block: the inputs go on cycling across blocks
            for r in range(first, first + size):
                round_input = inputs[r % len(inputs)]
                for i in rng.permutation(len(live)):
                    t = live[i]
                    t0 = time.perf_counter_ns()
                    fns[t.name](round_input)
                    wall = (time.perf_counter_ns() - t0) / 1e6
                    t.times_ms.append(self._clocks[t.name]() if t.name in self._clocks else wall)
                    t.block_of.append(b)
        if bounded:  # the profile's and the memory workers' sessions take their memory alone too
            self._release(threads, fns)
        profiles = None
        if profile:
            if self.kind != "onnx":
                raise AdaptexError("--profile reads ONNX Runtime's profiler: it applies to .onnx artifacts")
            say("profiling the adaptive graph and the fastest dense graph ...")
            fastest = _fastest(graphs)
            profiles = {t.name: profile_onnx(self._ran(t, call), call, threads, self.tmp)
                        for t in graphs if t.name == "adaptive" or (fastest and t.name == fastest.name)}
        if memory:
            say("measuring peak memory in separate processes ...")
            npz = self.tmp / "inputs.npz"
            np.savez(npz, **feeds)
            fastest = _fastest(graphs)
            for t in live:
                t.size_mb = _size_mb(t.path)
                if t.name in ("adaptive", "dense", "naive") or (fastest and t.name == fastest.name):
                    t.peak_rss_mb = _peak_rss(self._ran(t, call), str(npz), threads, self.compute_units, self.chunks)
        flops = self._flops(adaptive_outs, batch, seq, past, call_batch, chunks)
        report = _report(self, graphs, flops, batch=batch, seq=seq, past=past, threads=threads, warmup=warmup,
                         blocks=nblocks, profiles=profiles, call_batch=call_batch, distinct=len(inputs))
        if self.kind == "onnx":
            # artifacts from before the option have it where they target ONNX Runtime (not TensorRT-bound ONNX)
            floored = self.meta.get("softmax_floor", self.meta.get("target", "onnx") == "onnx")
            report["softmax_floor"] = {"in_artifact": bool(floored), **self.floor_probe()}
        return report

    def _flops(self, outs: list[dict], batch: int, seq: int, past: int, call_batch: int, chunks) -> dict:
        """The contract's FLOP accounting of the artifact's outputs, its ratios averaged over the inputs
        the rounds cycled through (each input's rounds are equally many, give or take one)."""
        contract = self.contract
        # an elastic decoder's programs that attend every key, masked
        masked = ran_graph(self.meta, seq, past, call_batch) in MASKED_PROGRAMS
        kw = dict(target=self.meta.get("target", "onnx"), **({"masked_program": True} if masked else {}))
        variant = self.ran_variant(call_batch, seq)
        each = []
        for adaptive_out in outs:
            out = {k: np.asarray(v) for k, v in adaptive_out.items()}
            one = contract.flops(out, variant, seq, past, **kw) or {}
            if chunks and len(chunks) > 1 and "executed_flop_ratio" in one:
                # what each call executed (a body chosen by its own samples' decisions), weighted by its samples
                parts = [(contract.flops({k: v[c] for k, v in out.items()}, variant, seq, past, **kw),
                          len(range(batch)[c])) for c in chunks]
                one["executed_flop_ratio"] = sum(f["executed_flop_ratio"] * n for f, n in parts) / batch
            each.append(one)
        flops = dict(each[0])
        for key in ("flop_ratio", "executed_flop_ratio"):
            if flops.get(key) is not None:
                flops[key] = float(np.mean([f[key] for f in each]))
        return flops

    def floor_probe(self) -> dict:
        """cpu.floor_probe (1 thread), once a bench: whether the softmax floor pays on this CPU."""
        if self._probe is None:
            self.say("timing a causal Softmax plain and with the softmax floor on this CPU ...")
            self._probe = cpu.floor_probe(1)
        return self._probe


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


def _fastest(graphs: list[Timing]) -> Timing | None:
    timed = [t for t in graphs if t.dense and t.times_ms]
    return min(timed, key=lambda t: t.pct(50)) if timed else None


def _interval(values: list[float]) -> list[float] | None:
    return [float(min(values)), float(max(values))] if len(values) > 1 else None


def _report(bench: Bench, graphs: list[Timing], flops: dict, *, batch, seq, past, threads, warmup, blocks,
            profiles, call_batch=None, distinct: int = 1) -> dict:
    """FLOPs implied by the decisions (per sample: the saving the model asked for) and executed by the
    artifact (the dense variant everything; the sparse one, in a batch, the batch's largest count for
    every sample). Realisation is measured against the decisions, so work a lowering wastes counts
    against it; ratios per block, reported as the median and the min-max over blocks. call_batch: the
    samples a call held (fewer than batch where every graph ran the batch in chunks); distinct: the
    inputs the rounds cycled through."""
    call_batch = call_batch or batch
    flops = dict(flops)
    flop_ratio = flops.pop("flop_ratio", None)
    executed_ratio = flops.pop("executed_flop_ratio", None)
    ad = graphs[0]
    fastest = _fastest(graphs)
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
    iv = _interval(ratios)
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
        "ran_variant": ran_variant(bench.meta, call_batch, seq),
        "chunk_samples": call_batch if call_batch < batch else None,
        "chunk_rows": bench.chunks[1] if bench.chunks else None,
        "dense_rows": dense_rows(bench.meta), "ran_graph": ran_graph(bench.meta, seq, past, call_batch),
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
        "realisation": realisation, "realisation_interval": _interval(realisations),
        "naive_latency_ratio": naive_ratio, "one_session_ratio": one_ratio,
        "candidates": candidates, "stats": stats,
        "size_mb": {t.name: t.size_mb for t in graphs if t.size_mb is not None},
        "peak_rss_mb": {t.name: t.peak_rss_mb for t in graphs if t.peak_rss_mb is not None},
        "warnings": warnings, "profile": profiles,
    }


def run_bench(artifact: str | Path, model, info: dict, *, batch: int = 1, seq: int = 128, threads: int = 1,
              warmup: int = 10, runs: int | None = None, time_budget_s: float = 8.0,
              progress=None, compute_units: str = "all", past: int = 0, feeds: dict | None = None,
              contract=None, blocks: int = 5, profile: bool = False, cache: bool = True,
              chunk_rows: int | None = CHUNK_ROWS) -> dict:
    """Time the artifact against every dense candidate and the naive export, interleaved, at one point."""
    with Bench(artifact, model, info, contract=contract, compute_units=compute_units, progress=progress,
               cache=cache, chunk_rows=chunk_rows) as b:
        return b.run(batch=batch, seq=seq, past=past, threads=threads, feeds=feeds, warmup=warmup, runs=runs,
                     blocks=blocks, time_budget_s=time_budget_s, profile=profile)


# --- the profiler ------------------------------------------------------------------------------------

CONTROL_FLOW = ("If", "Loop", "Scan")


def profile_onnx(path: str, feeds: dict, threads: int, workdir: Path, runs: int = 30) -> dict:
    """ONNX Runtime's profiler over `runs` runs: kernel time and kernel count per run by op type, split
    between the adaptive ops (the nodes of adaptex:: functions) and the rest of the graph, and the run's
    time outside its kernels (the profiled run less its kernels: dispatch, allocation, control flow;
    at short calls a graph of more kernels loses most of its gap there). The profiled copy names
    every function node as an op's (passes.name_op_nodes; the computation is the same), and a
    dense-dispatch branch holds its calls inlined under such names already. A fusion that names its
    node afresh (BiasGelu, FusedMatMul) loses the mark: its kernel counts with the rest."""
    import onnx
    import onnxruntime as ort

    from adaptex.exporter.targets.onnx.passes import OP_NODE, name_op_nodes

    model = onnx.load(path)
    if name_op_nodes(model):
        path = str(Path(workdir) / f"profiled-{Path(path).name}")
        onnx.save(model, path)
    so = session_options(threads)
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(workdir) / f"profile-{Path(path).stem}")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    takes = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in takes}
    warm = 3  # the first runs allocate: only the steady-state runs after them count
    for _ in range(warm + runs):
        sess.run(None, feeds)
    trace = Path(sess.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink(missing_ok=True)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[warm:]
    # per run: kernel ms by op type (control flow excluded: its time is its subgraphs' kernels, which
    # the profiler lists themselves); then the median over runs, so that a run a neighbour slowed
    # does not skew the breakdown on a shared machine
    per_run, counts = [dict() for _ in spans], [dict() for _ in spans]
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        op = e.get("args", {}).get("op_name", "?")
        if op in CONTROL_FLOW:
            continue
        run = next((i for i, (a, b) in enumerate(spans) if a <= e["ts"] <= b), None)
        if run is None:
            continue  # a warm-up run
        key = f"{op} (adaptive)" if OP_NODE in e["name"] else op
        per_run[run][key] = per_run[run].get(key, 0.0) + e.get("dur", 0) / 1e3
        counts[run][key] = counts[run].get(key, 0) + 1
    keys = {k for r in per_run for k in r}
    by_op = {k: float(np.median([r.get(k, 0.0) for r in per_run])) for k in keys}
    adaptive = sum(v for k, v in by_op.items() if k.endswith("(adaptive)"))
    rest = sum(by_op.values()) - adaptive
    run_ms = float(np.median([(b - a) / 1e3 for a, b in spans])) if spans else 0.0
    return {"runs": len(per_run), "total_ms": adaptive + rest, "adaptive_ms": adaptive, "rest_ms": rest,
            "run_ms": run_ms, "outside_ms": max(run_ms - adaptive - rest, 0.0),
            "kernels": int(np.median([sum(c.values()) for c in counts])) if counts else 0,
            "by_op_ms": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
            "by_op_kernels": {k: int(np.median([c.get(k, 0) for c in counts])) for k in keys}}
