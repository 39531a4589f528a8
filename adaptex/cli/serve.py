"""`adaptex serve`: an artifact behind a local NVIDIA Triton server (PyTriton), decisions in every response."""
from __future__ import annotations

from adaptex.cli._util import say


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve an ONNX artifact through a local Triton server (HTTP and gRPC)")
    s.add_argument("artifact", help="an ONNX artifact")
    s.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1; gRPC and metrics take the next "
                                                          "two (default 8000)")
    s.add_argument("--max-batch", type=int, default=64, help="the dynamic batcher's largest batch (default 64)")
    s.add_argument("--instances", type=int, default=1, help="model instances, one ONNX Runtime session each")
    s.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads per instance (default 1)")
    s.add_argument("--python", default=None, help="the serving interpreter (a system Python build with "
                                                  "nvidia-pytriton; default: $ADAPTEX_SERVE_PYTHON, .venv-serve, "
                                                  "this one)")
    s.add_argument("--log", default=None, help="write the Triton server's log here")
    s.set_defaults(run=run)


def run(args) -> int:
    import signal
    import time

    from adaptex.runtimes.triton.server import Server

    server = Server(args.artifact, port=args.port, max_batch=args.max_batch, instances=args.instances,
                    threads=args.threads, python=args.python, log=args.log, say=say)
    server.start()
    try:
        while server.proc.poll() is None:
            time.sleep(0.5)
        say(f"the Triton server exited ({server.proc.returncode})")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C waits for the server to stop
        server.stop()
