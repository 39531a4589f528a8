"""Does an adaptive model's saving survive Triton's dynamic batching?

Serves an artifact, the fastest dense graph of the same weights (bench's dense candidates, the
fastest by a short direct timing at the middle length) and a byte copy of that dense graph (the copy
control: two servings of one file, whose ratio shows the measurement's spread) through `adaptex
serve`, all three at once. It drives each with the same requests (mixed lengths, one sample each) at
several concurrencies, in interleaved rounds (the order rotating each round), and prints the median
throughput and p50/p99 latency per graph and the adaptive/dense and copy/dense ratios, median
[min, max] over rounds. Run it on a quiet machine.

    python examples/triton_load.py build/bf.onnx --concurrency 1,8,32 --requests 400 --rounds 5
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort


def _requests(meta: dict, n: int, lengths: list[int], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    vocab = int((meta.get("config") or {}).get("vocab_size", 100))
    out = []
    for _ in range(n):
        t = int(rng.choice(lengths))
        ids = rng.integers(1, vocab, (1, t)).astype(np.int64)
        out.append({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    return out


def _fastest_dense(artifact: Path, meta: dict, workdir: Path, length: int) -> Path:
    from adaptex.exporter.counterparts import cached_onnx_candidates
    from adaptex.runtimes.source import contract_of, load_source_model

    model, _ = load_source_model(meta, None)
    graphs = [g for g in cached_onnx_candidates(model, contract_of(meta, model), workdir) if g.path and g.dense]
    feeds = _requests(meta, 1, [length])[0]
    best, best_t = None, float("inf")
    for g in graphs:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sess = ort.InferenceSession(g.path, so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        f = {k: v for k, v in feeds.items() if k in names}
        sess.run(None, f)
        t0 = time.perf_counter()
        for _ in range(10):
            sess.run(None, f)
        t = time.perf_counter() - t0
        if t < best_t:
            best, best_t = g, t
    print(f"dense yardstick: {best.name} ({best_t / 10 * 1e3:.2f} ms at T = {length}, direct)")
    return Path(best.path)


def _drive(port: int, name: str, requests: list[dict], concurrency: int, outputs: list[str]) -> dict:
    import tritonclient.http as th

    from adaptex.runtimes.triton.server import http_inputs

    def one(feeds):
        client = th.InferenceServerClient(f"127.0.0.1:{port}")
        inputs = http_inputs(feeds)
        t0 = time.perf_counter()
        client.infer(name, inputs, outputs=[th.InferRequestedOutput(o) for o in outputs])
        return time.perf_counter() - t0

    for feeds in requests[:8]:
        one(feeds)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        lat = np.array(list(pool.map(one, requests)))
    wall = time.perf_counter() - t0
    return {"rps": len(requests) / wall, "p50": np.percentile(lat, 50) * 1e3, "p99": np.percentile(lat, 99) * 1e3}


def _ratio(a: list[float], b: list[float]) -> str:
    r = np.array(a) / np.array(b)
    return f"{np.median(r):.3f} [{r.min():.3f}, {r.max():.3f}]"


def main() -> None:
    import platform
    import shutil

    from adaptex.runtimes.open import read_metadata
    from adaptex.runtimes.triton.server import Server

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--lengths", default="16,32,64,128")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--port", type=int, default=8100, help="the first of 9 ports (3 a server)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--workdir", default="build/triton-load")
    args = p.parse_args()
    artifact = Path(args.artifact)
    meta = read_metadata(artifact)
    lengths = [int(x) for x in args.lengths.split(",")]
    conc = [int(x) for x in args.concurrency.split(",")]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    dense = _fastest_dense(artifact, meta, work, lengths[len(lengths) // 2])
    copy = work / f"copy-of-{dense.name}"
    shutil.copyfile(dense, copy)
    dense_sess = ort.InferenceSession(str(dense), providers=["CPUExecutionProvider"])
    dense_outs = [o.name for o in dense_sess.get_outputs()]
    first = next(iter(meta["outputs"]))
    dense_meta = {**meta, "inputs": {i.name: meta["inputs"][i.name] for i in dense_sess.get_inputs()},
                  "outputs": {dense_outs[0]: meta["outputs"][first]}, "decisions": {}}
    requests = _requests(meta, args.requests, lengths, seed=1)
    graphs = [("adaptive", artifact, None, list(meta["outputs"])), ("dense", dense, dense_meta, dense_outs[:1]),
              ("copy", copy, dense_meta, dense_outs[:1])]
    rows: dict = {}
    servers = [Server(path, port=args.port + 3 * i, max_batch=args.max_batch, name=f"load-{tag}", meta=m)
               for i, (tag, path, m, _) in enumerate(graphs)]
    try:
        for server in servers:
            server.start()
        for r in range(args.rounds):
            for c in conc:
                for k in range(len(graphs)):
                    i = (k + r) % len(graphs)
                    tag, outs = graphs[i][0], graphs[i][3]
                    rows.setdefault((tag, c), []).append(_drive(servers[i].port, servers[i].name, requests, c, outs))
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {artifact.name}: "
          f"{args.requests} requests of lengths {lengths} a drive, {args.rounds} rounds, max batch {args.max_batch}, "
          "1 instance and 1 thread a server")
    print(f"{'concurrency':>11} {'graph':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}   (medians over rounds)")
    for c in conc:
        for tag, *_ in graphs:
            med = {k: float(np.median([x[k] for x in rows[(tag, c)]])) for k in ("rps", "p50", "p99")}
            print(f"{c:>11} {tag:>9} {med['rps']:8.1f} {med['p50']:8.2f} {med['p99']:8.2f}")
        d = rows[("dense", c)]
        for tag in ("adaptive", "copy"):
            x = rows[(tag, c)]
            print(f"{c:>11} {tag + '/dense':>15}  throughput {_ratio([e['rps'] for e in x], [e['rps'] for e in d])}"
                  f"  p50 {_ratio([e['p50'] for e in x], [e['p50'] for e in d])}"
                  f"  p99 {_ratio([e['p99'] for e in x], [e['p99'] for e in d])}")


if __name__ == "__main__":
    main()
