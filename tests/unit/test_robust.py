"""Hostile and careless use (issue 19): artifacts whose metadata describes another graph, corrupt and
linked packages, empty files, thread counts, inputs in odd dtypes and byte orders, interrupted temp
creation, the generation example's bad arguments, unknown flags. Each is refused with one line that
names the fix, before any run, or gives correct output."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from adaptex.cli import main
from adaptex.exporter.metadata import META_KEY, read_onnx_metadata
from adaptex.graphs.errors import AdaptexError, InputError
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner


def one_line_error(capsys, *argv) -> str:
    """Run the CLI, expect exit 2 and exactly one error line (the last) on stderr; return that line."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "usage:" not in err, err
    assert lines and lines[-1].startswith("adaptex: error: "), err
    assert sum(line.startswith("adaptex: error: ") for line in lines) == 1, err
    return lines[-1]


def no_bench(monkeypatch):
    """Make any benchmark fail the test: a refusal must come before anything runs."""
    from adaptex.runtimes import bench

    def ran(*a, **k):
        raise AssertionError("the benchmark started before the artifact was refused")

    monkeypatch.setattr(bench, "Bench", ran)


# --- metadata that does not describe its graph ---------------------------------------------------------

def _onnx_with(meta_text: str, path, dtype=None, names=("input_ids", "attention_mask")):
    """A small foreign ONNX graph (Identity per input) carrying `meta_text` as adaptex metadata."""
    import onnx
    from onnx import TensorProto, helper

    dtype = dtype or TensorProto.FLOAT
    nodes = [helper.make_node("Identity", [n], [f"{n}.out"]) for n in names]
    g = helper.make_graph(nodes, "foreign", [helper.make_tensor_value_info(n, dtype, ["b", "t"]) for n in names],
                          [helper.make_tensor_value_info(f"{n}.out", dtype, ["b", "t"]) for n in names])
    model = helper.make_model(g)
    helper.set_model_props(model, {META_KEY: meta_text})
    onnx.save(model, str(path))
    return path


def _meta_text(path) -> str:
    return json.dumps(read_onnx_metadata(path))


@pytest.mark.parametrize("case", ["other_names", "same_names_other_dtype"])
def test_onnx_metadata_copied_onto_a_foreign_graph_is_refused_at_open(tiny_onnx, tmp_path, capsys, monkeypatch, case):
    from onnx import TensorProto

    text = _meta_text(tiny_onnx["sparse"])
    if case == "other_names":
        path = _onnx_with(text, tmp_path / "foreign.onnx", names=("x",))
        match = "the metadata's inputs ['attention_mask', 'input_ids'] are not the graph's"
    else:  # the adaptive model's input names, but float inputs and identity outputs
        path = _onnx_with(text, tmp_path / "foreign.onnx", dtype=TensorProto.FLOAT)
        match = "does not describe this graph"
    with pytest.raises(AdaptexError, match="does not describe this graph") as e:
        OnnxRuntimeRunner(path)  # at open: no session, no run
    assert "\n" not in str(e.value) and "re-export the model with adaptex" in str(e.value)
    if case == "other_names":
        assert match in str(e.value)
    no_bench(monkeypatch)
    for argv in (["check", path, "--samples", "2"], ["bench", path, "--runs", "1"], ["inspect", path]):
        assert "does not describe this graph" in one_line_error(capsys, *argv)


def test_onnx_metadata_of_another_adaptex_model_is_refused(artifacts, tmp_path, capsys):
    """The TSA decoder's metadata pasted onto the BudgetFormer graph: same writer, other model."""
    import onnx

    model = onnx.load(str(artifacts("bf")))
    tsa_text = _meta_text(artifacts("tsa"))
    for p in model.metadata_props:
        if p.key == META_KEY:
            p.value = tsa_text
    onnx.save(model, str(tmp_path / "swapped.onnx"))
    line = one_line_error(capsys, "check", tmp_path / "swapped.onnx", "--samples", "2")
    assert "does not describe this graph" in line and "past_key_values" in line


def _copy_package(src, dst):
    shutil.copytree(src, dst)
    return dst


def _spec_file(pkg):
    return pkg / "Data" / "com.apple.CoreML" / "model.mlmodel"


def _weights(pkg):
    return pkg / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"


def test_core_ml_metadata_copied_from_another_model_is_refused_at_open(tiny_coreml, artifacts, tmp_path, capsys,
                                                                       monkeypatch):
    from adaptex.exporter.targets.coreml.package import load_spec
    from adaptex.runtimes.open import open_artifact

    pkg = _copy_package(tiny_coreml["sparse"], tmp_path / "m.mlpackage")
    spec = load_spec(pkg)
    spec.description.metadata.userDefined[META_KEY] = _meta_text(artifacts("tsa"))  # a decoder's metadata
    _spec_file(pkg).write_bytes(spec.SerializeToString())
    with pytest.raises(AdaptexError, match="its adaptex metadata does not describe this package") as e:
        open_artifact(pkg)
    assert "\n" not in str(e.value)
    no_bench(monkeypatch)
    for argv in (["check", pkg, "--samples", "2"], ["inspect", pkg]):
        assert "does not describe this package" in one_line_error(capsys, *argv)


def test_core_ml_feature_of_another_rank_is_refused(tiny_coreml, tmp_path, capsys):
    from adaptex.exporter.targets.coreml.package import load_spec

    pkg = _copy_package(tiny_coreml["sparse"], tmp_path / "m.mlpackage")
    spec = load_spec(pkg)
    meta = json.loads(spec.description.metadata.userDefined[META_KEY])
    meta["inputs"]["input_ids"]["shape"].append(1)  # the metadata says rank 3, the program takes rank 2
    spec.description.metadata.userDefined[META_KEY] = json.dumps(meta)
    _spec_file(pkg).write_bytes(spec.SerializeToString())
    line = one_line_error(capsys, "inspect", pkg)
    assert "feature 'input_ids' has rank 2, the metadata says 3" in line


# --- empty, garbage and corrupt artifacts ----------------------------------------------------------------

@pytest.mark.parametrize("content, match", [(b"", "is empty (0 bytes), not an ONNX model"),
                                            (b"\x08\x07garbage" * 20, "not a readable ONNX model")])
@pytest.mark.parametrize("command", ["check", "inspect", "bench"])
def test_an_empty_or_garbage_onnx_file_says_so(tmp_path, capsys, monkeypatch, content, match, command):
    path = tmp_path / "m.onnx"
    path.write_bytes(content)
    no_bench(monkeypatch)
    line = one_line_error(capsys, command, path)
    assert match in line and "no adaptex metadata" not in line
    with pytest.raises(AdaptexError, match=re.escape(match)):
        OnnxRuntimeRunner(path)


@pytest.mark.parametrize("content, match", [(b"", "is empty (0 bytes), not an ONNX model"),
                                            (b"\x10\x07", "not an ONNX model (no graph)")])
def test_lint_refuses_an_empty_file_instead_of_passing_it(tmp_path, capsys, content, match):
    """Bytes that parse as an empty ModelProto have no nodes to break a rule: not a pass."""
    path = tmp_path / "m.onnx"
    path.write_bytes(content)
    assert match in one_line_error(capsys, "lint", path)
    if content:
        assert match in one_line_error(capsys, "inspect", path)


@pytest.mark.parametrize("damage", ["missing", "truncated", "empty"])
def test_a_corrupt_package_is_one_line(tiny_coreml, tmp_path, capsys, damage):
    pkg = _copy_package(tiny_coreml["sparse"], tmp_path / "m.mlpackage")
    w = _weights(pkg)
    if damage == "missing":
        w.unlink()
    else:
        w.write_bytes(w.read_bytes()[:200] if damage == "truncated" else b"")
    line = one_line_error(capsys, "check", pkg, "--samples", "2")
    assert "a corrupt ML package: its program or weights cannot be read" in line and "re-export it" in line


@pytest.mark.parametrize("what", ["weight.bin", "weights_dir"])
def test_a_package_linking_outside_itself_is_refused(tiny_coreml, tmp_path, capsys, what):
    """As ONNX external data outside the model's folder is refused: nothing is read through a link."""
    pkg = _copy_package(tiny_coreml["sparse"], tmp_path / "m.mlpackage")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    src = _weights(pkg) if what == "weight.bin" else _weights(pkg).parent
    moved = elsewhere / src.name
    shutil.move(src, moved)
    src.symlink_to(moved, target_is_directory=moved.is_dir())
    for argv in (["check", pkg, "--samples", "2"], ["inspect", pkg]):
        line = one_line_error(capsys, *argv)
        assert f"{src.relative_to(pkg)} is a link to outside the package ({moved.resolve()})" in line, line


# --- thread counts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads, match", [("-1", "--threads -1: must be at least 0"),
                                            ("100000", "--threads 100000: must lie in 0..")])
def test_check_refuses_thread_counts_out_of_range(tiny_onnx, capsys, threads, match):
    import torch

    before = torch.get_num_threads()
    assert match in one_line_error(capsys, "check", tiny_onnx["sparse"], "--threads", threads, "--samples", "2")
    assert torch.get_num_threads() == before  # refused before it was applied


@pytest.mark.parametrize("threads", ["-1", "100000", "1,100000"])
def test_bench_refuses_thread_counts_out_of_range_before_running(tiny_onnx, capsys, monkeypatch, threads):
    no_bench(monkeypatch)
    line = one_line_error(capsys, "bench", tiny_onnx["sparse"], "--threads", threads)
    assert "--threads" in line and threads.split(",")[-1] in line  # a list: every value checked up front


@pytest.mark.parametrize("threads", [-1, 10**5])
def test_runner_refuses_thread_counts_out_of_range(tiny_onnx, threads):
    with pytest.raises(AdaptexError, match=f"--threads {threads}: must lie in 0..") as e:
        OnnxRuntimeRunner(tiny_onnx["sparse"], threads=threads)
    assert "\n" not in str(e.value)


# --- inputs: dtypes, byte order, values -----------------------------------------------------------------------

def _feeds(B=2, T=6, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), np.int64)
    mask[-1, T // 2:] = 0
    return {"input_ids": rng.integers(1, 64, (B, T)).astype(np.int64), "attention_mask": mask}


def test_runner_refuses_non_native_byte_order(tiny_onnx):
    f = _feeds()
    swapped = f["input_ids"].astype(f["input_ids"].dtype.newbyteorder())  # same values, big-endian bytes
    assert not swapped.dtype.isnative and np.array_equal(swapped, f["input_ids"])
    with pytest.raises(InputError, match=r"input_ids: int64 in non-native byte order .*astype\(np.int64\)"):
        OnnxRuntimeRunner(tiny_onnx["sparse"]).infer({**f, "input_ids": swapped})


@pytest.mark.parametrize("bad", [np.array([["a", "b"]]), np.array([[None, 1]], dtype=object),
                                 np.array([[1 + 2j, 3j]])])
def test_runner_refuses_non_numeric_inputs(tiny_onnx, bad):
    with pytest.raises(InputError, match="input_ids: dtype .*, expected int64"):
        OnnxRuntimeRunner(tiny_onnx["sparse"]).infer({"input_ids": bad, "attention_mask": np.ones((1, 2), np.int64)})


def test_api_check_takes_big_endian_and_float_inputs_that_are_exact(tiny_onnx):
    """A caller's float ids (3.0) and big-endian arrays hold the same numbers: conformed, and the
    check runs on them (and passes: the artifact computes the model)."""
    import adaptex

    f = _feeds(B=3, T=8)
    odd = {"input_ids": f["input_ids"].astype(">f8"), "attention_mask": f["attention_mask"].astype(np.float32)}
    report = adaptex.check(tiny_onnx["sparse"], inputs=[odd, f])
    assert report.passed and report.samples == 6
    plain = adaptex.check(tiny_onnx["sparse"], inputs=[f, f])
    assert report.max_abs_err == plain.max_abs_err  # the same numbers were compared


@pytest.mark.parametrize("name, value, match", [
    ("attention_mask", 0.5, "attention_mask: float64 values that are not int64 values (e.g. 0.5)"),
    ("input_ids", 2.25, "input_ids: float64 values that are not int64 values (e.g. 2.25)"),
    ("input_ids", np.nan, "input_ids: float64 values that are not int64 values (e.g. nan)"),
])
def test_api_check_refuses_inputs_that_would_change_in_conversion(tiny_onnx, name, value, match):
    import adaptex

    f = {k: v.astype(np.float64) for k, v in _feeds().items()}
    f[name][0, 0] = value
    with pytest.raises(InputError) as e:
        adaptex.check(tiny_onnx["sparse"], inputs=[f])
    assert match in str(e.value) and "\n" not in str(e.value)


def test_api_check_refuses_text_inputs(tiny_onnx):
    import adaptex

    with pytest.raises(InputError, match="input_ids: dtype <U2 .*not numbers"):
        adaptex.check(tiny_onnx["sparse"], inputs=[(np.array([["hi", "yo"]]), np.ones((1, 2), np.int64))])


def test_cli_check_conforms_float_inputs_from_a_file(tiny_onnx, tmp_path, capsys):
    f = _feeds(B=4, T=7)
    np.savez(tmp_path / "float.npz", **{k: v.astype(np.float32) for k, v in f.items()})
    assert main(["check", str(tiny_onnx["sparse"]), "--inputs", str(tmp_path / "float.npz"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 4
    half = {k: v.astype(np.float32) for k, v in f.items()}
    half["attention_mask"][1, 0] = 0.5
    np.savez(tmp_path / "half.npz", **half)
    assert "attention_mask: float32 values that are not int64 values (e.g. 0.5)" in one_line_error(
        capsys, "check", tiny_onnx["sparse"], "--inputs", tmp_path / "half.npz")


# --- temporary names an interruption cannot strand -----------------------------------------------------------

def _interrupt_after(real):
    """create(path) that creates, then is interrupted (Ctrl-C) before its caller learns of it."""
    def create(path):
        real(path)
        raise KeyboardInterrupt
    return create


@pytest.mark.parametrize("make", ["make_dir", "make_file"])
def test_owned_removes_a_path_interrupted_right_after_its_creation(tmp_path, make):
    from adaptex.graphs import files

    name = files.fresh_name(tmp_path, "x-")
    with pytest.raises(KeyboardInterrupt):
        with files.owned(name, _interrupt_after(getattr(files, make))):
            pytest.fail("the block must not run")
    assert list(tmp_path.iterdir()) == []


def test_owned_leaves_a_name_somebody_else_took(tmp_path):
    from adaptex.graphs import files

    theirs = tmp_path / "taken"
    theirs.mkdir()
    (theirs / "data").write_text("theirs")
    with pytest.raises(FileExistsError):
        with files.owned(theirs, files.make_dir):
            pass
    assert (theirs / "data").read_text() == "theirs"


def test_fresh_names_are_fresh_and_carry_the_prefix(tmp_path):
    from adaptex.graphs import files

    names = {files.fresh_name(tmp_path, ".m.onnx.adaptex-1-", ".tmp") for _ in range(200)}
    assert len(names) == 200 and not any(p.exists() for p in names)
    assert all(p.parent == tmp_path and p.name.startswith(".m.onnx.adaptex-1-") and p.suffix == ".tmp"
               for p in names)


@pytest.mark.parametrize("writer", ["temp_dir", "atomic_directory", "atomic_path"])
def test_writers_interrupted_right_after_creating_their_temp_path_leave_nothing(tmp_path, monkeypatch, writer):
    from adaptex.exporter import metadata
    from adaptex.graphs import files

    out = tmp_path / "out"
    out.mkdir()
    (out / "m.onnx").write_bytes(b"old")
    monkeypatch.setattr(files, "make_dir", _interrupt_after(files.make_dir))
    monkeypatch.setattr(files, "make_file", _interrupt_after(files.make_file))
    block = {"temp_dir": lambda: files.temp_dir("work", parent=out),
             "atomic_directory": lambda: files.atomic_directory(out / "m.mlpackage"),
             "atomic_path": lambda: metadata.atomic_path(out / "m.onnx")}[writer]
    with pytest.raises(KeyboardInterrupt):
        with block():
            pytest.fail("the block must not run")
    assert sorted(p.name for p in out.iterdir()) == ["m.onnx"] and (out / "m.onnx").read_bytes() == b"old"


# --- examples/tsa_generate.py ----------------------------------------------------------------------------------

def _generate(capsys, *argv):
    from examples.tsa_generate import main as generate

    try:
        code = generate([str(a) for a in argv])
    except SystemExit as e:  # argparse's errors exit
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_generate_error(capsys, *argv) -> str:
    code, _, err = _generate(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("tsa_generate: error: "), (code, err)
    return lines[0]


@pytest.mark.parametrize("content, match", [(None, "no such file"), (b"", "not a readable ONNX model"),
                                            (b"\x00\xffgarbage" * 50, "not a readable ONNX model"),
                                            ("dir", "a directory")])
def test_generate_refuses_a_missing_or_garbage_model_in_one_line(tmp_path, capsys, content, match):
    path = tmp_path / "m.onnx"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    line = _one_generate_error(capsys, path, "--prompt", "ab")
    assert match in line and "adaptex export" in line


def test_generate_refuses_a_model_that_is_not_a_decoder(tiny_onnx, capsys):
    line = _one_generate_error(capsys, tiny_onnx["sparse"], "--prompt-ids", "1 2")
    assert "a budgetformer artifact, not a TSA or elastic decoder" in line


@pytest.mark.parametrize("n, match", [("0", "0: must be at least 1"), ("-3", "-3: must be at least 1"),
                                      ("two", "'two' is not a whole number")])
def test_generate_refuses_a_bad_token_count(tiny_tsa_chars, capsys, n, match):
    line = _one_generate_error(capsys, tiny_tsa_chars[1], "--prompt", "ab", "--max-new-tokens", n)
    assert "--max-new-tokens" in line and match in line


def test_generate_names_characters_the_vocabulary_lacks(tiny_tsa_chars, capsys):
    code, out, err = _generate(capsys, tiny_tsa_chars[1], "--prompt", "caf\u00e9 \u65e5!", "--max-new-tokens", "3")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("tsa_generate: warning: ")]
    assert len(warnings) == 1, err
    assert "'\u00e9' (U+00E9), '\u65e5' (U+65E5), '!' (U+0021)" in warnings[0] and "<unk>" in warnings[0]
    assert out.startswith("caf")  # the prompt, then the generated text
    code, _, err = _generate(capsys, tiny_tsa_chars[1], "--prompt", "cafe", "--max-new-tokens", "3")
    assert code == 0 and "warning" not in err  # a prompt inside the vocabulary: no warning


def test_generate_refuses_bad_prompt_ids(tiny_tsa_chars, capsys):
    assert "'x1' is not a token id" in _one_generate_error(capsys, tiny_tsa_chars[1], "--prompt-ids", "3 x1")


def test_generate_unknown_flag_is_one_line(tiny_tsa_chars, capsys):
    line = _one_generate_error(capsys, tiny_tsa_chars[1], "--temperature", "2")
    assert "unrecognized arguments: --temperature 2" in line and "--help" in line


def test_generate_runs_as_a_script_with_one_line_errors(tmp_path):
    """The script itself (not only main()): exit status 2 and one line, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "examples/tsa_generate.py", str(tmp_path / "none.onnx")], cwd=root,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr, r.stderr


# --- the command line's usage errors --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["check", "m.onnx", "--bogus"], "unrecognized arguments: --bogus; see 'adaptex check --help'"),
    (["inspect", "m.onnx", "extra.onnx"], "unrecognized arguments: extra.onnx; see 'adaptex inspect --help'"),
    (["lint", "m.onnx", "--trt", "10", "-z"], "unrecognized arguments: -z; see 'adaptex lint --help'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["export", "--target", "onnx"], "the following arguments are required: -o/--output"),
    (["check", "m.onnx", "--samples", "many"], "argument --samples: invalid whole number: 'many'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_usage_errors_are_one_line_not_the_usage_block(capsys, argv, match):
    line = one_line_error(capsys, *argv)
    assert match in line and "--help" in line


def test_cli_export_refuses_example_ids_outside_the_models_vocabulary(artifacts, tmp_path, capsys):
    """--inputs as a checkpoint's example inputs: an id past its embedding table, a row past its
    positions, or ids that are not whole numbers, is named on one line before any tracing (the CLI
    fuzz found the raw IndexError and RuntimeError)."""
    ckpt = artifacts.checkpoints / "tsa"
    cfg = artifacts.model("tsa").cfg
    ids = np.full((2, 6), cfg.vocab_size, np.int64)
    np.savez(tmp_path / "far.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    out = tmp_path / "out.onnx"
    err = one_line_error(capsys, "export", ckpt, "--target", "onnx", "-o", out, "--inputs", tmp_path / "far.npz")
    assert f"vocabulary has ids 0 to {cfg.vocab_size - 1}" in err and not out.exists()
    long = np.ones((2, cfg.max_len + 1), np.int64)
    np.savez(tmp_path / "long.npz", input_ids=long, attention_mask=long)
    err = one_line_error(capsys, "export", ckpt, "--target", "onnx", "-o", out, "--inputs", tmp_path / "long.npz")
    assert f"takes at most {cfg.max_len}" in err and not out.exists()
    # float ids (the CLI fuzz found PyTorch's raw RuntimeError from the embedding)
    np.savez(tmp_path / "float.npz", input_ids=np.ones((2, 6), np.float32), attention_mask=np.ones((2, 6), np.float32))
    err = one_line_error(capsys, "export", ckpt, "--target", "onnx", "-o", out, "--inputs", tmp_path / "float.npz")
    assert "input_ids is float32" in err and "int64" in err and not out.exists()
