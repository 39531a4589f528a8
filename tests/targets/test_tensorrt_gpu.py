"""TensorRT engines on an NVIDIA GPU (`make test-gpu`). Skipped, with the reason, where TensorRT or a
CUDA device is missing (see conftest.py): these machines have neither, so these tests have not run
here. They build engines from the TensorRT-bound ONNX of every family and variant and require parity
with the eager model (unexcused flips 0, fp32 within 1e-4; fp16 engines within the fp16 tolerance
with their routing pinned to fp32), and a bench that prints sparse against dense engines."""
from __future__ import annotations

import json

import pytest

from adaptex.cli import main

pytestmark = pytest.mark.tensorrt


@pytest.fixture(scope="module")
def checkpoints(family_checkpoints):
    return family_checkpoints


@pytest.mark.parametrize("family", ["bf", "tsa", "el", "eldec"])
@pytest.mark.parametrize("variant", ["sparse", "dense"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_engine_parity(checkpoints, tmp_path, capsys, family, variant, precision):
    plan = tmp_path / f"{family}.{variant}.{precision}.plan"
    assert main(["export", str(checkpoints / family), "--target", "tensorrt", "--variant", variant,
                 "--precision", precision, "--max-shapes", "batch=16", "--timing-cache",
                 str(tmp_path / "timing.cache"), "-o", str(plan)]) == 0
    meta = json.loads((tmp_path / f"{plan.name}.json").read_text())
    if precision == "fp16":
        assert meta["tensorrt"]["routing_layers_pinned"] > 0
    capsys.readouterr()
    assert main(["check", str(plan), "--samples", "60", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["unexcused_flips"] == 0 and report["passed"]


def test_engine_from_onnx_only_file_and_bench(checkpoints, tmp_path, capsys):
    onnx_path, plan = tmp_path / "bf.onnx", tmp_path / "bf.plan"
    assert main(["export", str(checkpoints / "bf"), "--target", "tensorrt", "--onnx-only", "-o", str(onnx_path)]) == 0
    assert main(["export", str(onnx_path), "--target", "tensorrt", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["bench", str(plan), "--batch", "1", "--seq", "64", "--runs", "50", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["p50_ms"] > 0 and r["dense_p50_ms"] > 0 and "TensorRT" in r["runtime"]
