"""Data-parallel training: `adaptex train --nproc 2` (torchrun, DistributedDataParallel over gloo on
the CPU) trains what one process trains from the same global batch, up to the order of float sums
(tolerance 1e-5 on every weight after 12 steps), rank 0 alone writes, a run resumes under another
number of processes, and the checkpoint exports and passes check. Sharded (--fsdp):
test_sharded.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from adaptex.cli import main
from adaptex.graphs import checkpoint
from adaptex.graphs.recipes.session import SUMMARY
from tests.integration.test_train_session import interrupt_after

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

COMMON = ["--steps", "12", "--batch-size", "8", "--d-model", "32", "--heads", "4", "--d-ff", "32",
          "--threads", "1", "--save-dtype", "float32", "--no-baseline", "--quiet"]
# BudgetFormer's score noise and budget hinge of the batch's mean s, TSA's token-mean losses: the
# parts whose global-batch form the processes must share
RUNS = {"budgetformer": ["budgetformer", "--task", "graded", "--layers", "1", "--eval-size", "64", *COMMON],
        "tsa": ["tsa", "--task", "copy", "--layers", "2", "--eval-size", "32", *COMMON]}
TOL = 1e-5


def _max_diff(a, b) -> float:
    wa, wb = load_file(str(a / checkpoint.WEIGHTS)), load_file(str(b / checkpoint.WEIGHTS))
    assert wa.keys() == wb.keys()
    return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)


def _adaptex(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "adaptex", *argv], capture_output=True, text=True, timeout=600)


def _why(r: subprocess.CompletedProcess) -> str:
    """A failed run's own error lines (a rank's traceback or C++ abort), which torchrun's closing
    summary pushes out of the stderr's tail, then that tail."""
    said = [ln for ln in r.stderr.splitlines() if any(w in ln for w in ("Error", "error:", "terminate", "what()",
                                                                       "Exception", "abort"))]
    return "\n".join(said[:40]) + "\n...\n" + r.stderr[-1500:]


@pytest.mark.parametrize("family", list(RUNS))
def test_two_processes_train_what_one_trains_and_rank0_alone_writes(tmp_path, family):
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *RUNS[family], "-o", str(one)]) == 0
    r = _adaptex("train", *RUNS[family], "-o", str(two), "--nproc", "2")
    assert r.returncode == 0, _why(r)
    assert _max_diff(one, two) < TOL
    a, b = (json.loads((p / SUMMARY).read_text()) for p in (one, two))
    assert b["processes"] == 2 and "processes" not in a
    for phase, metrics in a["metrics"].items():
        for k, v in (metrics or {}).items():
            assert b["metrics"][phase][k] == pytest.approx(v, abs=1e-4), (phase, k)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # nothing else written
    if family == "tsa":  # what two processes wrote exports and passes check
        art = tmp_path / "tsa.onnx"
        assert main(["export", str(two), "--target", "onnx", "-o", str(art)]) == 0
        assert main(["check", str(art), "--samples", "8"]) == 0


@pytest.mark.slow
def test_a_run_resumes_under_another_number_of_processes(tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = RUNS["tsa"]
    assert main(["train", *args, "-o", str(straight)]) == 0
    with monkeypatch.context() as m:
        interrupt_after(m, 1)
        assert main(["train", *args, "-o", str(resumed), "--save-every", "6"]) == 130
    r = _adaptex("train", *args, "-o", str(resumed), "--save-every", "6", "--resume", "--nproc", "2")
    assert r.returncode == 0, _why(r)
    assert _max_diff(straight, resumed) < TOL
    assert not (resumed / "training_state").exists()


def test_a_global_batch_that_does_not_split_is_refused_in_one_line(tmp_path):
    args = [a if a != "8" else "7" for a in RUNS["tsa"]]
    r = _adaptex("train", *args, "-o", str(tmp_path / "x"), "--nproc", "2")
    assert r.returncode != 0
    assert "--batch-size 7 does not split over 2 processes" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("layout", [pytest.param("roberta", marks=pytest.mark.slow), "gpt2"])
def test_elastic_routers_train_in_two_processes_as_in_one(tmp_path, layout):
    elastic_in_two_processes(tmp_path, layout)


def elastic_in_two_processes(tmp_path, layout: str, sharding: tuple[str, ...] = ()) -> None:
    """Elastic's Gumbel samples (drawn for the global batch and sliced), its cosine or KL and its SA
    fraction (global-batch means, which move the Lagrangian's lambdas alike in every process): an
    encoder's routers and a decoder's, on Hugging Face backbones of the tests; with --fsdp the frozen
    backbone is sharded too."""
    from tests.support import hf_dirs

    backbone = hf_dirs.make(layout, tmp_path / "hf")
    corpus = hf_dirs.corpus(tmp_path / "corpus.txt")
    args = ["elastic", "--backbone", str(backbone), "--data", str(corpus), "--steps", "6", "--batch-size", "4",
            "--max-tokens", "40", "--window", "8", "--sink", "2", "--eval-size", "16", "--threads", "1",
            "--save-dtype", "float32", "--quiet"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *args, "-o", str(one)]) == 0
    r = _adaptex("train", *args, "-o", str(two), "--nproc", "2", *sharding)
    assert r.returncode == 0, _why(r)
    assert _max_diff(one, two) < TOL
    a, b = (json.loads((p / SUMMARY).read_text()) for p in (one, two))
    assert b["processes"] == 2 and b["options"].get("fsdp") is (True if sharding else None)
    for phase, metrics in a["metrics"].items():
        for k, v in (metrics or {}).items():
            assert b["metrics"][phase][k] == pytest.approx(v, abs=1e-4), (phase, k)
    assert torch.distributed.is_available()

