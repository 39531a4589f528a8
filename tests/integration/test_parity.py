"""Parity catches what a one-input comparison misses, and excuses only boundary cases."""
import numpy as np
import pytest

from adaptex.exporter import registry
from adaptex.exporter.targets import onnx as onnx_target
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.graphs import checkpoint
from adaptex.graphs.family import family_contract
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
from adaptex.runtimes.parity import _mask_margin, check, parity_inputs
from adaptex.runtimes.torch_ref import TorchRunner
from tests.support import zoo


def test_inputs_span_batches_lengths_padding_and_levels():
    cfg = zoo.tiny_model().cfg
    feeds = parity_inputs(cfg, "graded", samples=200)
    assert sum(f["input_ids"].shape[0] for f in feeds) == 200
    batch_sizes = {f["input_ids"].shape[0] for f in feeds}
    lengths = {f["input_ids"].shape[1] for f in feeds}
    assert {1, 2, 8} <= batch_sizes
    assert 1 in lengths and cfg.max_len in lengths
    assert any((f["attention_mask"] == 0).any() for f in feeds)  # padded rows


def test_a_decoders_long_batches_are_cut_to_the_score_budget(monkeypatch):
    """A decoder's generated batches stay under PARITY_SCORES_PER_BATCH (a check's memory) by keeping
    a long batch's first rows: every item is the same rows of the unbounded run's item, the total is
    still `samples`, and the longest sequence is still generated."""
    from adaptex.graphs import decoding

    heads = zoo.TINY_TSA["num_heads"]
    contract = family_contract(zoo.tiny_tsa(max_len=256))
    unbounded = contract.parity_items(None, 60)
    budget = 2 * heads * 256 * 256  # two rows of the longest
    monkeypatch.setattr(decoding, "PARITY_SCORES_PER_BATCH", budget)
    bounded = contract.parity_items(None, 60)
    assert sum(f["input_ids"].shape[0] for f in bounded) == 60
    assert all(f["input_ids"].size * f["input_ids"].shape[1] * heads <= budget for f in bounded)
    assert 256 in {f["input_ids"].shape[1] for f in bounded}
    cut = 0
    for a, b in zip(unbounded, bounded):
        assert a["prefill"] == b["prefill"]
        for name in ("input_ids", "attention_mask"):
            np.testing.assert_array_equal(a[name][:len(b[name])], b[name])
        cut += len(a["input_ids"]) - len(b["input_ids"])
    assert cut > 0  # the bound changed something: a long batch of more than two rows was generated


def test_a_callers_long_batches_are_checked_in_pieces_within_the_score_budget(tiny_onnx, tiny_checkpoint,
                                                                                monkeypatch):
    """The caller's inputs (--inputs, adaptex.check(inputs=...)) are cut into runs of whole rows whose
    scores fit PARITY_SCORES_PER_BATCH, as generated batches are: every row is still compared, each
    call sees at most the budget's rows, and the check passes as before."""
    from adaptex.runtimes import parity

    model, _ = checkpoint.load(tiny_checkpoint)
    heads, length = model.cfg.num_heads, 48
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(4, model.cfg.vocab_size, (8, length)), "attention_mask": np.ones((8, length))}
    runner = OnnxRuntimeRunner(tiny_onnx["sparse"], chunk_rows=None).activate()
    seen = []
    infer = runner.infer
    monkeypatch.setattr(runner, "infer", lambda f: seen.append(len(f["input_ids"])) or infer(f))
    monkeypatch.setattr(parity, "PARITY_SCORES_PER_BATCH", 3 * heads * length * length)
    report = check(runner, TorchRunner(model), inputs=[feeds])
    assert report.passed and report.samples == 8, report.failures
    assert seen == [3, 3, 2]


def test_a_cut_keeps_each_input_whole_where_it_has_no_batch_axis():
    """A decoder step's item: the key mask (the longest 2-D input, spanning the cache) sets the keys,
    every batched input is cut alike along its first axis, an input without a batch axis stays whole."""
    from adaptex.runtimes.parity import PARITY_SCORES_PER_BATCH, _bounded

    keys = 1024
    per = PARITY_SCORES_PER_BATCH // (4 * keys * keys)  # rows a piece at 4 heads
    rows = 2 * per + 1
    item = {"input_ids": np.zeros((rows, 1)), "attention_mask": np.ones((rows, keys)),
            "past.key": np.zeros((rows, 4, keys - 1, 8)), "scale": np.ones(3)}
    pieces = _bounded(item, 4, {"input_ids", "attention_mask", "past.key"})
    assert [len(p["input_ids"]) for p in pieces] == [per, per, 1]
    assert all(len(p["past.key"]) == len(p["attention_mask"]) == len(p["input_ids"]) for p in pieces)
    assert all(p["scale"] is item["scale"] for p in pieces)
    assert _bounded(item, 4, {"scale"}) == [item]  # nothing batched to cut: the item as it is


def test_a_cut_counts_a_models_heads_from_its_config_or_its_layers():
    """A shipped model's heads are its config's; a model of one's own, with no config, is sized by its
    widest adaptex attention layer (an ElasticAttention's query heads, KV groups included)."""
    from types import SimpleNamespace

    import torch

    import adaptex.nn as axn
    from adaptex.runtimes.parity import _heads

    def ref(cfg, model):
        return SimpleNamespace(contract=SimpleNamespace(cfg=cfg), model=model)

    assert _heads(ref(SimpleNamespace(num_heads=12), None)) == 12
    mine = torch.nn.ModuleList([axn.ElasticAttention(3, 8, kv_groups=2), axn.BudgetedAttention(32, 4),
                                axn.ConditionalBlock(40, 5, 64)])
    assert _heads(ref(None, mine)) == 6
    assert _heads(ref(None, mine[2:])) == 5
    assert _heads(ref(None, torch.nn.Linear(2, 2))) == 1  # no attention layer: keys alone bound a batch


def test_margins():
    model = zoo.tiny_model()
    feeds = parity_inputs(model.cfg, "graded", 8)[0]
    ref = family_contract(model).reference(model, feeds)
    s = ref.outputs["decisions.layer0.s"].astype(np.float64) * model.cfg.num_heads
    assert np.allclose(ref.margins["decisions.layer0.k"], np.abs(s - np.round(s)))  # |s*H - round(s*H)|
    p = np.array([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    assert np.allclose(_mask_margin(p, np.array([2, 4])), [0.1, np.inf])


def _off_by_one_function(variant):
    """A wrong body: k = floor(s*H) + 1, the bug a naive clamp would make."""
    f = fx.budgeted_attention_function(variant)
    for node in f.node:
        if node.op_type == "Floor":
            node.op_type = "Ceil"
    return f


def test_a_wrong_lowering_fails_with_unexcused_flips(tiny_checkpoint, tmp_path):
    model, info = checkpoint.load(tiny_checkpoint)

    def budgeted_attention_ceil(ctx, node):
        """Deliberately wrong: ceil instead of floor."""
        from adaptex.exporter.targets.onnx.lowerings import OnnxLowering, budgeted_attention_node

        return OnnxLowering(budgeted_attention_node, [_off_by_one_function("sparse")])

    wrong = registry.Lowering("adaptex::budgeted_attention", "onnx", "sparse", budgeted_attention_ceil)
    with registry.override(wrong):
        zoo.export(model, info, tmp_path / "wrong.onnx")
    report = check(OnnxRuntimeRunner(tmp_path / "wrong.onnx"), TorchRunner(model), samples=40, task="graded")
    assert not report.passed
    assert report.unexcused_flips > 0
    assert any("unexcused flip" in f and "decisions.layer" in f for f in report.failures)
    text = report.format()
    assert "FAILED" in text and "FAIL decisions.layer" in text


def test_a_numeric_error_names_output_input_and_needed_tolerance(tiny_checkpoint, tiny_onnx):
    model, _ = checkpoint.load(tiny_checkpoint)

    class Nudged(OnnxRuntimeRunner):
        def _infer(self, feeds):
            out = super()._infer(feeds)
            # off by 3e-3 beyond what rtol allows, everywhere: the smallest passing atol is 3e-3
            out["logits"] = out["logits"] + 3e-3 + 1e-3 * np.abs(out["logits"])
            return out

    report = check(Nudged(tiny_onnx["sparse"]), TorchRunner(model), samples=10)
    assert not report.passed and report.unexcused_flips == 0
    msg = report.failures[0]
    assert msg.startswith("logits:") and "batch 0 (B=1" in msg
    needed = float(msg.rsplit("smallest atol that passes is ", 1)[1])
    assert abs(needed - 3e-3) < 1e-5, msg


def _on_the_boundary(nudge: float):
    """A tiny model whose layer-0 budget is s = sigmoid(b) for every input, with s*H = 2 exactly at
    nudge 0 and a hair below 2 (so k = 1 instead of 2) at a small negative nudge."""
    import torch

    model = zoo.tiny_model()
    last = model.layers[0].attn.router.budget[2]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(nudge)  # sigmoid(0) = 0.5 exactly; H = 4 -> s*H = 2.0
    return model


def test_excused_flip_is_replayed_not_failed():
    """An 'artifact' that decides k = 1 where the reference sat exactly on the k = 2 boundary: the
    flip is excused, the reference replays the artifact's routing, and the values then agree."""
    reference, artifact = _on_the_boundary(0.0), _on_the_boundary(-1e-6)
    report = check(TorchRunner(artifact), TorchRunner(reference), samples=12, task="graded")
    assert report.decisions["decisions.layer0.k"].excused == 12
    assert report.unexcused_flips == 0
    assert report.passed, report.format()
    # without the replay the same artifact fails on values: the flip changed what layer 0 computed
    plain = TorchRunner(reference).infer(parity_inputs(reference.cfg, "graded", 4)[1])
    flipped = TorchRunner(artifact).infer(parity_inputs(reference.cfg, "graded", 4)[1])
    assert np.abs(plain["logits"] - flipped["logits"]).max() > 1e-3


def test_a_wrong_head_set_is_not_excused_by_an_excused_k_flip():
    reference = _on_the_boundary(0.0)
    artifact = _on_the_boundary(-1e-6)
    import torch

    with torch.no_grad():  # the artifact also ranks heads in reverse: its head set is wrong
        artifact.layers[0].attn.router.scorer[2].weight.mul_(-1)
        artifact.layers[0].attn.router.scorer[2].bias.mul_(-1)
    report = check(TorchRunner(artifact), TorchRunner(reference), samples=8, task="graded")
    assert not report.passed
    assert report.decisions["decisions.layer0.head_mask"].unexcused > 0
    assert any("decisions.layer0.head_mask: unexcused flip" in f and "would excuse it" in f for f in report.failures)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_value_tolerance_is_the_stated_one_not_looser(precision):
    """An output off by twice the stated tolerance (atol + rtol*|reference|) fails; one off by half of
    it passes. Pins the comparison itself: a checker that loosened its tolerance would pass the first."""
    from adaptex.runtimes.parity import _compare_values
    from adaptex.runtimes.report import TOLERANCES, ParityReport

    tol = TOLERANCES[precision]
    for ref in (np.zeros((2, 5), np.float32), np.full((2, 5), 40.0, np.float32)):
        bound = tol["atol"] + tol["rtol"] * np.abs(ref)
        for factor, fails in ((2.0, True), (0.5, False)):
            report = ParityReport("a", "onnxruntime", precision, dict(tol), {})
            _compare_values(report, "logits", (ref + factor * bound).astype(np.float64), ref.astype(np.float64), "x")
            assert bool(report.failures) is fails, (precision, float(ref.flat[0]), factor, report.failures)


def test_each_onnx_runtime_body_passes_parity(tiny_onnx, tiny_checkpoint):
    """ONNX Runtime's sparse BudgetedAttention runs one of three bodies a call, by the batch's
    decisions (budgeted_attention.onnx_body): each one's outputs match the eager model's on batches
    that take it, with no unexcused flip."""
    from adaptex.graphs.ops.budgeted_attention import onnx_body
    from tests.support import planted

    model, _ = checkpoint.load(tiny_checkpoint)
    batches = planted.bf_batches(planted.load(tiny_onnx["sparse"]))
    runner = OnnxRuntimeRunner(tiny_onnx["sparse"], chunk_rows=None).activate()  # each batch one call
    bodies = set()
    for feeds in batches:
        out = runner.infer(feeds)
        bodies |= {onnx_body(out[f"decisions.layer{i}.k"], out[f"decisions.layer{i}.head_mask"],
                             feeds["input_ids"].shape[1]) for i in range(model.cfg.num_layers)}
    assert bodies == {"active_heads", "by_head", "per_sample"}, bodies
    report = check(runner, TorchRunner(model), inputs=batches)
    assert report.passed and report.unexcused_flips == 0, report.failures
