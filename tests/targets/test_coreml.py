"""Core ML target: packages converted on Linux and checked by MIL reference evaluation of the saved
program (the Core ML runtime itself needs macOS)."""
import json

import pytest

from tests.support import zoo

from adaptex.cli import main
from adaptex.exporter.targets import coreml as target
from adaptex.graphs import checkpoint
from adaptex.runtimes.coreml_mil import MilReferenceRunner
from adaptex.runtimes.parity import check
from adaptex.runtimes.torch_ref import TorchRunner


@pytest.fixture(scope="module")
def packages(artifacts):
    """The tiny checkpoint's fp32 packages, {variant: path} (shared with the session)."""
    return {variant: artifacts("bf", "coreml", variant, "fp32") for variant in ("sparse", "dense")}


def _ops(path):
    fn = MilReferenceRunner(path).program.functions["main"]
    return list(fn.operations)


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_package_passes_parity_by_mil_reference_evaluation(packages, tiny_checkpoint, variant):
    model, _ = checkpoint.load(tiny_checkpoint)
    runner = MilReferenceRunner(packages[variant])
    report = check(runner, TorchRunner(model), samples=60, task="graded")
    assert report.passed, report.format()
    assert report.max_abs_err <= 1e-4 and report.unexcused_flips == 0 and report.decisions_vary
    assert "not the Core ML runtime" in report.note and "MIL reference" in report.runtime


@pytest.mark.parametrize("history", ["fresh", "after other programs"])
def test_fp16_package_keeps_routing_in_fp32(tiny_checkpoint, tmp_path, monkeypatch, history):
    """"after other programs": coremltools numbers generated op names per process; a process that built
    other MIL programs first (the MIL evaluator's tests did) once got a head Linear named past the
    one the fp16 op selector keeps, and an fp16 head."""
    from collections import defaultdict

    from coremltools.converters.mil.mil import Builder, types

    if history != "fresh":
        before = defaultdict(int, {"linear": 3, "gelu": 2, "layer_norm": 5, "reduce_max": 1, "sigmoid": 4})
        monkeypatch.setattr(Builder, "name_count", before)
    model, info = checkpoint.load(tiny_checkpoint)
    path = tmp_path / "m16.mlpackage"
    meta = zoo.export(model, info, path, "coreml", precision="fp16")  # audited: passes for this model
    if history != "fresh":  # the process's own count goes on where it was
        assert Builder.name_count == {"linear": 3, "gelu": 2, "layer_norm": 5, "reduce_max": 1, "sigmoid": 4}
    assert meta["precision"] == "fp16" and meta["routing_precision"] == "fp32"
    ops = _ops(path)
    dtype = {op.name: types.builtin_to_string(op.outputs[0].dtype) for op in ops}
    routing = [op for op in ops if op.name.startswith("route_") and op.op_type in ("floor", "clip", "mul")]
    assert routing and all(dtype[op.name] == "fp32" for op in routing)
    assert {dtype[op.name] for op in ops if op.op_type == "sigmoid"} == {"fp32"}  # the budget networks
    assert "fp16" in {dtype[op.name] for op in ops if op.op_type == "linear"}  # while the body is fp16
    # the classifier tail (final norm, max-pool, head MLP) is fp32: the last ops before the outputs
    tail = [op for op in ops if op.op_type in ("layer_norm", "reduce_max", "linear", "gelu")][-5:]
    assert [op.op_type for op in tail] == ["layer_norm", "reduce_max", "linear", "gelu", "linear"]
    assert {dtype[op.name] for op in tail} == {"fp32"} and meta["head_precision"] == "fp32", [
        (op.name, [v.name for v in op.outputs], dtype[op.name]) for op in tail]
    # every float output is fp32 in the saved interface: an fp16 output would round s and the logits
    import coremltools as ct

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    out_types = {o.name: o.type.multiArrayType.dataType for o in spec.description.output}
    fp32 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT32
    assert out_types["logits"] == fp32 and out_types["decisions_layer0_s"] == fp32
    report = check(MilReferenceRunner(path), TorchRunner(model), samples=60, task="graded", precision="fp16")
    assert report.passed, report.format()
    assert report.unexcused_flips == 0 and report.tolerance == {"atol": 1e-2, "rtol": 1e-2}


def test_sparse_program_has_a_runtime_k(packages):
    ops = _ops(packages["sparse"])
    types = [op.op_type for op in ops]
    assert "argsort" in types and "topk" not in types
    # the head slice's end is computed at run time (the batch's largest k), not a constant
    runtime_ends = [op for op in ops if op.op_type == "slice_by_index" and op.inputs["end"].val is None]
    assert runtime_ends


def _data_dependent(var, seen=None) -> bool:
    """True if a shape-like value is computed from tensor *values* (not just from shapes)."""
    op = var.op
    if op is None or op.op_type in ("const", "shape"):
        return False
    if op.op_type not in ("concat", "slice_by_index", "cast", "squeeze", "expand_dims", "gather", "add", "mul"):
        return True
    return any(_data_dependent(v) for k, v in op.inputs.items()
               for v in (v if isinstance(v, (list, tuple)) else [v]) if k not in ("axis",))


def test_dense_program_has_only_static_shapes(packages):
    """Every shape in the dense program follows from the input shapes alone: no size is computed
    from the data (the sparse program's head count is, which is its point)."""
    def dynamic_sizes(path):
        bad = []
        for op in _ops(path):
            for key in {"slice_by_index": ("begin", "end"), "reshape": ("shape",), "range_1d": ("end",),
                        "tile": ("reps",), "fill": ("shape",)}.get(op.op_type, ()):
                var = op.inputs.get(key)
                if var is not None and var.val is None and _data_dependent(var):
                    bad.append(f"{op.op_type} {op.name}.{key}")
        return bad

    assert dynamic_sizes(packages["dense"]) == []
    assert dynamic_sizes(packages["sparse"])  # the check can see a runtime k


def test_metadata_and_cli(packages, tiny_checkpoint, tmp_path, capsys):
    meta = MilReferenceRunner(packages["sparse"]).meta
    assert meta["target"] == "coreml" and meta["variant"] == "sparse" and meta["precision"] == "fp32"
    out = tmp_path / "m.mlpackage"
    assert main(["export", str(tiny_checkpoint), "--target", "coreml", "-o", str(out)]) == 0
    assert main(["check", str(out), "--samples", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    assert main(["inspect", str(out)]) == 0
    assert "target: coreml" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [
    (["--precision", "fp8"], "precision 'fp8' is not supported for the coreml target; use fp16 or fp32"),
    (["--min-target", "iOS9"], "unknown --min-target 'iOS9'; choose one of iOS16"),
    (["-o", "m.onnx"], "must end in .mlpackage"),
])
def test_bad_coreml_export(tiny_checkpoint, tmp_path, capsys, argv, match, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["export", str(tiny_checkpoint), "--target", "coreml", "-o", "m.mlpackage"]
    args = args[:-2] + argv if argv[0] == "-o" else args + argv
    assert main(args) == 2
    assert match in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bench_refuses_coreml_on_linux(packages, capsys):
    assert main(["bench", str(packages["sparse"]), "--seq", "32"]) == 2  # within the tiny model's 64 positions
    assert "needs the Core ML runtime (macOS)" in capsys.readouterr().err


def test_check_refuses_a_package_not_made_by_adaptex(packages, tmp_path, capsys):
    import shutil

    import coremltools as ct

    other = tmp_path / "other.mlpackage"
    shutil.copytree(packages["dense"], other)
    m = ct.models.MLModel(str(other), skip_model_load=True)
    del m.user_defined_metadata["adaptex"]
    m.save(str(tmp_path / "stripped.mlpackage"))
    assert main(["check", str(tmp_path / "stripped.mlpackage")]) == 2
    assert "has no adaptex metadata" in capsys.readouterr().err


def test_package_metadata_seen_in_xcode(packages):
    import coremltools as ct

    m = ct.models.MLModel(str(packages["sparse"]), skip_model_load=True)
    ud = m.user_defined_metadata
    for key in ("adaptex.family", "adaptex.config", "adaptex.opset", "adaptex.variant", "adaptex.precision",
                "adaptex.budget_range", "adaptex.source", "adaptex.adaptex"):
        assert ud[key], key
    assert json.loads(ud["adaptex.budget_range"]) == [0.25, 0.375]
    assert len(json.loads(ud["adaptex.source"])["sha256"]) == 64
    assert "fp32 routing" in m.short_description
    spec = m.get_spec()
    assert all(i.shortDescription for i in spec.description.input)
    assert all(o.shortDescription for o in spec.description.output)
    # flexible shapes: the sequence axis is a range bounded by the model's maximum
    rng = spec.description.input[0].type.multiArrayType.shapeRange.sizeRanges[1]
    assert (rng.lowerBound, rng.upperBound) == (1, 64)


def test_sequence_above_the_exported_bound_is_refused(packages):
    import numpy as np

    from adaptex.graphs.errors import InputError

    feeds = {n: np.ones((1, 65), dtype=np.int32) for n in ("input_ids", "attention_mask")}
    with pytest.raises(InputError, match="sequence length 65 exceeds the model's maximum 64"):
        MilReferenceRunner(packages["sparse"]).infer(feeds)


@pytest.mark.coreml_runtime
@pytest.mark.parametrize("units", ["cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"])
def test_core_ml_runtime_parity(packages, tiny_checkpoint, units):
    """On macOS: the package run by Core ML itself, per compute-unit choice (skipped elsewhere)."""
    from adaptex.runtimes.coreml import CoreMLRunner

    model, _ = checkpoint.load(tiny_checkpoint)
    report = check(CoreMLRunner(packages["sparse"], units), TorchRunner(model), samples=40, task="graded")
    assert report.passed, report.format()


def test_compute_units_off_macos_is_a_clear_error(packages, capsys):
    import platform

    if platform.system() == "Darwin":
        pytest.skip("on macOS --compute-units selects the Core ML runtime")
    assert main(["check", str(packages["sparse"]), "--compute-units", "cpu_only"]) == 2
    assert "needs the Core ML runtime (macOS)" in capsys.readouterr().err


def test_bench_counterparts_convert_on_linux_and_compute_the_dense_model(tiny_checkpoint, tmp_path):
    """`adaptex bench` times a package against stock coremltools' conversions of the same weights:
    the dense package must compute the model's dense path, the naive one its masked hard path."""
    import numpy as np
    import torch

    from adaptex.exporter.counterparts import coreml_counterparts
    from adaptex.graphs.family import family_contract
    from adaptex.runtimes.coreml_mil import load_program, run

    model, _ = checkpoint.load(tiny_checkpoint)
    got = coreml_counterparts(model, family_contract(model), tmp_path, "fp32", "iOS17")
    ids = np.random.default_rng(0).integers(1, model.cfg.vocab_size, size=(3, 20)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[2, 12:] = 0
    for name, mode in (("dense", "dense"), ("naive", "hard")):
        _, program = load_program(__import__("pathlib").Path(got[name][0]))
        out = run(program, {"input_ids": ids, "attention_mask": mask})
        with torch.no_grad():
            ref, _ = model(torch.from_numpy(ids).long(), torch.from_numpy(mask).long(), mode=mode)
        assert np.abs(out["logits"] - ref.numpy()).max() < 1e-4, name


@pytest.mark.slow
def test_bench_coreml_path_with_the_mil_evaluator_standing_in(packages, tiny_checkpoint, monkeypatch):
    """The macOS bench path run end to end with the MIL evaluator in place of MLModel.predict: this
    proves the plumbing (counterparts, interleaved timing, decisions, report), not any latency."""
    from pathlib import Path

    from adaptex.runtimes import coreml
    from adaptex.runtimes.bench import run_bench
    from adaptex.runtimes.bench_report import format_bench
    from adaptex.runtimes.coreml_mil import load_program, run

    def predictor(path, units):
        _, program = load_program(Path(path))
        return lambda feeds: run(program, {k: v.astype("int32") for k, v in feeds.items()})

    monkeypatch.setattr(coreml, "available", lambda: True)
    monkeypatch.setattr(coreml, "CoreMLRunner", lambda path, units: MilReferenceRunner(path))
    monkeypatch.setattr(coreml, "load_predictor", predictor)
    model, info = checkpoint.load(tiny_checkpoint)
    r = run_bench(packages["sparse"], model, info, batch=2, seq=16, warmup=1, runs=3, compute_units="cpu_only")
    assert r["runtime"].startswith("Core ML runtime (cpu_only)")
    assert r["runs"] == 3 and r["dense_p50_ms"] > 0 and r["naive_p50_ms"] > 0
    assert 0 < r["flop_ratio"] <= 1 and r["size_mb"]["adaptive"] > 0 and r["size_mb"]["dense"] > 0
    assert "latency ratio" in format_bench(r)


def test_compute_units_for_an_onnx_bench_is_a_clear_error(tiny_onnx, capsys):
    assert main(["bench", str(tiny_onnx["sparse"]), "--seq", "32", "--compute-units", "cpu_only"]) == 2
    assert "--compute-units applies to Core ML packages" in capsys.readouterr().err


@pytest.mark.coreml_runtime
def test_core_ml_bench_on_macos(packages, capsys):
    """On macOS: `adaptex bench` on a package prints the adaptive package against the dense one."""
    assert main(["bench", str(packages["sparse"]), "--runs", "5", "--warmup", "1", "--compute-units", "cpu_only"]) == 0
    out = capsys.readouterr().out
    assert "Core ML runtime (cpu_only)" in out and "latency ratio" in out


def test_the_mil_evaluator_drops_each_value_at_its_last_reader(packages):
    """The evaluator frees what no later op reads (a decoder's long batch held every layer's scores: over
    20 GB, killed, for charlm-dense's package at 200 samples), never a value still to be read or an output."""
    import numpy as np

    from adaptex.runtimes.coreml_mil import _last_uses, load_program, run

    _, program = load_program(packages["sparse"])
    fn = program.functions["main"]
    ops, outputs = list(fn.operations), {v.name for v in fn.outputs}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for v in op.inputs.values():
            for u in v if isinstance(v, (list, tuple)) else (v,):
                readers.setdefault(u.name, []).append(i)
    dropped = {name: i for i, names in _last_uses(fn).items() for name in names}
    made = {var.name: i for i, op in enumerate(ops) for var in op.outputs}
    assert not outputs & set(dropped) and len(dropped) == sum(len(n) for n in _last_uses(fn).values())
    for name in (set(made) | set(readers)) - outputs:  # every other value goes, at its last reader or where made
        assert dropped[name] == max(readers.get(name, [made.get(name, -1)])), name
    ids = np.random.default_rng(0).integers(1, 60, size=(4, 24)).astype(np.int32)
    out = run(program, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert set(out) == outputs and all(np.isfinite(v).all() for v in out.values() if v.dtype.kind == "f")
