"""Losses, schedules, tasks, training and checkpoints."""
import json

import numpy as np
import pytest
import torch

from adaptex.graphs import checkpoint, losses
from adaptex.graphs.budgetformer import BudgetFormerConfig, RoutingSchedule
from adaptex.graphs.tasks import GradedCues, StdlibSource, get_task
from adaptex.graphs.recipes.budgetformer import TrainConfig, evaluate, train_model
from tests.support import zoo


def test_budget_hinge_is_zero_inside_and_quadratic_outside():
    s = torch.tensor([0.1, 0.25, 0.4, 0.5, 0.7])
    out = losses.budget_hinge(s, 0.25, 0.5)
    assert torch.allclose(out, torch.tensor([0.15 ** 2, 0.0, 0.0, 0.0, 0.2 ** 2]))


def test_entropy_schedule_turns_from_exploration_to_specialisation():
    betas = [losses.entropy_beta(t, -0.02, 0.02) for t in np.linspace(0, 1, 11)]
    assert betas[0] == -0.02 and betas[-1] == 0.02
    assert all(b < 0 for b in betas[:5]) and all(b > 0 for b in betas[6:])
    assert all(a <= b for a, b in zip(betas, betas[1:]))


def test_temperature_falls_geometrically():
    taus = [losses.geometric(t, 2.0, 0.5) for t in (0.0, 0.5, 1.0)]
    assert taus[0] == 2.0 and abs(taus[1] - 1.0) < 1e-9 and abs(taus[2] - 0.5) < 1e-9


def test_entropy_is_maximal_for_uniform():
    u, peaked = torch.full((1, 4), 0.25), torch.tensor([[0.97, 0.01, 0.01, 0.01]])
    assert losses.head_entropy(u) > losses.head_entropy(peaked)
    assert torch.allclose(losses.head_entropy(u), torch.log(torch.tensor([4.0])))


def test_graded_task_levels_and_labels():
    task = GradedCues()
    rng = np.random.default_rng(0)
    b = task.sample(400, rng)
    assert set(b.difficulty.tolist()) == {0, 1, 2, 3}
    assert b.labels.min() >= 0 and b.labels.max() < task.num_classes
    ids, mask = b.input_ids, b.attention_mask
    for i in range(50):
        seq = ids[i][mask[i] == 1].tolist()
        lv, y = int(b.difficulty[i]), int(b.labels[i])
        vals_after = lambda m: [seq[j + 1] - task.VALUE0 for j in range(len(seq) - 1) if seq[j] == m]
        if lv == 0:
            assert [t - task.VALUE0 for t in seq if task.VALUE0 <= t < task.filler0] == [y]
        elif lv == 1:
            assert vals_after(task.MARK_A) == [y]
        elif lv == 2:
            assert sum(vals_after(task.MARK_A)) % task.num_classes == y
        else:
            (a,), (bb,) = vals_after(task.MARK_A), vals_after(task.MARK_B)
            assert (a - bb) % task.num_classes == y


def test_stdlib_task_reads_the_local_standard_library():
    task = StdlibSource()
    b = task.sample(12, np.random.default_rng(0), levels=[0, 1, 2] * 4)
    lengths = b.attention_mask.sum(-1).tolist()
    assert lengths == [96, 48, 24] * 4
    assert b.input_ids.max() < task.vocab_size


def test_unknown_task_is_a_clear_error():
    from adaptex.graphs.errors import AdaptexError

    with pytest.raises(AdaptexError, match="unknown task 'nope'; choose one of graded, stdlib"):
        get_task("nope")


def test_short_training_runs_and_reports(capsys):
    task = GradedCues()
    cfg = BudgetFormerConfig(**{**zoo.TINY, "num_layers": 1})
    model = train_model(cfg, task, TrainConfig(steps=12, batch_size=16, warmup=2))
    r = evaluate(model, task, 64)
    assert 0 <= r["accuracy"] <= 1 and 0 < r["heads_fraction"] <= 1 and 0 < r["flop_ratio"] <= 1.01
    assert set(r["s_by_level"]) == {0, 1, 2, 3}
    err = capsys.readouterr().err
    assert "train: 100%" in err and "12/12" in err  # progress reached the end


def test_soft_mode_computes_every_head_and_noise_changes_routing():
    model = zoo.tiny_model().train()
    ids, mask = torch.randint(1, 64, (3, 10)), torch.ones(3, 10, dtype=torch.int64)
    torch.manual_seed(0)
    _, d1 = model(ids, mask, mode="soft", sched=RoutingSchedule(tau=1.0, noise_std=1.0))
    _, d2 = model(ids, mask, mode="soft", sched=RoutingSchedule(tau=1.0, noise_std=1.0))
    assert not torch.allclose(d1[0]["p"], d2[0]["p"])
    assert set(d1[0]) == {"s", "p"}  # no hard decisions in training mode


def test_checkpoint_round_trip(tmp_path):
    model = zoo.tiny_model()
    checkpoint.save(tmp_path / "ck", model, {"training": {"task": "graded"}})
    loaded, info = checkpoint.load(tmp_path / "ck")
    assert info["family"] == "budgetformer" and len(info["sha256"]) == 64
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["config"]["d_model"] == 32
