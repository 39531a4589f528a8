"""Each family trains for a few steps on a file the test writes, exports, and passes `adaptex check`;
the checkpoint and the artifact carry the tokenizer (and a classifier its labels). The elastic
families train on files in tests/models/test_hf.py, on Hugging Face backbones."""
from __future__ import annotations

import json

import pytest

from adaptex.cli import main
from adaptex.exporter.metadata import read_onnx_metadata
from adaptex.graphs.data import from_spec
from tests.support import hf_dirs

SMALL = ["--steps", "4", "--batch-size", "4", "--d-model", "32", "--heads", "4", "--layers", "2", "--d-ff", "64",
         "--eval-size", "16", "--no-baseline", "--seed", "1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _train_export_check(tmp_path, capsys, family: str, data, *extra, export: bool = True) -> tuple[dict, dict]:
    ckpt = tmp_path / "runs" / "deep" / family  # -o creates the missing parents
    assert main(["train", family, "--data", str(data), *SMALL, *extra, "-o", str(ckpt)]) == 0
    info = json.loads((ckpt / "config.json").read_text())
    if not export:  # what export carries over is the checkpoint's tokenizer and config (shown once below)
        return info, {"tokenizer": info["tokenizer"], "config": info["config"]}
    art = tmp_path / f"{family}.onnx"
    assert main(["export", str(ckpt), "--target", "onnx", "-o", str(art)]) == 0
    capsys.readouterr()
    assert main(["check", str(art), "--samples", "24"]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "unexcused flips 0" in out, out
    return info, read_onnx_metadata(art)


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_budgetformer_on_jsonl(tmp_path, capsys, kind):
    data = hf_dirs.jsonl(tmp_path / "train.jsonl", lines=160, ids=kind == "ids")
    info, meta = _train_export_check(tmp_path, capsys, "budgetformer", data, export=kind == "text")
    training = info["training"]
    assert training["task"] == "file" and training["data"]["files"] == [str(data)] and training["format"] == kind
    assert len(training["data"]["sha256"]) == 64 and training["data"]["eval_lines"] > 0
    assert meta["config"]["labels"] == ["dense", "sparse", "stream"] and meta["config"]["num_classes"] == 3
    assert meta["tokenizer"] == info["tokenizer"]
    if kind == "text":
        tok = from_spec(meta["tokenizer"])  # an app needs nothing but the artifact
        assert tok.decode(tok.encode("dense data")) == "dense data"
    else:
        assert meta["tokenizer"]["kind"] == "ids"


def test_budgetformer_with_an_eval_file_and_a_tokenizer_json(tmp_path, capsys):
    data = hf_dirs.jsonl(tmp_path / "train.jsonl", lines=120)
    ev = hf_dirs.jsonl(tmp_path / "eval.jsonl", lines=30, seed=5)
    tok = tmp_path / "tokenizer.json"
    hf_dirs.tokenizer(["[PAD]", "[UNK]"], unk="[UNK]").save(str(tok))
    info, meta = _train_export_check(tmp_path, capsys, "budgetformer", data, "--eval", str(ev), "--tokenizer", str(tok),
                                     export=False)
    assert info["training"]["eval"]["eval_lines"] == 30 and info["training"]["data"]["eval_lines"] == 0
    assert meta["tokenizer"]["kind"] == "tokenizer.json" and meta["tokenizer"]["json"] == tok.read_text()
    assert meta["config"]["vocab_size"] == 2 + len(hf_dirs.WORDS)


def test_tsa_on_a_text_file(tmp_path, capsys):
    data = hf_dirs.corpus(tmp_path / "corpus.txt")
    info, meta = _train_export_check(tmp_path, capsys, "tsa", data, "--max-tokens", "32", "--max-len", "64")
    assert info["training"]["task"] == "file" and info["training"]["data"]["train_lines"] > 0
    assert meta["tokenizer"]["kind"] == "chars" and meta["config"]["max_len"] == 64
    assert info["evaluation"]["tsa_hard"]["loss"] > 0
