"""`adaptex serve`: an artifact behind a local NVIDIA Triton server (PyTriton's bundled tritonserver),
with dynamic batching, decisions returned beside the outputs.

PyTriton's Python backend stub links the system's libpython. A virtual environment made from another
build of the same Python version (pyenv's, conda's) loads every model with "'_thread.RLock' object
has no attribute '_recursion_count'". So the model side (runtimes/triton/worker.py, which needs only
numpy, onnxruntime and pytriton) runs in a *serving interpreter*: `--python`, else $ADAPTEX_SERVE_PYTHON,
else `.venv-serve/bin/python` in the working directory (`make serve-env` makes it from /usr/bin/python3),
else this interpreter. This process writes the model directory, starts the worker, waits until
Triton reports the model ready, and stops it on Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from adaptex.graphs.errors import AdaptexError

SERVE_ENV = ".venv-serve"
READY_TIMEOUT_S = 120.0  # tritonserver's start and the model's load: seconds, more on a loaded machine
FIX = (f"make one with 'make serve-env' (a venv from /usr/bin/python3 with nvidia-pytriton, onnxruntime and "
       f"numpy<2), or pass --python PYTHON of a system Python build that has them")
_WORKER = Path(__file__).with_name("worker.py")


def serving_python(explicit: str | None = None) -> str:
    """The interpreter that runs the model side, checked to import what the worker needs."""
    candidates = [explicit] if explicit else [os.environ.get("ADAPTEX_SERVE_PYTHON"),
                                               str(Path(SERVE_ENV) / "bin" / "python"), sys.executable]
    tried = []
    for python in filter(None, candidates):
        if explicit is None and python != sys.executable and not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import numpy, onnxruntime, pytriton"], capture_output=True, text=True)
        if probe.returncode == 0:
            return python
        tried.append(python)
    raise AdaptexError(f"no serving Python with nvidia-pytriton, onnxruntime and numpy (tried {', '.join(tried)}); "
                       f"{FIX}")


def _ready(port: int, name: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{name}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Server:
    """A running Triton server for one artifact: start(), then stop() (or use it as a context)."""

    def __init__(self, artifact: str | Path, *, port: int = 8000, max_batch: int = 64, instances: int = 1,
                 threads: int = 1, python: str | None = None, log: str | Path | None = None, say=lambda s: None,
                 name: str | None = None, meta: dict | None = None):
        if not 1 <= port <= 65533:
            raise AdaptexError(f"--port {port}: give 1 to 65533 (HTTP there, gRPC and metrics on the next two)")
        self.artifact, self.port, self.max_batch, self.instances, self.threads = Path(artifact), port, max_batch, \
            instances, threads
        self.python, self.say, self.log, self._name, self._meta = python, say, log, name, meta
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.name = ""

    def start(self) -> "Server":
        from adaptex.runtimes.triton import repository

        python = serving_python(self.python)
        self._tmp = tempfile.TemporaryDirectory(prefix="adaptex-serve-")  # removed on stop
        work = Path(self._tmp.name)
        model_dir = repository.write(self.artifact, work, max_batch=self.max_batch, instances=self.instances,
                                     name=self._name, meta=self._meta)
        self.name = model_dir.name
        log = Path(self.log) if self.log else work / "triton.log"
        cmd = [python, str(_WORKER), str(model_dir), "--name", self.name, "--http-port", str(self.port),
               "--grpc-port", str(self.port + 1), "--metrics-port", str(self.port + 2), "--max-batch",
               str(self.max_batch), "--instances", str(self.instances), "--threads", str(self.threads)]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.say(f"starting Triton for {self.name} on 127.0.0.1:{self.port} (log {log}) ...")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(self.port, self.name):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = log.read_text(errors="replace")
                why = "exited" if self.proc.poll() is not None else "was not ready in time"
                if not self.log:  # the default log lives in the work directory stop() removes: keep a copy
                    fd, kept = tempfile.mkstemp(prefix="adaptex-serve-", suffix=".log")
                    with os.fdopen(fd, "w") as f:
                        f.write(text)
                    log = Path(kept)
                self.stop()
                if "_recursion_count" in text:
                    raise AdaptexError(f"{python} is not the Python build that Triton's Python backend links "
                                       f"(the model failed to load); {FIX}")
                lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 2]
                tail = [ln for ln in lines if "rror" in ln or "failed" in ln][-1:] or lines[-1:] or ["no output"]
                raise AdaptexError(f"the Triton server {why} ({tail[0][:200]}); see its log {log}, or pass --port "
                                   "for a free port")
            time.sleep(0.5)
        self.say(f"serving {self.name}: http://127.0.0.1:{self.port}/v2/models/{self.name}/infer "
                 f"(gRPC {self.port + 1}, metrics {self.port + 2}); Ctrl-C stops it")
        return self

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # PyTriton stops tritonserver and its stubs on SIGINT
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def http_inputs(feeds: dict) -> list:
    """tritonclient HTTP InferInputs holding `feeds` ({name: numpy array}), each with its Triton dtype."""
    import tritonclient.http as th
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in feeds.items():
        inputs.append(th.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype)))
        inputs[-1].set_data_from_numpy(value)
    return inputs
