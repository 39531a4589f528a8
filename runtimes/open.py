"""Opening an artifact: its kind by suffix (decided here, once), its metadata, and its runner.

A Core ML package runs on the Core ML runtime on macOS and is checked by MIL reference evaluation
elsewhere; a TensorRT engine needs TensorRT and a GPU; an ONNX file runs in ONNX Runtime, or in
OpenVINO with runtime="openvino" (its functions inlined on load); OpenVINO IR (.xml) in OpenVINO.
"""
from __future__ import annotations

from pathlib import Path

from adaptex.graphs.errors import AdaptexError

KINDS = {".onnx": "onnx", ".mlpackage": "coreml", ".plan": "tensorrt", ".engine": "tensorrt", ".xml": "openvino"}
RUNTIMES = ("onnxruntime", "openvino")  # the runtimes an artifact may name (--runtime), where it has a choice


def artifact_kind(path: str | Path) -> str:
    """'onnx', 'coreml', 'tensorrt' or 'openvino' by the artifact's suffix; a one-line error for anything else."""
    path = Path(str(path).rstrip("/") or str(path))
    kind = KINDS.get(path.suffix)
    if kind is None:
        what = "a directory" if path.is_dir() else "a file" if path.exists() else "no such file, and a name"
        suffix = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        raise AdaptexError(f"{path}: {what} with {suffix}, not an adaptex artifact; adaptex reads .onnx, "
                           ".mlpackage, TensorRT .plan/.engine and OpenVINO .xml artifacts")
    return kind


def read_metadata(path: str | Path) -> dict:
    """An artifact's adaptex metadata, without loading its weights or program."""
    kind = artifact_kind(path)
    if kind == "coreml":
        from adaptex.exporter.targets.coreml.package import read_package_meta

        return read_package_meta(path)
    if kind == "tensorrt":
        from adaptex.exporter.targets.tensorrt import read_plan_meta

        return read_plan_meta(path)
    if kind == "openvino":
        from adaptex.runtimes.openvino import read_meta

        return read_meta(Path(path))
    from adaptex.exporter.metadata import read_onnx_metadata

    return read_onnx_metadata(path)


def open_artifact(path: str | Path, threads: int | None = None, compute_units: str | None = None,
                  accumulate: str | None = None, ranges: bool = False, one_session: bool = False,
                  runtime: str | None = None):
    """The runner for an artifact, by its kind. compute_units (Core ML on macOS), accumulate and
    ranges (the MIL reference evaluation of a Core ML package) are refused anywhere they would be
    ignored, as is one_session (ONNX: the file in one session, its top-level Ifs choosing the graph,
    as an app that loads it itself runs it, instead of a session per graph). runtime: "openvino"
    runs an .onnx file in OpenVINO; an .xml runs there anyway."""
    path = Path(path)
    kind = artifact_kind(path)
    if runtime is not None and runtime not in RUNTIMES:
        raise AdaptexError(f"--runtime {runtime}: choose one of {', '.join(RUNTIMES)}")
    if runtime == "openvino" and kind not in ("onnx", "openvino"):
        raise AdaptexError(f"--runtime openvino runs .onnx and OpenVINO .xml artifacts, not {path.suffix}")
    if runtime == "onnxruntime" and kind != "onnx":
        raise AdaptexError(f"--runtime onnxruntime runs .onnx artifacts, not {path.suffix}")
    if one_session and (kind != "onnx" or runtime == "openvino"):
        raise AdaptexError("--one-session applies to ONNX artifacts (.onnx) in ONNX Runtime only")
    if compute_units and kind != "coreml":
        raise AdaptexError("--compute-units applies to Core ML packages (.mlpackage) only")
    if (accumulate or ranges) and kind != "coreml":
        raise AdaptexError("--fp16-accumulation and --ranges apply to Core ML packages (.mlpackage), which adaptex "
                           "checks by MIL reference evaluation")
    if kind == "openvino" or runtime == "openvino":
        from adaptex.runtimes.openvino import OpenVINORunner

        return OpenVINORunner(path, threads)
    if kind == "onnx":
        from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner

        runner = OnnxRuntimeRunner(path, threads, programs=not one_session)
        return _for_its_target(runner, path)
    if kind == "coreml":
        if not path.exists():
            raise AdaptexError(f"{path}: no such artifact; export one with 'adaptex export --target coreml -o {path}'")
        from adaptex.runtimes import coreml

        if coreml.available() and not (accumulate or ranges):
            return coreml.CoreMLRunner(path, compute_units or "all")
        if compute_units:
            raise AdaptexError(f"--compute-units {compute_units} needs the Core ML runtime (macOS); without it "
                               "'adaptex check' evaluates the package's program in numpy")
        from adaptex.runtimes.coreml_mil import MilReferenceRunner

        return MilReferenceRunner(path, accumulate=accumulate or "fp32", track_ranges=ranges)
    from adaptex.runtimes.tensorrt import TensorRTRunner

    return TensorRTRunner(path)


def _for_its_target(runner, path: Path):
    """An .onnx is checked for the target its metadata names: an ONNX Runtime artifact as it is; a
    TensorRT-bound one only once it passes TensorRT's parser rules (then run in ONNX Runtime, which
    the report names); any other target is an inconsistent file."""
    target = runner.meta.get("target", "onnx")
    if target == "onnx":
        return runner
    if target != "tensorrt":
        raise AdaptexError(f"{path}: an .onnx file whose metadata names target {target!r}; re-export it with "
                           "--target onnx (or --target tensorrt --onnx-only)")
    import onnx

    from adaptex.exporter.targets.tensorrt import rules

    violations = rules.lint(onnx.load(str(path), load_external_data=False))
    if violations:
        raise AdaptexError(f"{path}: its metadata names target tensorrt, but it breaks {len(violations)} of "
                           f"TensorRT's parser rules (first: {violations[0]}); run 'adaptex lint {path}' for all, and "
                           "re-export it with --target tensorrt --onnx-only")
    runner.name = f"{runner.name} (the TensorRT-bound ONNX, which passes TensorRT's parser rules; TensorRT not run)"
    return runner
