"""The shipped default model: present, loadable, and as good as its training summary says."""
import json

import numpy as np
import pytest

from tests import zoo
import torch

from adaptex.graphs import checkpoint
from adaptex.graphs.tasks import GradedCues
from adaptex.graphs.recipes.budgetformer import evaluate


@pytest.fixture(scope="module")
def shipped():
    path = checkpoint.resolve(None)
    return checkpoint.load(path), json.loads((path / checkpoint.CONFIG).read_text())


def test_default_model_is_shipped_and_small(shipped):
    (model, info), _ = shipped
    assert info["family"] == "budgetformer" and info["training"]["task"] == "graded"
    size = (checkpoint.resolve(None) / checkpoint.WEIGHTS).stat().st_size
    assert size < 5 * 2**20, "shipped checkpoints stay a few MB at most"


def test_recorded_summary_meets_the_bar(shipped):
    """Accuracy within 1 point of the same-size standard Transformer or better, at most half the
    heads on average, and a budget that rises with difficulty."""
    _, raw = shipped
    ev = raw["evaluation"]
    ours, base = ev["budgetformer"], ev["baseline"]
    assert ours["accuracy"] >= base["accuracy"] - 0.01, (ours["accuracy"], base["accuracy"])
    assert ours["heads_fraction"] <= 0.5
    s = [ours["s_by_level"][str(lv)] for lv in range(len(GradedCues.levels))]
    assert s[-1] > s[0], s
    assert np.corrcoef(range(len(s)), s)[0, 1] > 0.5, s


def test_recorded_summary_reproduces(shipped):
    (model, _), raw = shipped
    recorded = raw["evaluation"]["budgetformer"]
    r = evaluate(model, GradedCues(), n=2000)  # the same held-out seed as training's evaluation
    assert abs(r["accuracy"] - recorded["accuracy"]) < 1e-6
    assert abs(r["heads_fraction"] - recorded["heads_fraction"]) < 1e-6
    for lv, s in r["s_by_level"].items():
        assert abs(s - recorded["s_by_level"][str(lv)]) < 1e-5


def test_shipped_model_exports_and_passes_parity(shipped, tmp_path):
    from adaptex.exporter.targets import onnx as target
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.torch_ref import TorchRunner

    (model, info), _ = shipped
    info = {**info, "name": checkpoint.DEFAULT_MODEL}
    zoo.export(model, info, tmp_path / "m.onnx")
    report = check(OnnxRuntimeRunner(tmp_path / "m.onnx"), TorchRunner(model), samples=60, task="graded")
    assert report.passed, report.format()
    assert report.max_abs_err <= 1e-4 and report.decisions_vary


def test_shipped_elastic_minilm_meets_its_bar_and_reproduces():
    """elastic-minilm: the recorded held-out figures meet issue 5's bar (>= 50% SA heads at mean
    cosine >= 0.98), and a fresh evaluation on 32 of the same passages agrees with them."""
    from adaptex.graphs.elastic import StdlibText, evaluate_elastic
    from adaptex.graphs.minilm import MiniLMTokenizer, default_model_dir

    model, info = checkpoint.load("elastic-minilm")
    held = info["evaluation"]["held_out"]
    assert held["sa_fraction"] >= 0.5 and held["mean_cosine"] >= 0.98 and held["n"] >= 200
    assert (checkpoint.resolve("elastic-minilm") / checkpoint.WEIGHTS).stat().st_size < 2**20  # routers only
    tok = MiniLMTokenizer(default_model_dir() / "tokenizer.json")
    again = evaluate_elastic(model, tok, StdlibText(), n=32, max_tokens=256, split="val")
    assert abs(again["sa_fraction"] - held["sa_fraction"]) < 0.05
    assert again["mean_cosine"] > 0.975


def test_shipped_elastic_charlm_reproduces():
    """elastic-charlm: routers on the frozen charlm-dense decoder; a fresh evaluation on 8 of the
    recorded held-out windows agrees with the recorded SA fraction and loss increase, and the
    backbone inside it is charlm-dense's, untouched."""
    from adaptex.graphs.elastic_decoder import evaluate_elastic_decoder
    from adaptex.graphs.lm_tasks import StdlibChars

    model, info = checkpoint.load("elastic-charlm")
    held = info["evaluation"]["held_out"]
    assert held["sa_fraction"] >= 0.5 and held["n"] >= 64 and model.cfg.max_len >= 4096
    again = evaluate_elastic_decoder(model, StdlibChars(context=held["context"]), n=8, context=held["context"])
    assert abs(again["sa_fraction"] - held["sa_fraction"]) < 0.1
    assert again["loss_increase"] < held["loss_increase"] + 0.02
    dense, dinfo = checkpoint.load("charlm-dense")
    assert model.cfg.backbone_sha256 == dinfo["sha256"]
    mine = model.backbone.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in dense.state_dict().items())
