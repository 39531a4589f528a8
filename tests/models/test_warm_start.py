"""Warm starts: BudgetFormer and TSA from a pretrained dense model (--init), routers fresh, distilled
from it (graphs/recipes/tsa.py, graphs/recipes/budgetformer.py)."""
import json

import pytest
import torch

from adaptex.cli import main
from adaptex.graphs import checkpoint
from tests.support import hf_dirs

SMALL_TSA = ["--d-model", "32", "--heads", "4", "--layers", "3", "--d-ff", "64"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_tsa_from_a_dense_decoder_starts_from_its_weights_and_reports_against_it(tmp_path, capsys):
    dense, tsa = tmp_path / "dense", tmp_path / "tsa"
    assert main(["train", "tsa", "--task", "charlm", "--dense", *SMALL_TSA, "--steps", "3", "--max-tokens", "64",
                 "--max-len", "256", "--eval-size", "4", "-o", str(dense)]) == 0
    assert main(["train", "tsa", "--init", str(dense), "--steps", "4", "--batch-size", "4", "--eval-size", "8",
                 "--ops-saved", "0.2", "-o", str(tsa)]) == 0
    out = capsys.readouterr().out
    assert f"--init {dense.name} (start)" in out and "loss increase of the deployed TSA over the model it started from" in out
    src, _ = checkpoint.load(dense)
    m, info = checkpoint.load(tsa)
    assert m.cfg.adaptive and (m.cfg.d_model, m.cfg.num_layers, m.cfg.max_len) == (32, 3, 256)  # the shape is the init's
    assert info["training"]["init"]["checkpoint"] == str(dense) and "init" in info["evaluation"]
    tc = info["training"]["train_config"]
    assert tc["distill"] == 1.0 and abs(tc["target_keep"] - (1 - 0.2 * 3 / 2)) < 1e-9
    # with zero steps of learning the student is the dense model up to its routers' gates
    assert main(["train", "tsa", "--init", str(dense), "--steps", "1", "--lr", "1e-12", "--batch-size", "2",
                 "--eval-size", "8", "--save-dtype", "float32", "-o", str(tmp_path / "zero")]) == 0
    z, _ = checkpoint.load(tmp_path / "zero")
    for k, v in src.state_dict().items():
        assert torch.allclose(z.state_dict()[k], v, atol=1e-3), k


def test_tsa_from_gpt2_maps_its_layers(tmp_path, capsys):
    gpt2 = hf_dirs.make("gpt2", tmp_path)
    corpus = hf_dirs.corpus(tmp_path / "c.txt")
    from adaptex.graphs.hf import load_decoder
    from adaptex.graphs.hf.tsa_weights import gpt2_as_tsa
    from adaptex.graphs.tsa import TSAConfig, TSADecoder

    kw, init, teacher, tok, rec = gpt2_as_tsa(str(gpt2))
    model = TSADecoder(TSAConfig(**kw, adaptive=False))
    model.load_state_dict(init)
    net, tokenizer, _ = load_decoder(gpt2)
    ids = torch.tensor([tokenizer.encode("the cat sat on the mat and the dog ran")])
    ref = net.dense(ids)[0]
    ours = model(ids, mode="dense")[0]
    # the same network but for GELU's tanh form (GPT-2) against the exact one (TSA)
    assert (ours - ref).abs().max() < 2e-3 and torch.equal(teacher(ids, None), ref)
    out = tmp_path / "tsa"
    assert main(["train", "tsa", "--init", str(gpt2), "--data", str(corpus), "--steps", "3", "--batch-size", "2",
                 "--max-tokens", "24", "--eval-size", "4", "-o", str(out)]) == 0
    m, info = checkpoint.load(out)
    assert m.cfg.positions == "learned" and info["tokenizer"]["kind"] == "tokenizer.json"
    assert info["training"]["init"]["layout"] == "gpt2"


def test_warm_start_refusals(tmp_path, capsys):
    llama = hf_dirs.make("llama", tmp_path)
    roberta = hf_dirs.make("roberta", tmp_path)
    corpus = hf_dirs.corpus(tmp_path / "c.txt")
    capsys.readouterr()  # transformers' own output while writing the directories
    cases = [
        (["tsa", "--init", str(llama), "--data", str(corpus)], "map GPT-2 only"),
        (["tsa", "--init", str(roberta), "--data", str(corpus)], "a Hugging Face encoder"),
        (["tsa", "--init", "budgetformer-graded"], "a budgetformer checkpoint"),
        (["tsa", "--init", "charlm-dense", "--d-model", "64"], "--d-model with --init"),
        (["tsa", "--init", "charlm-dense", "--ops-saved", "0.9"], "--ops-saved 0.9: must lie in"),
        (["tsa", "--task", "copy", "--ops-saved", "0.2"], "--ops-saved goes with --init"),
        (["budgetformer", "--init", str(roberta)], "BudgetFormer (pre-norm"),
        (["budgetformer", "--init", "tsa-charlm"], "a tsa checkpoint"),
        (["elastic", "--init", "charlm-dense"], "elastic routers start on --backbone"),
    ]
    for args, msg in cases:
        code = main(["train", *args, "-o", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert code == 2 and msg in err and err.count("\n") == 1, (args, err)
        assert not (tmp_path / "x").exists()


def test_budgetformer_dense_then_warm_start(tmp_path, capsys):
    dense, bf = tmp_path / "dense", tmp_path / "bf"
    small = ["--task", "graded", "--d-model", "32", "--heads", "4", "--layers", "1", "--d-ff", "32", "--batch-size", "8",
             "--eval-size", "64"]
    assert main(["train", "budgetformer", "--dense", *small, "--steps", "4", "-o", str(dense)]) == 0
    d, _ = checkpoint.load(dense)
    assert not d.cfg.adaptive
    assert main(["train", "budgetformer", "--init", str(dense), "--task", "graded", "--steps", "4", "--batch-size", "8",
                 "--eval-size", "64", "-o", str(bf)]) == 0
    out = capsys.readouterr().out
    assert f"--init {dense.name} (start)" in out
    m, info = checkpoint.load(bf)
    assert m.cfg.adaptive and m.cfg.d_model == 32 and "init" in info["evaluation"]
    assert json.loads((bf / "summary.json").read_text())["metrics"]["init"]["accuracy"] >= 0
