"""Reproduce the shipped model's training run (about 20 minutes on 2 cores: `make test-slow`)."""
import json

import pytest

from adaptex.cli import main
from adaptex.graphs import checkpoint


@pytest.mark.slow
def test_default_training_reproduces_the_shipped_summary(tmp_path, capsys):
    out = tmp_path / "bf"
    assert main(["train", "budgetformer", "--task", "graded", "-o", str(out)]) == 0
    capsys.readouterr()
    ours = json.loads((out / checkpoint.CONFIG).read_text())["evaluation"]
    shipped = json.loads((checkpoint.resolve(None) / checkpoint.CONFIG).read_text())["evaluation"]
    for model in ("budgetformer", "baseline"):
        assert abs(ours[model]["accuracy"] - shipped[model]["accuracy"]) < 0.01
    assert abs(ours["budgetformer"]["heads_fraction"] - shipped["budgetformer"]["heads_fraction"]) < 0.02
