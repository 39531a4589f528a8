"""One line for every bad input, before any work; reading never writes; the report's fields are what
it prints; links, tokenizers and targets refused alike wherever they appear."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from adaptex.cli import main
from adaptex.cli._util import UsageError, read_inputs
from adaptex.graphs.errors import AdaptexError, CheckpointError, DataError
from tests.support import zoo


def _meta(**change):
    meta = {"format": 2, "family": "budgetformer", "target": "onnx", "variant": "sparse", "precision": "fp32",
            "inputs": {"input_ids": {"dtype": "int64", "shape": ["batch", "sequence"]}},
            "outputs": {"logits": {"dtype": "float32", "shape": ["batch", 4]}}, "source": {}}
    return {**meta, **change}


@pytest.mark.parametrize("change, message", [
    ({"precision": "fp8"}, "metadata 'precision' is 'fp8', not one of fp32, fp16, bf16; re-export it with adaptex"),
    ({"target": "tflite"}, "metadata 'target' is 'tflite', not one of onnx, coreml, tensorrt"),
    ({"variant": "fast"}, "metadata 'variant' is 'fast', not one of sparse, dense"),
    ({"max_sequence": -5}, "metadata 'max_sequence' is -5, not a length (at least 1)"),
])
def test_metadata_outside_its_schema_is_one_line(change, message):
    from adaptex.exporter.metadata import validate

    with pytest.raises(AdaptexError) as e:
        validate(_meta(**change), "m.onnx")
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["target", "family"])
def test_a_huge_metadata_value_is_not_echoed_whole(key):
    from adaptex.exporter.metadata import validate

    with pytest.raises(AdaptexError) as e:
        validate(_meta(**{key: "x" * 200_000}), "m.onnx")
    assert len(str(e.value)) < 300 and "(200002 characters)" in str(e.value)


def _npz(tmp_path, **arrays):
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    return str(path)


SPECS = {"input_ids": {"dtype": "int64", "shape": ["batch", "sequence"]},
         "attention_mask": {"dtype": "int64", "shape": ["batch", "sequence"]}}


@pytest.mark.parametrize("arrays, message", [
    (dict(input_ids=np.zeros((2, 0), np.int64), attention_mask=np.zeros((2, 0), np.int64)),
     r"input_ids has shape \[2, 0\], an axis of length 0 .*pass at least one token per row"),
    (dict(input_ids=np.zeros((20, 3, 4), np.int64), attention_mask=np.zeros((20, 3, 4), np.int64)),
     r"input_ids has shape \[20, 3, 4\] \(rank 3\); this artifact takes input_ids as \[batch, sequence\] \(rank 2\)"),
    (dict(input_ids=np.array([[1, "a"]], dtype=object), attention_mask=np.ones((1, 2), np.int64)),
     "holds a pickled .object. array, and adaptex never unpickles a file"),
])
def test_bad_inputs_files_are_one_line(tmp_path, arrays, message):
    with pytest.raises(UsageError, match=message):
        read_inputs(_npz(tmp_path, **arrays), ["input_ids", "attention_mask"], specs=SPECS)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_ids_outside_the_training_vocabulary_are_refused(tmp_path):
    from adaptex.graphs.data.classification import JsonlClassification

    train = _jsonl(tmp_path / "t.jsonl", [{"ids": [1, 2, 3], "label": i % 2} for i in range(40)])
    held = _jsonl(tmp_path / "e.jsonl", [{"ids": [1, 10**12], "label": 0}])
    with pytest.raises(DataError,
                       match=r"e.jsonl:1: token id 1000000000000 is outside the training vocabulary \(0..3\)"):
        JsonlClassification(train, held)


def test_an_absurd_token_id_is_refused_by_its_memory(tmp_path):
    from adaptex.graphs.data.classification import JsonlClassification
    from adaptex.graphs.memory import MemoryLimit

    train = _jsonl(tmp_path / "t.jsonl", [{"ids": [1, 10**12 if i == 3 else 2], "label": i % 2} for i in range(40)])
    held = _jsonl(tmp_path / "e.jsonl", [{"ids": [1, 2], "label": 0}])
    with pytest.raises(MemoryLimit, match=r"token id 1000000000000: .*the largest .*token id that fits is \d+"):
        JsonlClassification(train, held)


def test_lint_names_external_data_outside_the_models_directory(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("float_data")
    for k, v in (("location", "../outside.bin"), ("offset", "0"), ("length", "4")):
        w.external_data.add(key=k, value=v)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], [w])
    (tmp_path / "d").mkdir()
    onnx.save(helper.make_model(graph), str(tmp_path / "d" / "m.onnx"))
    (tmp_path / "outside.bin").write_bytes(b"\0" * 4)
    assert main(["lint", str(tmp_path / "d" / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "tensor 'w' keeps its data at '../outside.bin', outside the model's directory" in err
    assert "pass an .onnx file" not in err


def test_a_linked_checkpoint_file_is_refused_as_a_packages_is(tmp_path):
    from adaptex.graphs import checkpoint

    real = tmp_path / "real"
    zoo.save_tiny(real)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").write_bytes((real / "config.json").read_bytes())
    os.symlink(real / "model.safetensors", linked / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is a link .*reads no checkpoint or package file "
                                              "through a link"):
        checkpoint.load(linked)


@pytest.mark.parametrize("spec, message", [
    ({"kind": "sentencepiece"}, "tokenizer kind 'sentencepiece' is not one of ids, chars, words, wordpiece"),
    ({"kind": "words", "pad": 0, "vocab": {"a": 999}, "filler": [7, 63], "separators": " "},
     "'vocab' must map words to ids of the vocabulary"),
    ({"kind": "chars", "pad": 0, "unk": 1, "itos": 5}, "'itos' must list at most 64 characters"),
])
def test_a_broken_tokenizer_is_refused_at_load(tmp_path, spec, message):
    from adaptex.graphs import checkpoint

    zoo.save_tiny(tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["tokenizer"] = spec
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(tmp_path / "ck")


def test_a_checkpoints_artifact_against_a_model_of_your_own_names_the_checkpoint():
    from adaptex.runtimes.source import check_source

    meta = {"source": {"checkpoint": "/models/bf", "sha256": "ab" * 32}}
    with pytest.raises(AdaptexError,
                       match=r"exported from a checkpoint \(/models/bf\) \(weights sha256 abababababab\)"):
        check_source(meta, model=zoo.tiny_model(), name="Tiny")


def test_a_non_finite_output_reads_inf_in_every_field():
    from adaptex.runtimes.parity import _compare_values
    from adaptex.runtimes.report import ParityReport

    report = ParityReport("a", "b", "fp32", {"atol": 1e-4, "rtol": 1e-4}, {})
    _compare_values(report, "y", np.array([np.inf, 1.0]), np.array([np.inf, 1.0]), "batch 0")
    d = report.to_dict()
    assert d["max_abs_err"] == d["max_rel_err"] == d["outputs"]["y"]["needed_atol"] == float("inf")
    assert report.max_abs_err == float("inf") and "inf" in report.format()


def test_an_onnx_labelled_tensorrt_is_checked_as_tensorrt(tiny_onnx, tmp_path):
    import onnx

    from adaptex.exporter.metadata import META_KEY
    from adaptex.runtimes.open import open_artifact

    model = onnx.load(str(tiny_onnx["sparse"]))
    for p in model.metadata_props:
        if p.key == META_KEY:
            p.value = json.dumps({**json.loads(p.value), "target": "tensorrt"})
    onnx.save(model, str(tmp_path / "m.onnx"))
    with pytest.raises(AdaptexError, match=r"its metadata names target tensorrt, but it breaks \d+ of TensorRT's "
                                           "parser rules"):
        open_artifact(tmp_path / "m.onnx")


def test_inspect_never_writes_a_package(artifacts, tmp_path, capsys):
    import shutil

    pkg = tmp_path / "m.mlpackage"
    shutil.copytree(artifacts("bf", "coreml", "dense"), pkg)
    before = {str(p): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in pkg.rglob("*")}
    listing = sorted(os.listdir(pkg))
    assert main(["inspect", str(pkg)]) == 0 and "target: coreml" in capsys.readouterr().out
    assert {str(p): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in pkg.rglob("*")} == before
    assert sorted(os.listdir(pkg)) == listing


def test_core_ml_output_directory_is_made_as_the_docs_say(tmp_path):
    from adaptex.exporter.targets.coreml.package import check_output

    check_output(tmp_path / "new" / "dir" / "m.mlpackage")
    assert (tmp_path / "new" / "dir").is_dir()


def test_an_export_over_a_package_does_not_open_the_old_one_for_writing(artifacts, tmp_path):
    """What export reads of the package it will replace (is it adaptex's?) is read only: on a full disk
    coremltools' reader left empty Manifest.<uuid> files inside the old package."""
    import shutil

    from adaptex.exporter.targets.coreml.package import check_output

    pkg = tmp_path / "m.mlpackage"
    shutil.copytree(artifacts("bf", "coreml", "dense"), pkg)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in pkg.rglob("*"))
    check_output(pkg)
    assert sorted((str(p), p.stat().st_mtime_ns) for p in pkg.rglob("*")) == before
