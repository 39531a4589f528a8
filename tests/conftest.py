"""Shared fixtures, and the one place where missing runtimes turn into visible skips."""
from __future__ import annotations

import importlib.util
import platform
import shutil
from pathlib import Path

import pytest

from tests import zoo


def _coreml_runtime_reason() -> str | None:
    if platform.system() != "Darwin":
        return "Core ML predictions need macOS (coremltools converts on Linux but cannot run models)"
    if importlib.util.find_spec("coremltools") is None:
        return "coremltools is not installed"
    return None


def _tensorrt_reason() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed (its wheels are download stubs on these machines; make test-gpu installs it)"
    try:
        import tensorrt  # noqa: F401  (the registry's stub packages fail here)
    except Exception as e:
        return f"tensorrt does not import ({type(e).__name__}): a stub or a broken install"
    from adaptex.runtimes.tensorrt import cuda_device_count

    if cuda_device_count() < 1:
        return "TensorRT needs a CUDA GPU, and cuda-python sees none"
    return None


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _browser_reason() -> str | None:
    from tests.cdp import find_chromium

    if importlib.util.find_spec("websocket") is None:
        return "websocket-client is not installed (pip install -e '.[test]')"
    if find_chromium() is None:
        return "Chromium is not installed (make test installs Debian's chromium with apt-get when it runs as root)"
    if not (EXAMPLES / "web/node_modules/onnxruntime-web/dist").is_dir():
        return "onnxruntime-web is not installed (make test runs npm install --ignore-scripts in examples/web)"
    return None


def _node_reason() -> str | None:
    if shutil.which("node") is None:
        return "Node.js is not installed"
    if not (EXAMPLES / "node/node_modules/onnxruntime-node").is_dir():
        return "onnxruntime-node is not installed (make test runs npm install --ignore-scripts in examples/node)"
    return None


RUNTIME_REASONS = {"coreml_runtime": _coreml_runtime_reason, "tensorrt": _tensorrt_reason,
                   "browser": _browser_reason, "node": _node_reason}


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        for marker, probe in RUNTIME_REASONS.items():
            if item.get_closest_marker(marker) is not None:
                if marker not in reasons:
                    reasons[marker] = probe()
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=reasons[marker]))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny BudgetFormer whose routers spread k over 1..H (so decisions vary)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    zoo.save_tiny(path)
    return path


@pytest.fixture(scope="session")
def tiny_onnx(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint exported to ONNX, both variants: {variant: path}."""
    from adaptex.exporter.targets import onnx as target
    from adaptex.graphs import checkpoint

    model, info = checkpoint.load(tiny_checkpoint)
    out = {}
    for variant in ("sparse", "dense"):
        path = tmp_path_factory.mktemp("onnx") / f"tiny.{variant}.onnx"
        zoo.export(model, info, path, variant=variant)
        out[variant] = path
    return out


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """Tiny checkpoints of every family: BudgetFormer ("bf"), TSA decoder ("tsa"), elastic encoder
    ("el") and elastic decoder ("eldec"), in one directory (returned)."""
    from adaptex.graphs import checkpoint

    d = tmp_path_factory.mktemp("families")
    zoo.save_tiny(d / "bf")
    checkpoint.save(d / "tsa", zoo.tiny_tsa(), {"training": {"task": "copy"}, "description": "test decoder"})
    checkpoint.save(d / "el", zoo.tiny_elastic(), {"description": "test elastic encoder"})
    checkpoint.save(d / "eldec", zoo.tiny_elastic_decoder(), {"description": "test elastic decoder"})
    return d


class Artifacts:
    """Exports of the family checkpoints, each made on first use and shared by the whole session
    (an export costs seconds; many tests read the same one). Each records its checkpoint as its
    source, so `adaptex check ART` finds the reference by itself."""

    def __init__(self, checkpoints: Path, root: Path):
        self.checkpoints, self.root, self._made = checkpoints, root, {}

    def __call__(self, family: str, target: str = "onnx", variant: str = "sparse", precision: str | None = None) -> Path:
        key = (family, target, variant, precision)
        if key not in self._made:
            from adaptex.graphs import checkpoint

            suffix = {"onnx": ".onnx", "tensorrt": ".trt.onnx", "coreml": ".mlpackage"}[target]
            path = self.root / f"{family}.{variant}.{precision or 'default'}{suffix}"
            model, info = checkpoint.load(self.checkpoints / family)
            options = {"onnx_only": True} if target == "tensorrt" else {}
            zoo.export(model, info, path, target, variant=variant, precision=precision, **options)
            self._made[key] = path
        return self._made[key]

    def model(self, family: str):
        from adaptex.graphs import checkpoint

        return checkpoint.load(self.checkpoints / family)[0]


@pytest.fixture(scope="session")
def artifacts(family_checkpoints, tmp_path_factory) -> Artifacts:
    """artifacts(family, target="onnx", variant="sparse", precision=None) -> the path of that export of
    family_checkpoints' tiny model ("bf", "tsa", "el", "eldec"); artifacts.model(family) its model."""
    return Artifacts(family_checkpoints, tmp_path_factory.mktemp("artifacts"))
