"""ONNX Runtime runner (CPU execution provider), thread count settable.

An artifact whose graph begins with run-time dispatch (a decoder's decode-step and short-call
graphs, --dense-rows: exporter/targets/onnx/dispatch.py) holds several programs under top-level
Ifs. ONNX Runtime runs the nodes of an If's branch slower than the same nodes in a main graph, so
the runner runs each program as a session of its own (Programs): it chooses the program by the
guards stored in the metadata, the ones the Ifs were built from, and loads a program's session when
a call first takes it. A large call runs in chunks of whole samples (runtimes/chunks.py).
programs=False runs the file in one session, Ifs and all, every call whole, as an app that loads it
with ONNX Runtime itself does."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from adaptex.exporter.metadata import read_onnx_metadata
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.base import IOSpec, Runner, check_threads, limits_of
from adaptex.runtimes.chunks import CHUNK_ROWS, chunk_plan, run_in_chunks, sample_chunks

_ORT_TYPES = {"tensor(int64)": "int64", "tensor(float)": "float32", "tensor(bool)": "bool",
              "tensor(float16)": "float16", "tensor(int32)": "int32"}


def session_options(threads: int | None, memory_plan: bool = True):
    """memory_plan=False: no buffer plan per input shape (enable_mem_pattern), the control a timing
    uses to tell a graph's work from where the plan happened to lay its buffers out."""
    import onnxruntime as ort

    check_threads(threads)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_mem_pattern = memory_plan
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return so


def _session(model, threads: int | None, where: Path):
    """An ONNX Runtime session of `model` (a path, or a serialized model), failures in one line."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(model if isinstance(model, bytes) else str(model), session_options(threads),
                                    providers=["CPUExecutionProvider"])
    except Exception as e:
        raise AdaptexError(f"{where}: ONNX Runtime cannot load it ({str(e).splitlines()[0]})") from None


def has_programs(meta: dict) -> bool:
    """Whether an artifact with this metadata holds programs under top-level dispatch Ifs."""
    return bool(meta.get("programs"))


class Programs:
    """The programs of an artifact with top-level dispatch Ifs, one ONNX Runtime session each, made
    from the file when a call first takes it (exporter/targets/onnx/programs.program). Which one a
    call takes is the first whose guard, stored in the metadata, holds for its input shapes
    (exporter/targets/onnx/guards.py): the same guards the file's Ifs were built from."""

    def __init__(self, path: Path, meta: dict, threads: int | None):
        # imported here: the exporter's package imports torch
        from adaptex.exporter.targets.onnx.guards import read_programs
        from adaptex.exporter.targets.onnx.programs import path_of, program

        self._program, self._path_of = program, path_of
        self.path, self.threads = path, threads
        self.programs = read_programs(meta, str(path))
        self.names = [name for name, _ in self.programs]
        self.reads = sorted(set().union(*(g.inputs() for _, g in self.programs if g is not None)))
        self.output_names = [o.name for o in self._proto().graph.output]
        self.sessions: dict[str, object] = {}
        self._chosen: dict[tuple, str] = {}

    def _proto(self):
        """The file's model, read again for each program made: a loaded one would hold the weights
        in memory beside the sessions."""
        import onnx

        try:
            return onnx.load(str(self.path))
        except Exception as e:
            raise AdaptexError(f"{self.path}: not a readable ONNX model ({str(e).splitlines()[0]})") from None

    def chosen(self, feeds: dict) -> str:
        """The name of the program a call with these feeds runs, looked up by the shapes its guards
        read (the guards evaluated once for each)."""
        shapes = tuple(np.shape(feeds[k]) for k in self.reads)
        name = self._chosen.get(shapes)
        if name is None:
            if len(self._chosen) >= 4096:  # a long decode loop meets a new cache length each step: bounded
                self._chosen.clear()
            at = dict(zip(self.reads, shapes))
            name = self._chosen[shapes] = next(n for n, g in self.programs if g is None or g.holds(at))
        return name

    def _model(self, name: str):
        return self._program(self._proto(), self._path_of(self.names.index(name), len(self.names)))

    def model(self, feeds: dict):
        """The ModelProto of the program a call with these feeds runs."""
        return self._model(self.chosen(feeds))

    def session(self, feeds: dict):
        name = self.chosen(feeds)  # once a call: the session is looked up, the program made on a miss only
        s = self.sessions.get(name)
        if s is None:
            s = self.sessions[name] = _session(self._model(name).SerializeToString(), self.threads, self.path)
        return s


class OnnxRuntimeRunner(Runner):
    name = "onnxruntime"

    def __init__(self, path: str | Path, threads: int | None = None, require_metadata: bool = True,
                 programs: bool = True, chunk_rows: int | None = CHUNK_ROWS):
        """chunk_rows: with programs (the runner's way), a call of more token rows runs in chunks of
        whole samples of at most that many (runtimes.chunks.CHUNK_ROWS; None or 0: every call
        whole), where the artifact's metadata has every input and output batch-first. programs=False
        runs every call whole, as an app that loads the file itself does."""
        check_threads(threads)
        self.path = Path(path)
        self.meta = read_onnx_metadata(self.path) if require_metadata else {}
        super().__init__(limits_of(self.meta))
        self.threads = threads
        self.chunks = chunk_plan(self.meta, chunk_rows) if programs else None
        self.split = programs and has_programs(self.meta)
        if not programs and has_programs(self.meta):
            self.name = "onnxruntime (one session)"
        self.session = self.programs = None

    def _activate(self):
        if self.split:
            self.programs = Programs(self.path, self.meta, self.threads)
        else:
            self.session = _session(self.path, self.threads, self.path)

    def _deactivate(self):
        self.session = self.programs = None

    def session_for(self, feeds: dict):
        """The ONNX Runtime session that runs a call with these feeds (activate() first)."""
        return self.programs.session(feeds) if self.programs else self.session

    def input_metadata(self) -> dict[str, IOSpec]:
        if self.meta:
            return {n: IOSpec(n, s["dtype"], tuple(s["shape"])) for n, s in self.meta["inputs"].items()}
        self.activate()
        return {i.name: IOSpec(i.name, _ORT_TYPES.get(i.type, i.type), tuple(i.shape))
                for i in self.session.get_inputs()}

    def output_names(self) -> list[str]:
        self.activate()
        return self.programs.output_names if self.programs else [o.name for o in self.session.get_outputs()]

    def _infer(self, feeds):
        names = self.output_names()
        return dict(zip(names, self.run_raw(feeds, names)))

    def run_raw(self, feeds, names: list[str] | None = None):
        """Run without validation (for timing loops, after one validated call): the outputs in
        `names`' order (default: the graph's), a large call in chunks of samples (chunk_rows)."""
        return run_in_chunks(lambda f: self.session_for(f).run(names, f), feeds,
                             sample_chunks(feeds, *self.chunks) if self.chunks else None)
