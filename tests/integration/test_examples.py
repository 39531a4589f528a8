"""The examples run as documented."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ort_example_runs_without_torch(tiny_onnx):
    code = ("import runpy, sys; sys.argv = ['ort_classify.py', sys.argv[1]]; "
            "runpy.run_path('examples/ort_classify.py', run_name='__main__'); "
            "assert 'torch' not in sys.modules, 'the example must not need torch'")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_onnx["sparse"])], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("input") and len(lines) == 5
    assert "ordered pair" in lines[-1]


def test_bring_your_data_runs_end_to_end(tmp_path):
    """Writes its data and tokenizer, trains, exports, checks, classifies in ONNX Runtime."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a small model on a shared machine: one thread is faster
    r = subprocess.run([sys.executable, "examples/bring_your_data.py", "--steps", "30", "--lines", "300",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "PASSED" in out and "unexcused flips 0" in out, out
    rows = [line for line in out.splitlines() if "heads per layer" in line]
    assert len(rows) == 4 and all(line.split()[0] in ("billing", "shipping", "account") for line in rows), out
    assert (tmp_path / "classifier.onnx").is_file() and (tmp_path / "tokenizer.json").is_file()


@pytest.mark.parametrize("script", ["ort_classify.py", "tsa_generate.py", "trt_run.py"])
def test_examples_without_arguments_run_or_say_what_to_run_first(script, tmp_path):
    """With no arguments an example runs on what `make demo` wrote, or prints one line naming what to
    run first: never a traceback."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "make demo" in lines[0] or "usage" in lines[0].lower(), lines[0]
