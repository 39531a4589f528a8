"""`adaptex triton`: a Triton Inference Server model repository from an artifact."""
from __future__ import annotations

from adaptex.cli._util import say


def add_parser(sub) -> None:
    s = sub.add_parser("triton", help="write a Triton model repository (config.pbtxt and the model) for an artifact")
    s.add_argument("artifact", help="an ONNX artifact (onnxruntime backend) or a TensorRT engine (tensorrt backend)")
    s.add_argument("-o", "--output", required=True, help="the repository directory (made if missing; other models "
                                                         "in it are left alone)")
    s.add_argument("--name", default=None, help="the model's name in the repository (default: the shipped model's "
                                                "or checkpoint's name, else the file's stem)")
    s.add_argument("--max-batch", type=int, default=64, help="max_batch_size, where every tensor leads with the batch "
                                                             "axis (default 64)")
    s.add_argument("--instances", type=int, default=1, help="model instances (instance_group count; default 1)")
    s.set_defaults(run=run)


def run(args) -> int:
    from adaptex.runtimes.triton import repository

    repository.write(args.artifact, args.output, name=args.name, max_batch=args.max_batch, instances=args.instances,
                     say=say)
    return 0
