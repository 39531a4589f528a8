"""Shared fixtures, and the one place where missing runtimes turn into visible skips."""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.support import zoo

# `make test` draws the same few examples on every run (derandomize: a test run passes or fails on the
# code, never on the draw); `make fuzz` (HYPOTHESIS_PROFILE=fuzz) draws new ones on every run, many of
# them (FUZZ_EXAMPLES, default 2000), to find the inputs the fixed draw misses.
settings.register_profile("fixed", derandomize=True, deadline=None)
settings.register_profile("fuzz", max_examples=int(os.environ.get("FUZZ_EXAMPLES", "2000")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers, one per core: each keeps to one intra-op thread, where
    # two each would compete for the same two cores
    import torch

    torch.set_num_threads(1)


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
    from tests.support.cdp import find_chromium

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


def _triton_reason() -> str | None:
    from adaptex.graphs.errors import AdaptexError
    from adaptex.runtimes.triton.server import serving_python

    try:
        serving_python()
    except AdaptexError as e:
        return f"the bundled Triton server cannot start here: {e}"
    return None


RUNTIME_REASONS = {"coreml_runtime": _coreml_runtime_reason, "tensorrt": _tensorrt_reason,
                   "browser": _browser_reason, "node": _node_reason, "triton": _triton_reason}


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        for marker, probe in RUNTIME_REASONS.items():
            if item.get_closest_marker(marker) is not None:
                if marker not in reasons:
                    reasons[marker] = probe()
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=reasons[marker]))


def _shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory of this run that both pytest-xdist workers see (beside their own base temps), so
    what one worker builds the other reads; without xdist, one of this session's."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp(name)
    d = tmp_path_factory.getbasetemp().parent / name
    d.mkdir(exist_ok=True)
    return d


def _once(path: Path, build) -> Path:
    """`build(path)` unless a worker of this run has built `path` already (the other waits on the
    lock meanwhile, then reads it); returns path."""
    from adaptex.graphs import files

    with files.exclusive(f"{path}.lock"):
        done = path.parent / f"{path.name}.done"
        if not done.exists():
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """bench caches its dense graphs per weights; the tests' cache is their own, never the user's (the
    two workers of `make test` share it: an entry is built under a lock, once)."""
    import os

    old = os.environ.get("ADAPTEX_CACHE_DIR")
    os.environ["ADAPTEX_CACHE_DIR"] = str(_shared_dir(tmp_path_factory, "cache"))
    yield
    if old is None:
        os.environ.pop("ADAPTEX_CACHE_DIR", None)
    else:
        os.environ["ADAPTEX_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small models on a shared machine: one intra-op thread is many times faster than two competing
    for the cores (and the figures do not depend on it). Modules opt in with
    pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(family_checkpoints):
    """A tiny BudgetFormer whose routers spread k over 1..H (so decisions vary)."""
    return family_checkpoints / "bf"


@pytest.fixture(scope="session")
def tiny_onnx(artifacts):
    """The tiny checkpoint exported to ONNX, both variants: {variant: path}."""
    return {variant: artifacts("bf", "onnx", variant) for variant in ("sparse", "dense")}


@pytest.fixture(scope="session")
def tiny_coreml(artifacts):
    """The tiny checkpoint as an fp32 Core ML package (sparse), the session's: {"sparse": path}. Tests
    that alter a package alter a copy. coremltools is a required test dependency: no skip."""
    return {"sparse": artifacts("bf", "coreml", "sparse", "fp32")}


CHARS = ["<pad>", "<unk>"] + list("abcdefghijklmnopqrstuvwxyz (),")  # 32: the tiny decoder's vocabulary


@pytest.fixture(scope="session")
def tiny_tsa_chars(tmp_path_factory):
    """A tiny TSA decoder with a character tokenizer (ASCII letters only), exported to ONNX (sparse):
    (checkpoint dir, onnx path)."""
    from adaptex.graphs import checkpoint

    d = tmp_path_factory.mktemp("tsa-chars")
    checkpoint.save(d / "ck", zoo.tiny_tsa(), {"training": {"task": "copy"}, "description": "test decoder",
                                                "tokenizer": {"kind": "chars", "pad": 0, "unk": 1, "itos": CHARS}})
    model, info = checkpoint.load(d / "ck")
    zoo.export(model, info, d / "tsa.onnx")
    return d / "ck", d / "tsa.onnx"


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """Tiny checkpoints of every family: BudgetFormer ("bf"), TSA decoder ("tsa"), elastic encoder
    ("el") and elastic decoder ("eldec"), in one directory (returned)."""
    from adaptex.graphs import checkpoint

    def build(d: Path) -> None:
        shutil.rmtree(d, ignore_errors=True)  # what a worker that failed half-way left
        d.mkdir()
        zoo.save_tiny(d / "bf")
        checkpoint.save(d / "tsa", zoo.tiny_tsa(), {"training": {"task": "copy"}, "description": "test decoder",
                                                     "tokenizer": {"kind": "ids", "pad": 0, "bos": 1, "sep": 2}})
        checkpoint.save(d / "el", zoo.tiny_elastic(), {"description": "test elastic encoder"})
        checkpoint.save(d / "eldec", zoo.tiny_elastic_decoder(), {"description": "test elastic decoder"})

    return _once(_shared_dir(tmp_path_factory, "families") / "checkpoints", build)


class Artifacts:
    """Exports of the family checkpoints, each made on first use and shared by the whole run, both
    xdist workers (an export costs seconds; many tests read the same one; tests that alter one alter
    a copy). Each records its checkpoint as its source, so `adaptex check ART` finds the reference by
    itself."""

    def __init__(self, checkpoints: Path, root: Path):
        self.checkpoints, self.root, self._made = checkpoints, root, {}

    def __call__(self, family: str, target: str = "onnx", variant: str = "sparse", precision: str | None = None,
                 **options) -> Path:
        """options: the target's, e.g. decode_graph="off", short_graph="off" for an elastic decoder's general
        graph alone."""
        from adaptex.exporter import targets
        from adaptex.graphs import checkpoint
        from adaptex.graphs.family import family_contract

        model, info = checkpoint.load(self.checkpoints / family)
        precision = precision or targets.load(target).default_precision(family_contract(model))
        key = (family, target, variant, precision, *sorted(options.items()))
        if key not in self._made:
            suffix = {"onnx": ".onnx", "tensorrt": ".trt.onnx", "coreml": ".mlpackage", "openvino": ".ov.xml"}[target]
            tag = "".join(f".{k}-{v}" for k, v in sorted(options.items()))
            path = self.root / f"{family}.{variant}.{precision}{tag}{suffix}"
            if target == "tensorrt":
                options = {"onnx_only": True, **options}
            self._made[key] = _once(path, lambda p: zoo.export(model, info, p, target, variant=variant,
                                                                precision=precision, **options))
        return self._made[key]

    def model(self, family: str):
        from adaptex.graphs import checkpoint

        return checkpoint.load(self.checkpoints / family)[0]


@pytest.fixture(scope="session")
def artifacts(family_checkpoints, tmp_path_factory) -> Artifacts:
    """artifacts(family, target="onnx", variant="sparse", precision=None) -> the path of that export of
    family_checkpoints' tiny model ("bf", "tsa", "el", "eldec"); artifacts.model(family) its model."""
    return Artifacts(family_checkpoints, _shared_dir(tmp_path_factory, "artifacts"))


@pytest.fixture(scope="session", autouse=True)
def shared_counterparts(tmp_path_factory):
    """The stock exports `adaptex bench` times against, made once per model (by its weights) in the
    session: each costs tens of seconds, and several tests bench the same tiny models. Returns the
    cached onnx_counterparts."""
    from adaptex.exporter import counterparts
    from adaptex.exporter.metadata import state_hash

    real, made = counterparts.onnx_counterparts, {}
    root = tmp_path_factory.mktemp("counterparts")

    def cached(model, contract, workdir):
        key = (type(model).__name__, state_hash(model))
        if key not in made:
            where = root / str(len(made))
            where.mkdir()
            made[key] = real(model, contract, where)
        return made[key]

    mp = pytest.MonkeyPatch()
    mp.setattr(counterparts, "onnx_counterparts", cached)
    yield cached
    mp.undo()
