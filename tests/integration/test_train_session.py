"""Training a user can leave running: periodic checkpoints, --resume bit for bit, the summary JSON,
-o's parents, --seed, --json and --quiet (graphs/recipes/session.py, adaptex/cli/train.py)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from adaptex.cli import main
from adaptex.graphs import checkpoint
from adaptex.graphs.recipes.session import SUMMARY, Session

TINY_BF = ["budgetformer", "--task", "graded", "--steps", "8", "--batch-size", "8", "--d-model", "32", "--heads", "4",
           "--layers", "1", "--d-ff", "32", "--eval-size", "64", "--threads", "1", "--save-dtype", "float32"]
TINY_TSA = ["tsa", "--task", "copy", "--steps", "8", "--batch-size", "8", "--d-model", "32", "--heads", "4",
            "--layers", "2", "--d-ff", "32", "--eval-size", "32", "--threads", "1", "--save-dtype", "float32"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def weights(path):
    return load_file(str(path / checkpoint.WEIGHTS))


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return all(torch.equal(wa[k], wb[k]) for k in wa)


def interrupt_after(monkeypatch, saves: int):
    """Make the `saves`-th periodic save the last thing the run does (as a Ctrl-C right after it)."""
    orig, count = Session.save_state, {"n": 0}

    def save_then_stop(self, *a, **kw):
        orig(self, *a, **kw)
        count["n"] += 1
        if count["n"] == saves:
            raise KeyboardInterrupt
    monkeypatch.setattr(Session, "save_state", save_then_stop)


@pytest.mark.parametrize("args, saves", [(TINY_BF, 1), (TINY_BF, 2), (TINY_TSA, 1), (TINY_TSA, 2)],
                         ids=["budgetformer-first-phase", "budgetformer-baseline-phase", "tsa-first-phase",
                              "tsa-baseline-phase"])
def test_resume_continues_bit_for_bit(tmp_path, capsys, monkeypatch, args, saves):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", *args, "-o", str(straight)]) == 0
    with monkeypatch.context() as m:
        interrupt_after(m, saves)
        assert main(["train", *args, "-o", str(resumed), "--save-every", "4"]) == 130
    # what the interrupted run left: a loadable checkpoint and the state to resume from
    partial = json.loads((resumed / SUMMARY).read_text())
    assert partial["status"] == "in progress" and partial["step"] == 4
    checkpoint.load(resumed)
    assert (resumed / "training_state").is_dir()
    assert main(["train", *args, "-o", str(resumed), "--save-every", "4", "--resume"]) == 0
    assert same_weights(straight, resumed)
    a, b = (json.loads((p / SUMMARY).read_text()) for p in (straight, resumed))
    assert a["metrics"] == b["metrics"] and b["status"] == "complete"
    assert not (resumed / "training_state").exists()  # a finished run keeps only the checkpoint


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys, monkeypatch):
    out = tmp_path / "x"
    assert main(["train", *TINY_BF, "-o", str(out), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    with monkeypatch.context() as m:
        interrupt_after(m, 1)
        assert main(["train", *TINY_BF, "-o", str(out), "--save-every", "4"]) == 130
    capsys.readouterr()
    changed = [a if a != "8" else "9" for a in TINY_BF]  # --steps 9, --batch-size 9
    assert main(["train", *changed, "-o", str(out), "--save-every", "4", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--batch-size 9 differs from the interrupted run's 8" in err and err.count("\n") == 1
    assert main(["train", *TINY_BF, "-o", str(out), "--save-every", "4", "--resume", "--threads", "2"]) == 2
    assert "pass --threads 1" in capsys.readouterr().err


def test_seed_reproduces_and_is_recorded(tmp_path, capsys):
    runs = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        runs[name] = tmp_path / "deep" / "er" / name  # -o creates the parents
        assert main(["train", *TINY_BF, "--seed", seed, "--no-baseline", "-o", str(runs[name])]) == 0
    assert same_weights(runs["a"], runs["b"]) and not same_weights(runs["a"], runs["c"])
    summary = json.loads((runs["a"] / SUMMARY).read_text())
    for key, want in (("seed", 3), ("threads", 1), ("torch", torch.__version__)):
        assert summary[key] == want
    assert summary["adaptex"] and summary["config"]["d_model"] == 32 and summary["data"] == {"task": "graded"}
    assert summary["metrics"]["budgetformer"]["accuracy"] >= 0 and summary["options"]["steps"] == 8
    _, info = checkpoint.load(runs["a"])
    assert {k: info["training"][k] for k in ("seed", "threads", "torch")} == {"seed": 3, "threads": 1,
                                                                             "torch": torch.__version__}


def test_data_hash_in_the_summary(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(300)))
    out = tmp_path / "t"
    assert main(["train", "tsa", "--data", str(corpus), "--steps", "2", "--batch-size", "2", "--d-model", "16",
                 "--heads", "2", "--layers", "2", "--d-ff", "16", "--max-tokens", "16", "--eval-size", "4",
                 "--no-baseline", "--threads", "1", "-o", str(out)]) == 0
    import hashlib

    summary = json.loads((out / SUMMARY).read_text())
    assert summary["data"]["data"]["sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()


def test_json_and_quiet(tmp_path, capsys):
    assert main(["train", *TINY_BF, "--no-baseline", "--json", "-o", str(tmp_path / "j")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["status"] == "complete" and err == ""
    assert main(["train", *TINY_BF, "--no-baseline", "--quiet", "-o", str(tmp_path / "q")]) == 0
    out, err = capsys.readouterr()
    assert "heads used" in out and err == ""
    assert main(["train", *TINY_BF, "--no-baseline", "-o", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err
    assert "budgetformer: 100%" in err and "8/8" in err  # tqdm's bar reached the end
