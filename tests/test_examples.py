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
