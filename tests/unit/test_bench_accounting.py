"""Bench accounting by value, not by range: each family's FLOP model against an independent count on
its tiny config, the executed FLOP ratio against what the runtime computed, the realisation formula,
and the dense and naive counterparts against the model they are made from.

Independent counts: torch's FlopCounterMode on the eager model (the op kernels' own skipping code
for the adaptive modes), with CPU attention counted by torch's own SDPA formula, where the eager
path computes what the FLOP model describes; a brute-force count of the keys each query sees where
it does not (streaming heads, whose eager kernel works block-local)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from adaptex.graphs.budgetformer import flops_per_sample
from adaptex.graphs.ops.budgeted_attention import onnx_body
from adaptex.graphs.elastic import elastic_flops
from adaptex.graphs.elastic_decoder import attention_flops
from adaptex.graphs.family import family_contract
from adaptex.graphs.tsa import flops_per_token
from tests.support import planted, zoo


def _sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def counted(fn) -> float:
    """FLOPs (2 per multiply-add) torch executes in `fn`, CPU attention included."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu}
    with FlopCounterMode(display=False, custom_mapping=mapping) as fc, torch.no_grad():
        fn()
    return float(fc.get_total_flops())


@pytest.fixture
def eager_kernels(monkeypatch):
    """The TSA ops' eager kernels called directly (a custom op hides its kernel from the counter)."""
    import adaptex.graphs.ops.conditional_attention as ca
    import adaptex.graphs.ops.conditional_ffn as cf

    monkeypatch.setattr(ca, "conditional_attention", ca.conditional_attention_eager)
    monkeypatch.setattr(cf, "conditional_ffn", cf.conditional_ffn_eager)


# --- the FLOP models ----------------------------------------------------------------------------------

def test_budgetformer_flops_per_sample_counts_what_runs():
    model = zoo.tiny_model()
    cfg, T = model.cfg, 20
    assert counted(lambda: model(*_bf_inputs(1, T), mode="dense")) == flops_per_sample(cfg, T, None)
    pooling = 2 * T * cfg.d_model * cfg.num_layers  # each router's mean over the tokens (a GEMV) is left out
    seen = set()
    for seed in range(4):
        ids, mask = _bf_inputs(1, T, seed)
        with torch.no_grad():
            ks = [int(d["k"][0]) for d in model(ids, mask)[1]]
        seen.add(tuple(ks))
        # eager: the kernel that projects and attends the selected heads only
        assert counted(lambda: model(ids, mask, mode="eager")) == flops_per_sample(cfg, T, ks) + pooling
        # naive: every head computed and masked, routers included: what the dense variant executes
        assert counted(lambda: model(ids, mask, mode="naive")) == flops_per_sample(cfg, T, [cfg.num_heads] * 2) + pooling
    assert len(seen) > 1


def _bf_inputs(B, T, seed=0):
    ids = torch.from_numpy(np.random.default_rng(seed).integers(1, 64, size=(B, T)))
    return ids, torch.ones(B, T, dtype=torch.long)


def test_tsa_flops_per_token_counts_a_decode_step(eager_kernels):
    """At a decode step (one token, every cached key visible) the model's mean context is exact: the
    step's FLOPs, halved to multiply-adds, are flops_per_token's at that keep pattern."""
    model = zoo.tiny_tsa()
    cfg = model.cfg
    text = torch.from_numpy(np.random.default_rng(0).integers(1, cfg.vocab_size, size=(1, 24)))
    patterns = set()
    for P in (3, 9, 14, 20):
        with torch.no_grad():
            _, _, past = model(text[:, :P])
        step = text[:, P:P + 1]
        keeps = None

        def run(mode):
            nonlocal keeps
            _, dec, _ = model(step, past=past, mode=mode)
            keeps = [float(d["keep"][0, 0]) for d in dec] if dec else keeps
        assert counted(lambda: run("dense")) / 2 == flops_per_token(cfg, P + 1, None)
        assert counted(lambda: run("hard")) / 2 == flops_per_token(cfg, P + 1, keeps)
        patterns.add(tuple(keeps))
    assert len(patterns) > 1, patterns


def _visible(T: int, S: int, sink: int, window: int, causal: bool) -> np.ndarray:
    """Per query, the keys a streaming head sees, counted one by one from the definition (docs/ops.md)."""
    counts = []
    for i in range(T):
        a = S - T + i
        seen = {j for j in range(S) if (j <= a or not causal) and
                (j < sink or (0 <= a - j < window if causal else abs(j - a) <= window // 2))}
        counts.append(len(seen))
    return np.array(counts)


def test_elastic_encoder_flops():
    model = zoo.tiny_elastic()
    cfg, T = model.cfg, 24
    L, H, dh = cfg.num_layers, cfg.num_heads, cfg.head_dim
    ids = torch.from_numpy(np.random.default_rng(0).integers(1, cfg.vocab_size, size=(1, T)))
    full = elastic_flops(cfg, np.zeros((L, H), bool), T)
    assert counted(lambda: model(ids, torch.ones_like(ids), mode="full")) == full
    # one SA head: T x T scores and values (4 T^2 dh FLOPs) become 4 dh per key it sees; the model
    # charges every query the interior count (sink + window + 1), an upper bound at the edges
    one = np.zeros((L, H), bool)
    one[0, 0] = True
    seen = _visible(T, T, cfg.sink, cfg.window, causal=False)
    saved = full - elastic_flops(cfg, one, T)
    assert saved == 4 * dh * (T * T - T * seen.max())
    assert seen.max() == cfg.sink + cfg.window + 1 and saved <= 4 * dh * (T * T - seen.sum())


def test_elastic_decoder_attention_flops():
    model = zoo.tiny_elastic_decoder()
    cfg = model.cfg
    L, H, dh = cfg.num_layers, cfg.num_heads, cfg.head_dim
    text = torch.from_numpy(np.random.default_rng(0).integers(1, cfg.vocab_size, size=(1, 40)))
    fa = np.zeros((L, H), bool)
    for P in (5, 30):  # a step inside and past the window
        with torch.no_grad():
            _, _, past = model(text[:, :P])
        elastic, full = attention_flops(cfg, fa, 1, P)
        assert elastic == full == counted(lambda: model(text[:, P:P + 1], past=past, mode="full")) / 2
    # prefill of 30 tokens, one SA head: causal sink + window keys per query, exactly
    T = 30
    one = fa.copy()
    one[1, 2] = True
    elastic, full = attention_flops(cfg, one, T)
    causal = np.arange(1, T + 1)
    seen = _visible(T, T, cfg.sink, cfg.window, causal=True)
    assert full - elastic == 2 * dh * (causal.sum() - seen.sum())
    assert attention_flops(cfg, fa, T)[0] == full


# --- what an artifact executes --------------------------------------------------------------------------

def test_executed_flop_ratio_is_what_the_runtime_computed(artifacts):
    """BudgetFormer: the dense variant executes every head (plus its routers); the sparse one, in a batch
    whose k differ, the batch's largest k in every sample on a TensorRT-bound graph, and on ONNX
    Runtime what its body computes (onnx_body): every head some sample selected for each sample (in a
    small batch: 6 samples), each sample's own k where it groups by head (48): the heads its runtime
    attended with (planted.expose)."""
    model = artifacts.model("bf")
    cfg, contract, T = model.cfg, family_contract(model), 20
    H, L = cfg.num_heads, cfg.num_layers
    dense = flops_per_sample(cfg, T, None)
    rng, seen = np.random.default_rng(5), set()
    cases = [(target, variant, B) for target, variant in (("onnx", "sparse"), ("tensorrt", "sparse"), ("onnx", "dense"))
             for B in (6, 48)]
    for target, variant, B in cases:
        ids = rng.integers(1, 64, size=(B, T))
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        proto = planted.load(artifacts("bf", target, variant))
        probes = planted.expose(proto, "BudgetedAttention", "Softmax")
        out = planted.run(proto, feeds)
        heads = []  # per layer, the (sample, head) pairs attended over the batch, per sample
        for call in probes:
            scores = planted.ran(out, call)
            pairs = sum(a.shape[0] for a in scores) if scores[0].ndim == 3 else scores[0].shape[0] * scores[0].shape[1]
            heads.append(pairs / B)
        ks, masks = (np.stack([out[f"decisions.layer{i}.{f}"] for i in range(L)], 1) for f in ("k", "head_mask"))
        r = contract.flops(out, variant, T, target=target)
        assert r["executed_flop_ratio"] == pytest.approx(flops_per_sample(cfg, T, heads) / dense, rel=1e-12)
        assert r["flop_ratio"] == pytest.approx(np.mean([flops_per_sample(cfg, T, list(k)) for k in ks]) / dense)
        bodies = [onnx_body(ks[:, i], masks[:, i], T) for i in range(L)]
        if variant == "dense":
            assert heads == [H] * L and 1.0 < r["executed_flop_ratio"] < 1.01  # every head, and the routers
        elif target == "tensorrt":
            assert heads == list(ks.max(0)) and r["executed_flop_ratio"] > r["flop_ratio"]
            assert len(set(map(tuple, ks))) > 1, "the batch's samples should disagree on k"
        else:  # each layer what its body computes: every head some sample selected for every sample, or
            # each sample's own k (grouped by head: exactly the decisions' FLOPs, plus the routers')
            want = [masks[:, i].any(axis=0).sum() if body == "active_heads" else ks[:, i].mean() if body == "by_head"
                    else ks[:, i].max() for i, body in enumerate(bodies)]
            assert heads == pytest.approx(want), (bodies, heads, want)
            seen.update(bodies)
            if bodies == ["by_head"] * L:
                assert r["executed_flop_ratio"] == pytest.approx(r["flop_ratio"], rel=1e-12)
            elif "active_heads" in bodies and heads != pytest.approx(list(ks.mean(0))):
                assert r["executed_flop_ratio"] > r["flop_ratio"]
    assert seen >= {"active_heads", "by_head"}, seen


def test_executed_tsa_flops_are_the_rows_the_runtime_computed(artifacts):
    model = artifacts.model("tsa")
    cfg, contract = model.cfg, family_contract(model)
    B, T = 2, 24
    feeds = contract.bench_feeds(None, B, T)
    ctx = (T + 1) / 2
    dense = flops_per_token(cfg, ctx, None)
    for variant in ("sparse", "dense"):
        proto = planted.load(artifacts("tsa", "onnx", variant))
        # the sparse body's MatMuls take the gathered (K, d) rows, the dense one's x as it is, (B, T, d)
        ffn = planted.expose(proto, "ConditionalFFN", "MatMul", rank=2 if variant == "sparse" else 3)
        queries = planted.expose(proto, "ConditionalAttention", "Softmax")
        out = planted.run(proto, feeds)
        ffn_rates = [sum(np.prod(a.shape[:-1]) for a in planted.ran(out, f)) / 2 / (B * T)
                     for f in ffn]  # two MatMuls
        query_rates = [sum(a.shape[2] for a in planted.ran(out, q)) / T for q in queries]
        r = contract.flops(out, variant, T)
        assert r["executed_flop_ratio"] == pytest.approx(flops_per_token(cfg, ctx, ffn_rates, query_rates) / dense)
        keeps = [np.asarray(out[f"decisions.layer{i}.keep"]) for i in range(1, cfg.num_layers)]
        assert r["flop_ratio"] == pytest.approx(flops_per_token(cfg, ctx, [k.mean() for k in keeps]) / dense)


def test_a_block_with_no_kept_token_runs_no_query_side_on_onnx_runtime(artifacts):
    """A decode step whose token skips every gated block: ONNX Runtime's dispatch runs none of their
    query sides (0 rows) and the TensorRT-bound body attends one ungated row in each; the executed
    FLOPs say so, and the decisions' FLOPs are the same for both."""
    model = artifacts.model("tsa")
    cfg, contract = model.cfg, family_contract(model)
    L, past = cfg.num_layers, 30
    out = {f"decisions.layer{i}.keep": np.zeros((1, 1), bool) for i in range(1, L)}
    ctx = past + 1
    dense = flops_per_token(cfg, ctx, None)
    ort_, trt = (contract.flops(out, "sparse", 1, past, target=t) for t in ("onnx", "tensorrt"))
    assert ort_["flop_ratio"] == trt["flop_ratio"] == pytest.approx(flops_per_token(cfg, ctx, [0.0] * (L - 1)) / dense)
    assert ort_["executed_flop_ratio"] == pytest.approx(ort_["flop_ratio"])
    assert trt["executed_flop_ratio"] == pytest.approx(
        flops_per_token(cfg, ctx, [0.0] * (L - 1), [1.0] * (L - 1)) / dense)


def test_executed_tsa_query_rows_follow_the_onnx_runtime_bodies_dispatch(artifacts):
    """A mixed block runs its queries on the batch's largest kept count in every sample, on every row
    once that count reaches policy.dense_query_share of T, and on each sample's own kept rows where
    the call attends a sample at a time (B > 1 and policy.by_sample_from scores: test_dispatch.py
    checks the rows the body runs)."""
    from adaptex.graphs.ops.policy import DEFAULT

    model = artifacts.model("tsa")
    cfg, contract = model.cfg, family_contract(model)
    L, T = cfg.num_layers, 512
    rng = np.random.default_rng(0)

    def executed(keep):
        out = {f"decisions.layer{i}.keep": keep for i in range(1, L)}
        dense = flops_per_token(cfg, (T + 1) / 2, None)
        return contract.flops(out, "sparse", T)["executed_flop_ratio"] * dense

    def with_queries(keep, share):
        return flops_per_token(cfg, (T + 1) / 2, [keep.mean()] * (L - 1), [share] * (L - 1))

    for B in (1, 64):
        keep = rng.random((B, T)) < rng.uniform(0.5, 0.8, (B, 1))  # the samples keep different counts
        n = keep.sum(1).max()
        large = B > 1 and B * cfg.num_heads * n * T >= DEFAULT.by_sample_from
        assert large == (B == 64) and n < DEFAULT.dense_query_share * T
        assert executed(keep) == pytest.approx(with_queries(keep, keep.mean() if large else n / T))
        keep[0, :] = True  # one sample keeps every token: every row of every sample, masked
        assert executed(keep) == pytest.approx(with_queries(keep, 1.0))


@pytest.mark.parametrize("family", ["el", "eldec"])
def test_elastic_executed_ratio_is_one_dense_and_masked_and_the_decisions_sparse(artifacts, family):
    """Every key executed by the dense variant, and on ONNX Runtime by a call of at most
    policy.mixed_call_masked_up_to scores a sample, or an encoder's whose masking adds at most
    policy.masked_excess_up_to scores (the general body masks; test_elastic checks it runs so); the
    decisions' FLOPs by a larger one, and by a TensorRT-bound graph (no masked path)."""
    from adaptex.graphs.ops import elastic_attention
    from adaptex.graphs.ops.policy import OrtPolicy

    model = artifacts.model(family)
    contract = family_contract(model)
    T = 40
    feeds = contract.bench_feeds(None, 2, T)
    out = planted.run(planted.load(artifacts(family)), feeds)
    pairs = np.asarray(out["decisions.layer0.sa"]).shape[-1]
    assert contract.flops(out, "dense", T)["executed_flop_ratio"] == 1.0
    assert elastic_attention.runs_masked(pairs, T, T)  # 2 samples, but per sample
    r = contract.flops(out, "sparse", T)
    assert r["executed_flop_ratio"] == 1.0 and r["flop_ratio"] < 1.0
    assert contract.flops(out, "sparse", T, target="tensorrt")["executed_flop_ratio"] == r["flop_ratio"]
    policy = OrtPolicy(mixed_call_masked_up_to=pairs * T * T - 1)
    if family == "el":  # an encoder's call also masks where masking adds few scores over block-local SA
        cfg = model.cfg
        excess = 2 * pairs * T * (T - cfg.sink - 2 * cfg.window)
        assert excess > 0
        policy = OrtPolicy(mixed_call_masked_up_to=pairs * T * T - 1, masked_excess_up_to=excess)
        assert contract.flops(out, "sparse", T, policy=policy)["executed_flop_ratio"] == 1.0
        policy = OrtPolicy(mixed_call_masked_up_to=pairs * T * T - 1, masked_excess_up_to=excess - 1)
    assert contract.flops(out, "sparse", T, policy=policy)["executed_flop_ratio"] == r["flop_ratio"]


def test_a_prefill_the_masked_program_runs_executes_every_key():
    """A prefill longer than the general body's per-sample rule that the masked short-call program
    runs (its metadata entry says masked) is counted as every key; the same prefill in the general
    graph as the decisions' FLOPs."""
    from adaptex.graphs.ops.elastic_attention import call_runs_masked, runs_masked
    from adaptex.graphs.ops.policy import DEFAULT

    model = zoo.tiny_elastic_decoder(max_len=320)
    contract, T = family_contract(model), 265
    assert not runs_masked(4, T, T) and call_runs_masked(1, 4, T, 2, 8, DEFAULT.prefill_masked_excess_up_to)
    out = {f"decisions.layer{i}.sa": np.array([[True, False, True, True]]) for i in range(model.cfg.num_layers)}
    r = contract.flops(out, "sparse", T, masked_program=True)
    assert r["executed_flop_ratio"] == 1.0 and r["flop_ratio"] < 1.0
    assert contract.flops(out, "sparse", T)["executed_flop_ratio"] == r["flop_ratio"]


# --- the counterparts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["bf", "tsa", "el", "eldec"])
def test_counterparts_compute_the_model(artifacts, shared_counterparts, family, tmp_path):
    """The dense counterpart is the model with no routing; the naive export is the model's hard
    decisions with everything computed (what a stock exporter makes of it): both export for every
    family (README, Latency) and reproduce the eager model, decisions included."""
    model = artifacts.model(family)
    contract = family_contract(model)
    made = shared_counterparts(model, contract, tmp_path)
    assert made["dense"][1] is None and made["naive"][1] is None, made
    feeds = contract.bench_feeds(None, 2, 20)
    for name, mode in (("dense", contract.counterpart_modes["dense"]), ("naive", "hard")):
        got = planted.run(planted.load(made[name][0]), feeds)  # the naive export against the model's inference
        want = contract.reference(model, {k: v for k, v in feeds.items() if k in contract.input_names(mode)}, mode)
        assert set(want.outputs) <= set(got), (name, sorted(set(want.outputs) - set(got)))
        for out, ref in want.outputs.items():
            if ref.dtype.kind in "bi":
                assert np.array_equal(np.asarray(got[out]).astype(ref.dtype), ref), (name, out)
            else:
                np.testing.assert_allclose(got[out], ref, atol=1e-4, rtol=1e-3, err_msg=f"{name} {out}")
    # the dense counterpart takes no decisions, the naive export the adaptive model's own
    assert not contract.decisions(contract.counterpart_modes["dense"])
    assert contract.decisions(contract.counterpart_modes["naive"]) == contract.decisions("hard")


@pytest.mark.slow
def test_a_dense_decoder_benches_at_flop_ratio_one(tmp_path, capsys):
    """A TSA decoder without routers (charlm-dense's kind) has no keep decisions: bench accounts it as
    computing everything, and runs."""
    import json

    from adaptex.cli import main
    from adaptex.graphs import checkpoint

    model = zoo.tiny_tsa(adaptive=False)
    checkpoint.save(tmp_path / "ck", model, {"training": {"task": "copy"}, "description": "dense test decoder",
                                             "tokenizer": {"kind": "ids", "pad": 0, "bos": 1, "sep": 2}})
    model, info = checkpoint.load(tmp_path / "ck")
    out = tmp_path / "dense.onnx"
    zoo.export(model, info, out)
    capsys.readouterr()
    assert main(["bench", str(out), "--seq", "8", "--runs", "5", "--warmup", "1", "--blocks", "1", "--no-memory",
                 "--json", "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["flop_ratio"] == 1.0 and r["executed_flop_ratio"] == 1.0 and r["realisation"] is None
