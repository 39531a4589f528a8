"""Load an adaptex TensorRT engine and run one input: the minimal embedding, TensorRT + cuda-python + numpy.

    python examples/trt_run.py model.plan   # prints the logits and each layer's decisions (k, or keep)

The engine was built by `adaptex export --target tensorrt -o model.plan` (metadata in model.plan.json).
Outputs with a data-dependent shape are not an issue for the shipped families: their data-dependent
tensors (the kept tokens of TSA's NonZero) stay inside the engine, so every output's shape is known
once the input shapes are set. Written against TensorRT 10's Python API; not run on the machines that
wrote it (no GPU there).
"""
import json
import sys

import numpy as np


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

    # one sequence of 16 tokens (ids from the model's vocabulary), no padding
    rng = np.random.default_rng(0)
    T = 16
    feeds = {"input_ids": rng.integers(1, meta["config"]["vocab_size"], size=(1, T)).astype(np.int64),
             "attention_mask": np.ones((1, T), np.int64)}
    cfg = meta["config"]
    if meta["family"] in ("tsa", "elastic_decoder"):  # a decoder's prefill: empty caches (past_sequence = 0)
        dh = cfg["d_model"] // cfg["num_heads"]
        feeds.update({f"past_key_values.{i}.{kv}": np.zeros((1, cfg["num_heads"], 0, dh), np.float32)
                      for i in range(cfg["num_layers"]) for kv in ("key", "value")})
    if meta["family"] == "elastic_decoder":  # ignored at prefill; decode steps feed back decisions.layer{i}.sa
        feeds.update({f"head_modes.{i}": np.zeros((1, cfg["num_heads"]), bool) for i in range(cfg["num_layers"])})
    buffers = []
    for name, array in feeds.items():
        context.set_input_shape(name, array.shape)
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
    print("logits:", np.round(outputs["logits"][0].reshape(-1)[:8], 3))
    for name, (host, _) in outputs.items():
        if name.startswith("decisions.") and name.endswith((".k", ".keep")):
            print(f"{name}: {host.reshape(-1)[:16]}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/trt_run.py model.plan")
    main(sys.argv[1])
