"""Sharded data-parallel training: `adaptex train --nproc 2 --fsdp` (FSDP over gloo on the CPU) trains
what one process trains from the same global batch (tolerance 1e-5 on every weight), gathers the
weights whole for the checkpoint, which exports and passes check, and resumes sharded."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaptex.cli import main
from adaptex.graphs.recipes.session import SUMMARY
from tests.integration.test_distributed import RUNS, TOL, _adaptex, _max_diff, _why
from tests.integration.test_distributed import elastic_in_two_processes

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.mark.parametrize("family", ["tsa", pytest.param("budgetformer", marks=pytest.mark.slow)])
def test_sharded_processes_train_what_one_trains(tmp_path, family):
    """--fsdp: each process holds half of every parameter, gradient and optimiser state; the weights
    are gathered whole for the checkpoint, which exports and passes check."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *RUNS[family], "-o", str(one)]) == 0
    r = _adaptex("train", *RUNS[family], "-o", str(two), "--nproc", "2", "--fsdp")
    assert r.returncode == 0, _why(r)
    assert _max_diff(one, two) < TOL
    a, b = (json.loads((p / SUMMARY).read_text()) for p in (one, two))
    assert b["processes"] == 2 and b["options"]["fsdp"] is True
    for phase, metrics in a["metrics"].items():
        for k, v in (metrics or {}).items():
            assert b["metrics"][phase][k] == pytest.approx(v, abs=1e-4), (phase, k)
    art = tmp_path / "m.onnx"
    assert main(["export", str(two), "--target", "onnx", "-o", str(art)]) == 0
    assert main(["check", str(art), "--samples", "8"]) == 0


@pytest.mark.slow  # as its DDP counterpart (test_distributed.py)
def test_a_sharded_run_resumes_sharded(tmp_path):
    """The interrupted run's weights and optimiser state, gathered whole from the shards, load back
    into the shards of the resumed run: it ends where an uninterrupted run ends."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [*RUNS["tsa"], "--save-every", "6"]
    assert main(["train", *args, "-o", str(straight)]) == 0
    stop = Path(__file__).resolve().parents[1] / "support" / "stop_after_save.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(stop), "train", *args, "-o", str(resumed), "--fsdp"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and (resumed / "training_state").is_dir(), r.stderr[-2000:]
    assert json.loads((resumed / SUMMARY).read_text())["step"] == 6
    r = _adaptex("train", *args, "-o", str(resumed), "--resume")  # unsharded: refused, naming the flag
    assert r.returncode == 2 and "--fsdp" in r.stderr, r.stderr[-2000:]
    r = _adaptex("train", *args, "-o", str(resumed), "--resume", "--nproc", "2", "--fsdp")
    assert r.returncode == 0, _why(r)
    assert _max_diff(straight, resumed) < TOL
    assert not (resumed / "training_state").exists()


def test_fsdp_without_processes_is_refused_in_one_line(tmp_path):
    r = _adaptex("train", *RUNS["tsa"], "-o", str(tmp_path / "x"), "--fsdp")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("adaptex: error: --fsdp shards the model")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["roberta", "gpt2"])
def test_elastic_routers_train_sharded_as_in_one_process(tmp_path, layout):
    """The frozen backbone sharded too; for the GPT-2 decoder, whose blocks adaptex calls layer by
    layer, each of a block's layers is a unit of its own."""
    elastic_in_two_processes(tmp_path, layout, ("--fsdp",))
