"""The install: one import package, `adaptex`, with the rooms under it; the front door works from anywhere."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_one_top_level_package(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("adaptex-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"adaptex"}, top
    for room in ("graphs", "exporter", "runtimes"):  # every subpackage of every room is in the wheel
        for init in (ROOT / room).rglob("__init__.py"):
            rel = init.relative_to(ROOT).as_posix()
            assert f"adaptex/{rel}" in names, f"{rel} is missing from the wheel: list its package in pyproject.toml"
    assert "adaptex/cli/__init__.py" in names
    assert "adaptex/graphs/zoo/budgetformer-graded/model.safetensors" in names  # the shipped models ride along
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: torch<2.15,>=2.13" in meta or "Requires-Dist: torch>=2.13,<2.15" in meta


def test_the_front_door_from_outside_the_repository(tmp_path):
    from adaptex import __version__

    run = lambda *a: subprocess.run([sys.executable, *a], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    r = run("-c", "import adaptex, adaptex.nn; print(adaptex.__version__, adaptex.nn.BudgetedAttention.__name__)")
    assert r.returncode == 0 and r.stdout.split() == [__version__, "BudgetedAttention"], r.stderr
    r = run("-m", "adaptex", "--help")
    assert r.returncode == 0 and "export" in r.stdout and "check" in r.stdout
    r = subprocess.run([str(Path(sys.executable).with_name("adaptex")), "--version"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"adaptex {__version__}"


def test_import_adaptex_is_light():
    """`import adaptex` and `adaptex --version` load neither torch nor onnx."""
    r = subprocess.run([sys.executable, "-c", "import sys, adaptex; print('torch' in sys.modules, 'onnx' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr


REQUIRED = ("onnx", "onnxruntime", "onnxscript", "coremltools", "transformers", "sentence_transformers", "safetensors")


def test_the_runtimes_make_test_installs_import():
    """`make install` installs these (pyproject's test and coreml extras): an import that fails is a
    broken install, and fails here instead of turning their tests into skips."""
    import importlib

    for name in REQUIRED:
        importlib.import_module(name)


def test_no_test_skips_for_want_of_a_required_runtime():
    """Only runtimes that cannot exist on every machine skip (conftest's markers: macOS Core ML,
    TensorRT with a GPU, the apps' browser and Node), each with its reason."""
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name == Path(__file__).name:
            continue  # this test names what it looks for
        text = path.read_text()
        assert "importorskip" not in text, f"{path.name}: a required runtime must import, not skip"
