"""A Triton model repository from an adaptex artifact: `<repo>/<name>/config.pbtxt` and
`<repo>/<name>/1/model.onnx` (the `onnxruntime` backend) or `model.plan` (the `tensorrt` backend).

Everything in the config comes from the artifact's metadata: input and output names, Triton dtypes,
dims (a named axis is -1; a per-sample value such as a decision's k is dims [1] reshaped to the
model's []), the decision outputs beside the model's own, and the batch axis. Where
every input and output leads with the `batch` axis, the config sets `max_batch_size` and dynamic
batching, and the dims leave that axis out, as Triton expects. A decoder's KV cache is an ordinary
input and output pair (`past_key_values.*`, `present.*`): the client carries it from one step to the
next. Triton's sequence batcher, which would keep it on the server, is not configured.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from adaptex.graphs.errors import AdaptexError

TRITON_DTYPES = {"bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "int8": "TYPE_INT8", "int32": "TYPE_INT32",
                 "int64": "TYPE_INT64", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32",
                 "float64": "TYPE_FP64"}
BATCH_AXIS = "batch"
MAX_BATCH = 64  # requests a dynamic batch may join: enough to fill two cores, few enough to bound padding
QUEUE_DELAY_US = 1000  # how long the batcher waits for more requests: a millisecond, small beside a call
MARKER = "adaptex.json"  # in a model directory adaptex wrote: the artifact's metadata, read back by `serve`
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def model_name(meta: dict, artifact: Path) -> str:
    """The model's name in the repository: the shipped model's name, else the artifact's stem."""
    name = (meta.get("source") or {}).get("checkpoint") or artifact.stem
    name = Path(str(name)).name  # a checkpoint directory's path: its last part
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", str(name))[:128]
    return name.strip(".") or "model"


def batched(meta: dict) -> bool:
    """Whether every input and output leads with the batch axis (Triton's max_batch_size > 0)."""
    specs = list(meta["inputs"].values()) + list(meta["outputs"].values())
    return all(s["shape"] and s["shape"][0] == BATCH_AXIS for s in specs)


def _tensor(name: str, spec: dict, drop_batch: bool) -> str:
    dtype = TRITON_DTYPES.get(spec["dtype"])
    if dtype is None:
        raise AdaptexError(f"{name}: dtype {spec['dtype']} has no Triton type; re-export with fp32 or fp16 tensors")
    shape = spec["shape"][1:] if drop_batch else spec["shape"]
    if not shape:  # one value per sample (a decision's k): Triton wants dims, so [1] reshaped to the model's []
        return f'  {{ name: "{name}" data_type: {dtype} dims: [ 1 ] reshape: {{ shape: [ ] }} }}'
    dims = ", ".join(str(d) if isinstance(d, int) else "-1" for d in shape)
    return f'  {{ name: "{name}" data_type: {dtype} dims: [ {dims} ] }}'


def config_text(meta: dict, name: str, backend: str, *, max_batch: int = MAX_BATCH, instances: int = 1,
                queue_delay_us: int = QUEUE_DELAY_US) -> str:
    """config.pbtxt (protobuf text format of Triton's ModelConfig) for an artifact's metadata."""
    if backend not in ("onnxruntime", "tensorrt"):
        raise AdaptexError(f"backend {backend!r}: adaptex writes onnxruntime or tensorrt repositories")
    if not 1 <= instances <= 64:
        raise AdaptexError(f"--instances {instances}: give 1 to 64 model instances")
    if not 1 <= max_batch <= 4096:
        raise AdaptexError(f"--max-batch {max_batch}: give 1 to 4096 requests")
    with_batch = batched(meta)
    lines = [f'name: "{name}"', f'backend: "{backend}"', f"max_batch_size: {max_batch if with_batch else 0}"]
    lines += ["input ["] + [",\n".join(_tensor(n, s, with_batch) for n, s in meta["inputs"].items())] + ["]"]
    lines += ["output ["] + [",\n".join(_tensor(n, s, with_batch) for n, s in meta["outputs"].items())] + ["]"]
    if with_batch:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}")
    kind = "KIND_GPU" if backend == "tensorrt" else "KIND_CPU"
    lines.append(f"instance_group [ {{ count: {instances} kind: {kind} }} ]")
    decisions = ",".join(meta.get("decisions") or {})
    for key, value in (("adaptex.family", meta.get("family", "")), ("adaptex.decisions", decisions)):
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def _single_file(path: Path) -> None:
    """adaptex writes ONNX artifacts as one file; refuse one whose weights live elsewhere."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise AdaptexError(f"{path}: its weights live in external data files, which adaptex does not write; "
                           "re-export it with 'adaptex export'")


def write(artifact: str | Path, repo: str | Path, *, name: str | None = None, max_batch: int = MAX_BATCH,
          instances: int = 1, say=lambda s: None, meta: dict | None = None) -> Path:
    """Write `<repo>/<name>/` for `artifact` (ONNX or a TensorRT engine), atomically: the model directory
    is the old one or the new one at every instant, and other models in `repo` are never touched.
    `meta` describes a graph that carries no adaptex metadata (a dense yardstick of the same weights).
    Returns the model directory."""
    from adaptex.exporter.metadata import atomic_dir
    from adaptex.runtimes.open import artifact_kind, read_metadata

    artifact = Path(artifact)
    kind = artifact_kind(artifact)
    if kind == "coreml":  # checked before any metadata is read
        raise AdaptexError(f"{artifact}: Triton has no Core ML backend; export --target onnx (or a TensorRT "
                           "engine) and write its repository")
    meta = meta if meta is not None else read_metadata(artifact)
    name = name or model_name(meta, artifact)
    if not _NAME.fullmatch(name):
        raise AdaptexError(f"--name {name!r}: use letters, digits, '_', '-' and '.' only (at most 128)")
    backend = "tensorrt" if kind == "tensorrt" else "onnxruntime"
    text = config_text(meta, name, backend, max_batch=max_batch, instances=instances)
    repo = Path(repo)
    if repo.exists() and not repo.is_dir():
        raise AdaptexError(f"{repo}: exists and is not a directory; pass a repository directory to -o")
    target = repo / name
    if target.exists() and not (target / MARKER).is_file():
        raise AdaptexError(f"{target}: exists and was not written by adaptex; choose another --name or -o "
                           "(adaptex only replaces model directories it wrote)")
    repo.mkdir(parents=True, exist_ok=True)
    with atomic_dir(target) as new:
        (new / "1").mkdir(parents=True)
        (new / "config.pbtxt").write_text(text)
        (new / MARKER).write_text(json.dumps(meta) + "\n")
        if backend == "tensorrt":
            shutil.copyfile(artifact, new / "1" / "model.plan")
        else:
            _single_file(artifact)
            shutil.copyfile(artifact, new / "1" / "model.onnx")
    say(f"wrote {target}: config.pbtxt ({backend}, max_batch_size "
        f"{max_batch if batched(meta) else 0}, {len(meta['decisions'])} decision outputs) and 1/")
    return target


def parse_config(text: str):
    """Triton's own ModelConfig message parsed from config.pbtxt (needs tritonclient and grpcio)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())
