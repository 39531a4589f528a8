"""`adaptex check` as Polygraphy users expect it: one artifact against another (decisions first), the
user's own inputs and tolerances (printed, never loosened silently), and the report saved as JSON."""
from __future__ import annotations

import json

import numpy as np
import pytest

from adaptex.cli import main
from adaptex.graphs import checkpoint
from tests.support import zoo


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tmp_path_factory):
    model, info = checkpoint.load(tiny_checkpoint)
    d = tmp_path_factory.mktemp("pair")
    zoo.export(model, info, d / "a.onnx", variant="sparse")
    zoo.export(model, info, d / "a.mlpackage", "coreml", variant="sparse", precision="fp32")
    return d


def test_onnx_against_core_ml(pair, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["check", str(pair / "a.onnx"), "--against", str(pair / "a.mlpackage"), "--samples", "40",
                 "--save-results", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "against " + str(pair / "a.mlpackage") in text and "margins from the eager model" in text
    saved = json.loads(out.read_text())
    assert saved["passed"] and saved["samples"] == 40 and "a.mlpackage" in saved["reference"]
    assert saved["decision_agreement"] > 0.9 and saved["unexcused_flips"] == 0


def test_against_catches_a_different_artifact(pair, tmp_path, capsys):
    """B from other weights is refused with the reason."""
    zoo.save_tiny(tmp_path / "other", seed=5)
    model, info = checkpoint.load(tmp_path / "other")
    zoo.export(model, info, tmp_path / "b.onnx", variant="sparse")
    assert main(["check", str(pair / "a.onnx"), "--against", str(tmp_path / "b.onnx"), "--samples", "8"]) == 2
    assert "another source" in capsys.readouterr().err


def test_against_takes_the_users_inputs(pair, tmp_path, capsys):
    """--against with --inputs: the arrays made to look like the eager model's inputs, for both
    artifacts (the CLI fuzz found an AttributeError here)."""
    ids = np.random.default_rng(1).integers(1, 50, size=(4, 10)).astype(np.int32)  # int32: converted
    np.savez(tmp_path / "x.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    code = main(["check", str(pair / "a.onnx"), "--against", str(pair / "a.onnx"), "--inputs",
                 str(tmp_path / "x.npz"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["samples"] == 4 and report["unexcused_flips"] == 0


def test_user_inputs_and_tolerance_are_used_and_printed(pair, tmp_path, capsys):
    ids = np.random.default_rng(0).integers(1, 50, size=(3, 12)).astype(np.int64)
    np.savez(tmp_path / "x.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    code = main(["check", str(pair / "a.onnx"), "--atol", "1e-3", "--inputs", str(tmp_path / "x.npz"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["samples"] == 3 and report["tolerance"]["atol"] == 1e-3
    code = main(["check", str(pair / "a.onnx"), "--atol", "1e-12", "--rtol", "0", "--inputs", str(tmp_path / "x.npz")])
    text = capsys.readouterr().out
    assert code == 1 and "atol=1e-12" in text and "the smallest atol that passes is" in text
