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
import time
from pathlib import Path

import numpy as np

from adaptex.graphs import files
from adaptex.graphs.errors import AdaptexError
from adaptex.graphs.family import family_contract
from adaptex.runtimes import cpu
from adaptex.runtimes._memworker import proc_mb
from adaptex.runtimes.bench_accounting import ONE_SESSION, bench_report, program_entry
from adaptex.runtimes.bench_candidates import (coreml_graphs, ort_runner, peak_rss, size_mb,
                                               tensorrt_graphs)
from adaptex.runtimes.chunks import CHUNK_ROWS, chunk_plan, sample_chunks, samples
from adaptex.runtimes.onnxruntime import has_programs
from adaptex.runtimes.profile import profile_onnx
from adaptex.runtimes.timing import Timing, fastest_dense, fit_memory, prune_slow, warm_up

# How many times the adaptive artifact's memory a dense candidate may need at the same point (the stock
# exports hold every head's scores at once, the artifact attends a sample at a time): a point where the
# artifact's first run grew this process by more than the memory available / (graphs x this) is warmed
# up one graph at a time.
HEAVIEST_OVER_ADAPTIVE = 4
MEMORY_SHARE = 0.85  # of the memory available, what the sessions timed together may take
# Generated inputs the timed rounds cycle through: an app meets a new input each call, and ONNX Runtime
# plans a session's buffers per input shape, a plan that holds for a dense graph whatever the input but
# not for a sparse program whose kept counts change, so one input repeated would flatter the artifact.
DISTINCT_INPUTS = 8
DISTINCT_BYTES = 256 << 20  # fewer inputs where they would hold more (a large batch's decode-step caches)


def _typed(feeds: dict, specs: dict) -> dict:
    """Feeds in the artifact's dtypes (Core ML takes int32 ids and float32 0/1 modes); nested prefill too."""
    return {k: _typed(v, specs) if isinstance(v, dict) else
            (v.astype(specs[k].dtype) if k in specs else v) for k, v in feeds.items()}


def _batch_seq(feeds: dict, batch: int, seq: int) -> tuple[int, int]:
    first = np.asarray(next(iter(feeds.values())))
    return (int(first.shape[0]), int(first.shape[1]) if first.ndim > 1 else seq) if first.ndim else (batch, seq)


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
            graphs, self._fns, self.runtime = coreml_graphs(self.model, self.contract, self.meta, self.artifact,
                                                            self.tmp, self.say, self.compute_units)
            self.graphs = [adaptive] + graphs
        elif self.kind == "openvino":
            from adaptex.runtimes.bench_openvino import openvino_graphs
            from adaptex.runtimes.openvino import inference_precision

            graphs, self.runtime = openvino_graphs(self.model, self.contract, self.tmp, self.say, self.cache,
                                                   inference_precision(self.meta))
            self.graphs = [adaptive] + graphs
        elif self.kind == "tensorrt":
            graphs, self._fns, self._clocks, self.runtime = tensorrt_graphs(self.model, self.contract, self.meta,
                                                                            self.info, self.artifact, self.tmp, self.say)
            self.graphs = [adaptive] + graphs
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

    def _fn(self, t: Timing, threads: int):
        if self.kind == "openvino":  # compiled for the point's thread count, as ONNX Runtime's sessions
            from adaptex.runtimes.bench_openvino import openvino_runner
            from adaptex.runtimes.openvino import inference_precision

            if (t.name, threads) not in self._fns:
                self._fns[(t.name, threads)] = openvino_runner(t.path, threads, inference_precision(self.meta))
            return self._fns[(t.name, threads)]
        if self.kind != "onnx":
            return self._fns.get((t.name, None))
        key = (t.name, threads)
        if key not in self._fns:
            self._fns[key] = ort_runner(t.path, threads, programs=t.name == "adaptive", chunks=self.chunks)
        return self._fns[key]

    def _ran(self, t: Timing, feeds: dict) -> str:
        """The file of the graph `t` ran at these feeds: for an artifact with programs, the program
        the call took (written once to the work directory), which the runner runs as its session."""
        if t.name != "adaptive" or self.kind != "onnx" or not has_programs(self.meta):
            return t.path
        from adaptex.runtimes.onnxruntime import Programs

        programs = Programs(Path(t.path), self.meta, None)
        path = self.tmp / f"program-{programs.names.index(programs.chosen(feeds))}.onnx"
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

    # --- one point ---------------------------------------------------------------------------------
    def run(self, *, batch: int = 1, seq: int = 128, past: int = 0, threads: int = 1, feeds: dict | None = None,
            warmup: int = 10, runs: int | None = None, blocks: int = 5, time_budget_s: float = 8.0,
            memory: bool = True, profile: bool = False, prune: bool = True, min_runs: int = 30,
            distinct: int = DISTINCT_INPUTS) -> dict:
        """Time every graph at one point; the dict `format_bench` prints. distinct: generated inputs
        (seeds 0, 1, ...) that the rounds cycle through, every graph the same one in a round; fewer
        where they would take more than DISTINCT_BYTES; 1 with given feeds."""
        self._build()
        if self.kind == "openvino":
            # compiled afresh for each point: a dense "+rows" graph compiled for an earlier, smaller
            # point ran B8, T = 512 in 22 ms, against 228 ms compiled for it (OpenVINO 2026.4.1, bf16)
            self._fns.clear()
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
            fastest = fastest_dense(graphs)
            profiles = {t.name: profile_onnx(self._ran(t, call), call, threads, self.tmp)
                        for t in graphs if t.name == "adaptive" or (fastest and t.name == fastest.name)}
        if memory:
            say("measuring peak memory in separate processes ...")
            npz = self.tmp / "inputs.npz"
            np.savez(npz, **feeds)
            fastest = fastest_dense(graphs)
            for t in live:
                t.size_mb = size_mb(t.path)
                # the memory worker runs ONNX files in ONNX Runtime: an OpenVINO point reports sizes only
                if self.kind != "openvino" and (t.name in ("adaptive", "dense", "naive")
                                                or (fastest and t.name == fastest.name)):
                    t.peak_rss_mb = peak_rss(self._ran(t, call), str(npz), threads, self.compute_units, self.chunks)
        program = program_entry(self.meta, call) if self.kind == "onnx" else None
        flops = self._flops(adaptive_outs, batch, seq, past, chunks, program)
        report = bench_report(self, graphs, flops, batch=batch, seq=seq, past=past, threads=threads, warmup=warmup,
                              blocks=nblocks, profiles=profiles, call_batch=call_batch, distinct=len(inputs),
                              program=program)
        if self.kind == "onnx":
            # artifacts from before the option have it where they target ONNX Runtime (not TensorRT-bound ONNX)
            floored = self.meta.get("softmax_floor", self.meta.get("target", "onnx") == "onnx")
            report["softmax_floor"] = {"in_artifact": bool(floored), **self.floor_probe()}
        return report

    def _flops(self, outs: list[dict], batch: int, seq: int, past: int, chunks, program: dict | None) -> dict:
        """The contract's FLOP accounting of the artifact's outputs, its ratios averaged over the inputs
        the rounds cycled through (each input's rounds are equally many, give or take one). program: the
        metadata's entry of the program the call ran (its variant; masked: it attends every key)."""
        contract = self.contract
        program = program or {}
        kw = dict(target=self.meta.get("target", "onnx"), **({"masked_program": True} if program.get("masked") else {}))
        if "policy" in self.meta:  # the thresholds the artifact's bodies were built with
            from adaptex.graphs.ops.policy import OrtPolicy

            kw["policy"] = OrtPolicy.from_dict(self.meta["policy"])
        variant = program.get("variant", self.meta.get("variant", "sparse"))
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
