"""Bad input: one line naming the problem and the fix, a non-zero exit, no partial file."""

import numpy as np
import pytest

from adaptex.cli import main
from adaptex.graphs.errors import InputError
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner


def fails(capsys, *argv, match):
    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    assert code != 0
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("adaptex: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err  # one error line, last, no traceback
    assert "Traceback" not in err
    assert match in errors[0], errors[0]
    return errors[0]


def no_files(d):
    return [p.name for p in d.iterdir()] == []


def test_missing_checkpoint(tmp_path, capsys):
    fails(capsys, "export", tmp_path / "nope", "--target", "onnx", "-o", tmp_path / "m.onnx",
          match="no such checkpoint directory or shipped model")
    assert no_files(tmp_path)


def _broken_checkpoint(tmp_path, config: str | None, weights: bytes):
    ck = tmp_path / "ck"
    ck.mkdir()
    if config is not None:
        (ck / "config.json").write_text(config)
    if weights:
        (ck / "model.safetensors").write_bytes(weights)
    out = tmp_path / "out"
    out.mkdir()
    return ck, out


@pytest.mark.parametrize("case, match", [("no_weights", "model.safetensors is missing"),
                                         ("bad_config", "config.json: not valid JSON"),
                                         ("bad_weights", "corrupt weights"),
                                         ("mismatch", "weights do not match config.json"),
                                         ("shape", "weights do not match config.json")])
def test_broken_checkpoints(tmp_path, capsys, tiny_checkpoint, case, match):
    config = (tiny_checkpoint / "config.json").read_text()
    weights = (tiny_checkpoint / "model.safetensors").read_bytes()
    if case == "mismatch":
        config = config.replace('"num_layers": 2', '"num_layers": 3')
    if case == "shape":
        config = config.replace('"d_ff": 64', '"d_ff": 32')
    ck, out = _broken_checkpoint(tmp_path, "{ not json" if case == "bad_config" else config,
                                 {"no_weights": b"", "bad_weights": b"\x00" * 100}.get(case, weights))
    fails(capsys, "export", ck, "--target", "onnx", "-o", out / "m.onnx", match=match)
    assert no_files(out)


def test_unknown_target(tmp_path, capsys, tiny_checkpoint):
    fails(capsys, "export", tiny_checkpoint, "--target", "tflite", "-o", tmp_path / "m.onnx",
          match="unknown target 'tflite'; choose one of onnx, coreml, tensorrt")
    assert no_files(tmp_path)


def test_tensorrt_engine_without_gpu_names_onnx_only(tmp_path, capsys, tiny_checkpoint):
    from tests.conftest import _tensorrt_reason

    if _tensorrt_reason() is None:
        pytest.skip("TensorRT and a GPU are present: the engine would build")
    fails(capsys, "export", tiny_checkpoint, "--target", "tensorrt", "-o", tmp_path / "m.plan", match="--onnx-only")
    assert no_files(tmp_path)


@pytest.mark.parametrize("where", ["ancestor_is_file", "dir_is_file", "out_is_dir"])
def test_unwritable_output(tmp_path, capsys, tiny_checkpoint, where):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # (a missing parent directory is created, like mkdir -p: tests/integration/test_cli.py)
    out = {"ancestor_is_file": blocker / "sub" / "m.onnx", "dir_is_file": blocker / "m.onnx", "out_is_dir": tmp_path}[where]
    fails(capsys, "export", tiny_checkpoint, "--target", "onnx", "-o", out, match=str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_failed_export_leaves_no_partial_file(tmp_path, capsys, tiny_checkpoint, monkeypatch):
    import onnx

    def broken_save(proto, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", broken_save)
    fails(capsys, "export", tiny_checkpoint, "--target", "onnx", "-o", tmp_path / "m.onnx",
          match="writing failed (No space left on device); nothing was written")
    assert no_files(tmp_path)


def test_onnx_artifact_needs_its_suffix(tmp_path, capsys, tiny_checkpoint):
    fails(capsys, "export", tiny_checkpoint, "--target", "onnx", "-o", tmp_path / "model",
          match="must end in .onnx")
    assert no_files(tmp_path)


def test_train_refuses_to_overwrite_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    fails(capsys, "train", "budgetformer", "-o", tmp_path, "--steps", "1", match="is not a checkpoint directory")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("argv, match", [
    (["--heads", "7"], "not divisible by num_heads=7"),
    (["--s-min", "0.5", "--s-max", "0.4"], "budget range [0.5, 0.4] must lie in (0, 1)"),
    (["--steps", "0"], "must be at least 1"),
])
def test_train_rejects_bad_settings(tmp_path, capsys, argv, match):
    fails(capsys, "train", "budgetformer", "-o", tmp_path / "ck", *argv, match=match)
    assert not (tmp_path / "ck").exists()


def test_bench_rejects_bad_runs(tiny_onnx, capsys):
    fails(capsys, "bench", tiny_onnx["sparse"], "--runs", "0", match="--runs 0: must be at least 1")


def test_unexpected_failures_are_one_line(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from adaptex.exporter.targets import onnx as target

    def boom(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(target, "lower", boom)
    fails(capsys, "export", tiny_checkpoint, "--target", "onnx", "-o", tmp_path / "m.onnx",
          match="unexpected ZeroDivisionError: a bug")
    assert no_files(tmp_path)


def test_check_an_onnx_file_not_made_by_adaptex(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(g), str(tmp_path / "other.onnx"))
    fails(capsys, "check", tmp_path / "other.onnx", match="has no adaptex metadata")


def test_check_missing_artifact(tmp_path, capsys):
    fails(capsys, "check", tmp_path / "m.onnx", match="no such artifact")


def test_bench_sequence_past_maximum(tiny_onnx, capsys):
    fails(capsys, "bench", tiny_onnx["sparse"], "--seq", "65",
          match="--seq 65: above the model's limit of 64 positions; the largest --seq that fits is 64")


@pytest.fixture
def runner(tiny_onnx):
    return OnnxRuntimeRunner(tiny_onnx["sparse"])


def feeds(B=2, T=5):
    return {"input_ids": np.ones((B, T), dtype=np.int64), "attention_mask": np.ones((B, T), dtype=np.int64)}


@pytest.mark.parametrize("bad, match", [
    (lambda f: {**f, "input_ids": f["input_ids"].astype(np.int32)}, "input_ids: dtype int32, expected int64"),
    (lambda f: {**f, "input_ids": f["input_ids"][0]}, "input_ids: rank 1"),
    (lambda f: {k: np.ones((1, 65), dtype=np.int64) for k in f}, "sequence length 65 exceeds the model's maximum 64"),
    (lambda f: {**f, "input_ids": f["input_ids"] * 64}, "input_ids: values must lie in [0, 64)"),
    (lambda f: {**f, "attention_mask": np.zeros_like(f["attention_mask"])}, "row 0 has no real token"),
    (lambda f: {"input_ids": f["input_ids"]}, "missing ['attention_mask']"),
    (lambda f: {**f, "attention_mask": np.ones((2, 4), dtype=np.int64)}, "must have the same (batch, sequence)"),
])
def test_runner_rejects_bad_inputs(runner, bad, match):
    with pytest.raises(InputError) as e:
        runner.infer(bad(feeds()))
    assert match in str(e.value) and "\n" not in str(e.value)
