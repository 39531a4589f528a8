"""Does an adaptive model's saving survive Triton's dynamic batching?

Serves an artifact and the fastest dense graph of the same weights (bench's dense candidates, the
fastest by a short direct timing at the middle length) through `adaptex serve` in turn, drives each
with the same requests (mixed lengths, one sample each) at several concurrencies, and prints
throughput and p50/p99 latency per graph, and the adaptive/dense ratios. Run it on a quiet machine.

    python examples/triton_load.py build/bf.onnx --concurrency 1,8,32 --requests 400
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


def main() -> None:
    from adaptex.runtimes.open import read_metadata
    from adaptex.runtimes.triton.server import Server

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--lengths", default="16,32,64,128")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--workdir", default="build/triton-load")
    args = p.parse_args()
    artifact = Path(args.artifact)
    meta = read_metadata(artifact)
    lengths = [int(x) for x in args.lengths.split(",")]
    conc = [int(x) for x in args.concurrency.split(",")]
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    dense = _fastest_dense(artifact, meta, Path(args.workdir), lengths[len(lengths) // 2])
    dense_sess = ort.InferenceSession(str(dense), providers=["CPUExecutionProvider"])
    dense_outs = [o.name for o in dense_sess.get_outputs()]
    first = next(iter(meta["outputs"]))
    dense_meta = {**meta, "inputs": {i.name: meta["inputs"][i.name] for i in dense_sess.get_inputs()},
                  "outputs": {dense_outs[0]: meta["outputs"][first]}, "decisions": {}}
    requests = _requests(meta, args.requests, lengths, seed=1)
    rows = {}
    for tag, path, m, outs in (("adaptive", artifact, None, list(meta["outputs"])),
                               ("dense", dense, dense_meta, dense_outs[:1])):
        with Server(path, port=args.port, max_batch=args.max_batch, name=f"load-{tag}", meta=m) as server:
            for c in conc:
                rows[(tag, c)] = _drive(server.port, server.name, requests, c, outs)
    print(f"{'concurrency':>11} {'graph':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for c in conc:
        for tag in ("adaptive", "dense"):
            r = rows[(tag, c)]
            print(f"{c:>11} {tag:>9} {r['rps']:8.1f} {r['p50']:8.2f} {r['p99']:8.2f}")
        a, d = rows[("adaptive", c)], rows[("dense", c)]
        print(f"{c:>11} {'ratio':>9} {a['rps'] / d['rps']:8.3f} {a['p50'] / d['p50']:8.3f} {a['p99'] / d['p99']:8.3f}")


if __name__ == "__main__":
    main()
