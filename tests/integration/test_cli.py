"""The CLI end to end on a tiny model: export, inspect, check, bench, models."""
import json
import subprocess
import sys

import onnx
import pytest

from adaptex.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_export_inspect_check_bench(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "runs" / "new" / "m.onnx"  # -o creates its parent directories, like mkdir -p
    code, _, err = run(capsys, "export", tiny_checkpoint, "--target", "onnx", "-o", out)
    assert code == 0, err
    (tmp_path / "file").write_text("")
    code, _, err = run(capsys, "export", tiny_checkpoint, "--target", "onnx", "-o", tmp_path / "file" / "m.onnx")
    assert code == 2 and "is not a directory" in err
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)

    code, text, _ = run(capsys, "inspect", out)
    assert code == 0 and "variant: sparse" in text and "decisions.layer0.k" in text

    code, text, _ = run(capsys, "check", out, "--samples", "60", "--json")
    report = json.loads(text)
    assert code == 0 and report["passed"] is True
    for key in ("samples", "max_abs_err", "decision_agreement", "unexcused_flips"):
        assert key in report
    assert report["samples"] == 60 and report["unexcused_flips"] == 0 and report["max_abs_err"] <= 1e-4

    code, text, err = run(capsys, "bench", out, "--seq", "32", "--runs", "5", "--warmup", "1", "--json")
    assert code == 0, err
    r = json.loads(text)
    for key in ("p50_ms", "p90_ms", "p99_ms", "dense_p50_ms", "naive_p50_ms", "flop_ratio", "latency_ratio",
                "realisation", "throughput_seq_per_s", "threads", "peak_rss_mb", "size_mb"):
        assert key in r
    assert r["runs"] == 5 and r["p50_ms"] > 0 and r["dense_p50_ms"] > 0
    assert r["naive_p50_ms"] > 0 and r["naive_reason"] is None  # the stock export of BudgetFormer works (README)
    assert r["peak_rss_mb"]["adaptive"] and r["peak_rss_mb"]["dense"]
    # the figures by value: the FLOP ratios of the decisions the artifact takes on the bench's own input,
    # and the latency ratio and realisation from the timings (docs/benchmarking.md defines them)
    from adaptex.graphs import checkpoint
    from adaptex.graphs.family import family_contract
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner

    contract = family_contract(checkpoint.load(tiny_checkpoint)[0])
    decided = OnnxRuntimeRunner(out).infer(contract.bench_feeds("graded", 1, 32))
    flops = contract.flops(decided, "sparse", 32)
    assert r["flop_ratio"] == pytest.approx(flops["flop_ratio"]) and r["flop_ratio"] < 0.99
    assert r["executed_flop_ratio"] == pytest.approx(flops["executed_flop_ratio"])
    assert r["latency_ratio"] == pytest.approx(r["p50_ms"] / r["dense_p50_ms"])
    assert r["realisation"] == pytest.approx((1 - r["latency_ratio"]) / (1 - r["flop_ratio"]))
    assert r["throughput_seq_per_s"] == pytest.approx(1000 / r["p50_ms"])
    assert r["naive_latency_ratio"] == pytest.approx(r["naive_p50_ms"] / r["dense_p50_ms"])


def test_bench_prints_a_table(tiny_onnx, capsys):
    code, text, _ = run(capsys, "bench", tiny_onnx["dense"], "--seq", "16", "--runs", "3", "--warmup", "1")
    assert code == 0
    assert "p50 ms" in text and "dense" in text and "realisation" in text and "(dense)" in text


def test_check_text_report(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    run(capsys, "export", tiny_checkpoint, "--target", "onnx", "-o", out)
    code, text, _ = run(capsys, "check", out, "--samples", "20")
    assert code == 0 and "PASSED" in text and "atol=0.0001" in text


def test_models_lists_the_default(capsys):
    code, text, _ = run(capsys, "models")
    assert code == 0 and "budgetformer-graded" in text and "(default)" in text


def test_console_script_is_installed():
    r = subprocess.run([sys.executable, "-m", "adaptex", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "export" in r.stdout and "bench" in r.stdout


@pytest.mark.parametrize("task", ["graded", "stdlib"])
def test_train_writes_a_loadable_checkpoint_and_a_summary(tmp_path, capsys, task):
    out = tmp_path / "ck"
    code, text, err = run(capsys, "train", "budgetformer", "--task", task, "-o", out, "--steps", "6",
                          "--batch-size", "8", "--d-model", "32", "--heads", "4", "--layers", "1",
                          "--d-ff", "32", "--eval-size", "64")
    assert code == 0, err
    assert "heads used" in text and "standard Transformer, same size" in text and "mean s" in text
    assert "budgetformer: 100%" in err and "baseline: 100%" in err and "6/6" in err  # progress for both runs
    from adaptex.graphs import checkpoint

    model, info = checkpoint.load(out)
    assert info["training"]["task"] == task and "baseline" in info["evaluation"]
    assert info["weights_dtype"] == "float16"


def test_train_rejects_unknown_family_and_task(tmp_path, capsys):
    assert run(capsys, "train", "gpt", "-o", tmp_path / "x")[0] == 2
    code, _, err = run(capsys, "train", "budgetformer", "--task", "nope", "-o", tmp_path / "x")
    assert code == 2 and "unknown task 'nope'" in err and not (tmp_path / "x").exists()
