"""Load an adaptex TensorRT engine and run one input: the minimal embedding, TensorRT + cuda-python + numpy.

    python examples/trt_run.py model.plan   # prints the first output and every decision (k, keep or sa)

The engine was built by `adaptex export --target tensorrt -o model.plan` (metadata in model.plan.json).
Outputs with a data-dependent shape are not an issue for the shipped families: their data-dependent
tensors (the kept tokens of TSA's NonZero) stay inside the engine, so every output's shape is known
once the input shapes are set. Written against TensorRT 10's Python API; not run on the machines that
wrote it (no GPU there).
"""
import json
import sys

import numpy as np


def example_feeds(meta: dict, tokens: int = 16) -> dict:
    """One input of `tokens` new tokens (or positions) from the engine's metadata: ids from the model's
    vocabulary, a mask of ones, empty caches (a prefill), zero head modes, other floats random."""
    rng = np.random.default_rng(0)
    sizes = {"batch": 1, "sequence": min(tokens, int(meta.get("max_sequence") or tokens)), "past_sequence": 0}

    def size(d):
        if isinstance(d, int):
            return d
        return sum(sizes.get(t.strip(), tokens) for t in str(d).split("+"))

    vocab = (meta.get("config") or {}).get("vocab_size", 2)
    feeds = {}
    for name, spec in meta["inputs"].items():
        shape, dtype = tuple(size(d) for d in spec["shape"]), np.dtype(spec["dtype"])
        if name == "input_ids":
            feeds[name] = rng.integers(1, vocab, size=shape).astype(dtype)
        elif name == "attention_mask" or dtype == np.bool_:
            feeds[name] = (np.ones if name == "attention_mask" else np.zeros)(shape, dtype)
        else:
            feeds[name] = rng.normal(size=shape).astype(dtype)
    return feeds


def main(plan_path: str) -> None:
    try:
        import tensorrt as trt
        from cuda.bindings import runtime as cudart
    except ImportError:
        sys.exit("this example needs TensorRT 10 and cuda-python on a machine with an NVIDIA GPU "
                 "(pip install 'adaptex[tensorrt]')")

    def ok(result):  # cuda-python returns (error, *values)
        err, *vals = result
        if err != cudart.cudaError_t.cudaSuccess:
            sys.exit(f"CUDA error {err}")
        return vals[0] if len(vals) == 1 else vals

    meta = json.load(open(plan_path + ".json"))
    logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(logger).deserialize_cuda_engine(open(plan_path, "rb").read())
    context = engine.create_execution_context()
    stream = ok(cudart.cudaStreamCreate())

    feeds = example_feeds(meta)
    buffers = []
    for name, array in feeds.items():
        if not context.set_input_shape(name, array.shape):
            sys.exit(f"{name}: shape {array.shape} is outside the engine's optimization profile")
        ptr = ok(cudart.cudaMalloc(max(array.nbytes, 1)))
        if array.nbytes:
            ok(cudart.cudaMemcpy(ptr, array.ctypes.data, array.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))
        context.set_tensor_address(name, ptr)
        buffers.append(ptr)
    outputs = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) != trt.TensorIOMode.OUTPUT:
            continue
        host = np.empty(tuple(context.get_tensor_shape(name)), trt.nptype(engine.get_tensor_dtype(name)))
        ptr = ok(cudart.cudaMalloc(max(host.nbytes, 1)))
        context.set_tensor_address(name, ptr)
        outputs[name] = (host, ptr)
        buffers.append(ptr)
    if not context.execute_async_v3(stream):
        sys.exit("execute_async_v3 failed")
    ok(cudart.cudaStreamSynchronize(stream))
    for name, (host, ptr) in outputs.items():
        ok(cudart.cudaMemcpy(host.ctypes.data, ptr, host.nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    for ptr in buffers:
        cudart.cudaFree(ptr)
    decisions = meta.get("decisions", {})
    first = next(n for n in meta["outputs"] if not n.startswith("decisions."))  # logits, sentence_embedding, ...
    print(f"{first}:", np.round(outputs[first][0].reshape(-1)[:8], 3))
    for name, spec in decisions.items():  # k, keep (tokens that ran), sa (1 = streaming head)
        print(f"{name} ({spec['kind']}): {outputs[name][0].reshape(-1)[:16].astype(int)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/trt_run.py model.plan")
    main(sys.argv[1])
