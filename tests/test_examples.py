"""The examples run as documented."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
