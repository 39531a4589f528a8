"""The model side of `adaptex serve`: an artifact's ONNX file bound to NVIDIA Triton through PyTriton.

It runs in the serving interpreter (the one whose libpython PyTriton's bundled Python backend links;
runtimes/triton/server.py chooses it) and imports nothing of adaptex, torch or the project's venv:
numpy, onnxruntime and pytriton only. Each request batch runs through one ONNX Runtime session of the
whole file, its `If`s choosing the program as in any app that loads it. Decisions are outputs like
any other, so every response carries them.

    python worker.py MODEL_DIR --http-port P --grpc-port G --metrics-port M [--instances N]

MODEL_DIR is a directory `adaptex triton` wrote (config facts in adaptex.json, the file in 1/).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# PyTriton's first instance of a model opens a unix socket from which the others read their config. An
# instance that connects between the socket's bind and its listen is refused, and the model fails to load
# (ConnectionRefusedError in get_config_from_handshake_server). A fresh start of Triton clears it.
HANDSHAKE_RACE = "get_config_from_handshake_server"
LOAD_ATTEMPTS = 3
NUMPY = {"bool": "bool_", "uint8": "uint8", "int8": "int8", "int32": "int32", "int64": "int64",
         "float16": "float16", "float32": "float32", "float64": "float64"}


def _session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _infer_fn(sess, output_names):
    from pytriton.decorators import batch

    @batch
    def infer(**inputs):
        values = sess.run(output_names, inputs)
        # a per-sample value ([batch]) travels as [batch, 1], as the repository's reshape has it
        return {n: v.reshape(-1, 1) if v.ndim == 1 else v for n, v in zip(output_names, values)}

    return infer


def _tensors(specs: dict, with_batch: bool):
    import numpy as np
    from pytriton.model_config import Tensor

    out = []
    for name, spec in specs.items():
        shape = spec["shape"][1:] if with_batch else spec["shape"]
        dims = tuple(d if isinstance(d, int) else -1 for d in shape) or (1,)
        out.append(Tensor(name=name, dtype=getattr(np, NUMPY[spec["dtype"]]), shape=dims))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--name", required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--queue-delay-us", type=int, default=1000)
    args = p.parse_args(argv)

    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    model_dir = Path(args.model_dir)
    meta = json.loads((model_dir / "adaptex.json").read_text())
    specs = list(meta["inputs"].values()) + list(meta["outputs"].values())
    with_batch = all(s["shape"] and s["shape"][0] == "batch" for s in specs)
    outputs = list(meta["outputs"])
    sessions = [_session(model_dir / "1" / "model.onnx", args.threads) for _ in range(args.instances)]
    config = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_verbose=0)
    model_config = ModelConfig(max_batch_size=args.max_batch if with_batch else 0,
                               batcher=DynamicBatcher(max_queue_delay_microseconds=args.queue_delay_us),
                               batching=with_batch)
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        with Triton(config=config) as triton:
            try:
                triton.bind(model_name=args.name, infer_func=[_infer_fn(s, outputs) for s in sessions],
                            inputs=_tensors(meta["inputs"], with_batch),
                            outputs=_tensors(meta["outputs"], with_batch), config=model_config, strict=False)
            except Exception as e:  # tritonclient's InferenceServerException carries the stub's traceback
                if HANDSHAKE_RACE not in str(e) or attempt == LOAD_ATTEMPTS:
                    raise
                print(f"adaptex-serve: instance handshake refused (attempt {attempt} of {LOAD_ATTEMPTS}); "
                      "restarting Triton", flush=True)
                continue
            print(f"adaptex-serve: ready {args.name} http://127.0.0.1:{args.http_port}", flush=True)
            triton.serve()
            return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
