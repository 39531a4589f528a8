"""The sparse variant really skips work, seen from the runtime that runs the artifact (batch 1):
- poison: NaN in the weights of the heads a layer did not select, and in the inputs a skipped
  token's query side and FFN would read (its query row, its gate): the sparse artifact's outputs stay
  bit for bit what they were; the dense one, which multiplies that work by zero, turns NaN;
- sizes: the intermediates of the function bodies exposed as outputs give the heads, rows and
  (batch, head) pairs the runtime computed, which must be those the decisions imply (the dense
  variant: all of them).
On ONNX Runtime (the ONNX and the TensorRT-bound ONNX) and the MIL evaluator (Core ML)."""
from __future__ import annotations

import numpy as np
import pytest

from adaptex.graphs.ops.policy import OrtPolicy
from adaptex.graphs.ops.budgeted_attention import onnx_body
from adaptex.runtimes import coreml_mil
from adaptex.runtimes.coreml_mil import MilReferenceRunner
from tests.support import planted

TARGETS = ["onnx", "tensorrt"]


def _ids(T: int, vocab: int, seed: int) -> dict:
    ids = np.random.default_rng(seed).integers(1, vocab, size=(1, T)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def _prefill(T: int, contract, vocab: int, seed: int) -> dict:
    feeds = _ids(T, vocab, seed)
    return {**feeds, **contract.empty_cache(1), **contract.initial_extra(1)}


def _layers(out: dict, field: str) -> list[np.ndarray]:
    names = sorted((n for n in out if n.startswith("decisions.") and n.endswith("." + field)),
                   key=lambda n: int(n.split(".")[1][5:]))
    return [np.asarray(out[n]) for n in names]


# --- BudgetFormer: the heads not selected -------------------------------------------------------------

@pytest.mark.parametrize("variant", ["sparse", "dense"])
@pytest.mark.parametrize("target", TARGETS)
def test_weights_of_heads_not_selected_are_never_read(artifacts, target, variant):
    clean = planted.load(artifacts("bf", target, variant))
    H = artifacts.model("bf").cfg.num_heads
    seen = set()
    for seed in range(3):
        feeds = _ids(24, 64, seed)
        want = planted.run(clean, feeds)
        masks = _layers(want, "head_mask")
        seen |= {int(m.sum()) for m in masks}
        poisoned = planted.load(artifacts("bf", target, variant))
        for call, mask in zip(planted.calls(poisoned, "BudgetedAttention"), masks):
            planted.poison_heads(poisoned, call, np.flatnonzero(~mask[0]))
        got = planted.run(poisoned, feeds)
        if variant == "sparse":
            assert all(np.array_equal(got[n], want[n]) for n in want), "a poisoned head was read"
        else:
            assert not np.isfinite(got["logits"]).all(), "the dense variant should have read every head"
    assert seen - {H}, "the inputs should leave some heads unselected"


@pytest.mark.parametrize("target", TARGETS)
def test_the_runtime_attends_with_k_heads(artifacts, target):
    """The score tensors ONNX Runtime computed hold the (sample, head) pairs the body it chose
    (budgeted_attention.onnx_body) computes: one sample's k heads; every sample on each head some
    sample selected (A, B, T, T); each head on exactly the samples that selected it (n_h, T, T),
    sum_b k_b pairs in all; or the batch's largest k for every sample (B, K, T, T), which is all the
    TensorRT-bound graph does. The dense variant attends with every head."""
    H = artifacts.model("bf").cfg.num_heads
    seen = set()
    for variant in ("sparse", "dense"):
        proto = planted.load(artifacts("bf", target, variant))
        probes = planted.expose(proto, "BudgetedAttention", "Softmax")
        for feeds in planted.bf_batches(planted.load(artifacts("bf", target, variant))):
            out = planted.run(proto, feeds)
            B, T = feeds["input_ids"].shape
            for call, k, mask in zip(probes, _layers(out, "k"), _layers(out, "head_mask")):
                scores = planted.ran(out, call)
                body = "dense" if variant == "dense" else \
                    "per_sample" if target == "tensorrt" else onnx_body(k, mask, T)
                seen.add(body)
                if body == "by_head":  # one (n_h, T, T) score tensor per head that some sample selected
                    assert all(s.ndim == 3 for s in scores), [s.shape for s in scores]
                    assert sorted(s.shape[0] for s in scores) == sorted(int(n) for n in mask.sum(axis=0) if n)
                    continue
                assert [s.shape for s in scores] == [{
                    "dense": (B, H, T, T), "per_sample": (B, k.max(), T, T),
                    "active_heads": (int(mask.any(axis=0).sum()), B, T, T)}[body]], (body, B, k, mask)
    want = {"dense", "per_sample"} | ({"active_heads", "by_head"} if target == "onnx" else set())
    assert seen == want, f"the batches here took {seen}, not every body"


# --- TSA: the skipped tokens ----------------------------------------------------------------------------

def _tsa_feeds(artifacts) -> dict:
    """A prefill in which every gated block keeps some tokens and skips others (the untrained tiny
    routers decide mostly by position: 24 tokens mix both in each block)."""
    import torch

    from adaptex.graphs.family import family_contract

    model = artifacts.model("tsa")
    for seed in range(50):
        feeds = _prefill(24, family_contract(model), model.cfg.vocab_size, seed)
        with torch.no_grad():
            _, decisions, _ = model(torch.from_numpy(feeds["input_ids"]))
        if all(d["keep"].any() and not d["keep"].all() for d in decisions):
            return feeds
    raise AssertionError("no input of 50 mixes kept and skipped tokens in every block")


@pytest.mark.parametrize("variant", ["sparse", "dense"])
@pytest.mark.parametrize("target", TARGETS)
def test_query_rows_and_ffn_inputs_of_skipped_tokens_are_never_read(artifacts, target, variant):
    feeds = _tsa_feeds(artifacts)
    clean = planted.load(artifacts("tsa", target, variant))
    want = planted.run(clean, feeds)
    keeps = _layers(want, "keep")
    assert all(k.any() and not k.all() for k in keeps)
    poisoned = planted.load(artifacts("tsa", target, variant))
    planted.poison_skipped(poisoned, "ConditionalAttention", ("hn", "gate"))
    planted.poison_skipped(poisoned, "ConditionalFFN", ("gate",))
    got = planted.run(poisoned, feeds)
    if variant == "sparse":
        assert all(np.array_equal(got[n], want[n]) for n in want), "a skipped token's query or FFN input was read"
    else:
        assert not np.isfinite(got["logits"]).all(), "the dense variant should have computed the skipped tokens"


@pytest.mark.parametrize("target", TARGETS)
def test_the_runtime_runs_the_ffn_and_queries_of_kept_tokens_only(artifacts, target):
    feeds = _tsa_feeds(artifacts)
    T = feeds["input_ids"].shape[1]
    for variant in ("sparse", "dense"):
        proto = planted.load(artifacts("tsa", target, variant))
        # the sparse body's FFN MatMuls take the gathered (K, d) rows, the dense one's x as it is, (B, T, d)
        ffn = planted.expose(proto, "ConditionalFFN", "MatMul", rank=2 if variant == "sparse" else 3)
        queries = planted.expose(proto, "ConditionalAttention", "Softmax")
        out = planted.run(proto, feeds)
        for ffn_probes, query_probes, keep in zip(ffn, queries, _layers(out, "keep")):
            kept = int(keep.sum())
            rows = kept if variant == "sparse" else T
            fcs, scores = planted.ran(out, ffn_probes), planted.ran(out, query_probes)
            # one path ran: its two FFN matmuls and its scores, or nothing at all when no token is kept
            assert (len(fcs), len(scores)) == ((2, 1) if rows else (0, 0)), (variant, kept, len(fcs), len(scores))
            assert all(int(np.prod(fc.shape[:-1])) == rows for fc in fcs), (variant, [fc.shape for fc in fcs], kept)
            assert all(s.shape[2] == rows for s in scores), (variant, [s.shape for s in scores], kept)  # (B, H, n, S)


# --- elastic attention: the head modes ----------------------------------------------------------------

@pytest.mark.parametrize("family", ["el", "eldec"])
@pytest.mark.parametrize("target", TARGETS)
def test_the_runtime_attends_sa_heads_block_local(artifacts, family, target, family_checkpoints, tmp_path,
                                                   monkeypatch):
    """Sparse: FA pairs score (N_fa, T, S), SA pairs (N_sa, blocks, Bq, sinks + L) with sinks + L < S,
    each count the decisions' own; dense: every head (B, H, T, S). An encoder's ONNX Runtime body
    runs its FA pairs in ONNX Runtime's fused kernel instead (where no key is padded): the kernel's
    output and keys, (N_fa, T, dh) and (N_fa, S, dh), count them. (ONNX Runtime bodies mask the SA
    pairs of a call this small instead of gathering them: exported here with that threshold at 0, so
    the tiny models' prefills take the sparse paths.)"""
    from adaptex.exporter.targets.onnx import bodies as fx
    from adaptex.graphs import checkpoint
    from adaptex.graphs.family import family_contract
    from tests.support import zoo

    model = artifacts.model(family)
    cfg, contract = model.cfg, family_contract(model)
    T = 48
    feeds = _prefill(T, contract, cfg.vocab_size, 4) if contract.decoder else _ids(T, cfg.vocab_size, 4)

    def export(variant):  # a prefill: an elastic decoder's general graph (a decode-step graph serves steps)
        if target != "onnx":
            return artifacts(family, target, variant)
        m, info = checkpoint.load(family_checkpoints / family)
        path = tmp_path / f"{family}.{variant}.onnx"
        if not path.exists():
            zoo.export(m, info, path, variant=variant, decode_graph="off", short_graph="off",
                       policy=OrtPolicy(mixed_call_masked_up_to=0))
        return path

    for variant in ("sparse", "dense"):
        proto = planted.general(export(variant))
        body = planted.function(proto, "ElasticAttention")
        fused = any(n.op_type == "MultiHeadAttention" for _, n in planted.walk(body.node))
        probes = planted.expose(proto, "ElasticAttention", "Softmax")
        out = planted.run(proto, feeds)
        kernel_runs = [[]] * len(probes)  # per call, the fused kernel's (output, keys) that ran
        if fused:  # the same run with the kernel's outputs and keys exposed (one op type a copy)
            kproto = planted.general(export(variant))
            kernels = planted.expose(kproto, "ElasticAttention", "MultiHeadAttention", rank=3)
            keys = planted.expose(kproto, "ElasticAttention", "MultiHeadAttention", rank=3, port=1)
            kout = planted.run(kproto, feeds)
            kernel_runs = [[(kout[o].shape, kout[kk].shape) for o, kk in zip(os_, ks_) if kout[o].size]
                           for os_, ks_ in zip(kernels, keys)]
        sa = _layers(out, "sa")
        assert any(m.any() for m in sa) and any((~m).any() for m in sa), "both modes should occur"
        for names, kernel, modes in zip(probes, kernel_runs, sa):
            # the probes that ran: a prefill never takes the decoder's one-token step branch, and
            # a layer with no FA (SA) pair leaves that Softmax empty
            shapes = [x.shape for x in planted.ran(out, names)]
            for o, kk in kernel:  # the fused kernel's runs (FA pairs over every key), as score shapes
                assert o[1] == kk[1] == T, kernel
                shapes.append((o[0], T, T))
            if variant == "dense":
                assert shapes == [(1, cfg.num_heads, T, T)]
                continue
            # FA: (N_fa, T, S) gathered pairs, or (B, H, T, S) where every pair of the call is FA
            whole = [s for s in shapes if len(s) == 4 and s[2:] == (T, T)]
            fa = [s for s in shapes if len(s) == 3] + [(s[0] * s[1], T, T) for s in whole]
            blocked = [s for s in shapes if len(s) == 4 and s not in whole]
            assert len(fa) <= 1 and len(blocked) <= 1 and shapes, shapes
            n_fa, n_sa = (fa[0][0] if fa else 0), (blocked[0][0] if blocked else 0)
            assert (n_fa, n_sa) == (int((~modes).sum()), int(modes.sum()))
            assert all(s[1:] == (T, T) for s in fa), shapes
            # O(T (sink + window)) scores, not T x T
            assert all(blocks * bq >= T and width < T for _, blocks, bq, width in blocked), shapes


# --- the MIL evaluator (Core ML) ----------------------------------------------------------------------

def _mil_feeds(feeds: dict) -> dict:
    return {k: v.astype(np.int32) for k, v in feeds.items()}


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_mil_program_never_reads_the_heads_not_selected(artifacts, variant):
    path = artifacts("bf", "coreml", variant, "fp32")
    feeds = _mil_feeds(_ids(24, 64, 0))
    want = MilReferenceRunner(path).infer(feeds)
    masks = _layers(want, "head_mask")
    assert any(not m.all() for m in masks)
    runner = MilReferenceRunner(path)  # its own copy of the program, poisoned in place
    fn = runner.program.functions["main"]
    gathers = [op for op in fn.operations if op.op_type == "gather" and op.inputs["x"].val is not None
               and op.inputs["x"].val.ndim == 3]  # the head-major weights, biases and output columns
    layers = list(dict.fromkeys(op.inputs["indices"].name for op in gathers))
    assert len(layers) == len(masks)
    for op in gathers:
        mask = masks[layers.index(op.inputs["indices"].name)]
        op.inputs["x"].val[~mask[0].astype(bool)] = np.nan
    got = runner.infer(feeds)
    if variant == "sparse":
        assert all(np.array_equal(got[n], want[n]) for n in want), "a poisoned head was read"
    else:
        assert not np.isfinite(got["logits"]).all()


def _shapes(path, feeds: dict) -> dict[str, tuple]:
    shapes = {}
    runner = MilReferenceRunner(path)
    coreml_mil.run(runner.program, coreml_mil.coreml_feeds(runner.meta, feeds),
                   on_op=lambda op, outs: shapes.__setitem__(op.name, outs[0].shape))
    return shapes, runner


def test_mil_program_attends_with_k_heads(artifacts):
    H = artifacts.model("bf").cfg.num_heads
    feeds = _mil_feeds(_ids(20, 64, 1))
    for variant in ("sparse", "dense"):
        shapes, runner = _shapes(artifacts("bf", "coreml", variant, "fp32"), feeds)
        ks = _layers(runner.infer(feeds), "k")
        heads = [s[1] for n, s in shapes.items() if n.endswith("_attn_softmax")]
        assert heads == [int(k[0]) if variant == "sparse" else H for k in ks], (variant, heads)


def test_mil_program_splits_heads_by_mode(artifacts):
    model = artifacts.model("el")
    T = 48
    feeds = _mil_feeds(_ids(T, model.cfg.vocab_size, 4))
    shapes, runner = _shapes(artifacts("el", "coreml", "sparse", "fp32"), feeds)
    sa = [m > 0.5 for m in _layers(runner.infer(feeds), "sa")]
    for li, modes in enumerate(sa):
        pre = "elastic_attention" + (f"_{li}" if li else "")
        # each group carries one spare pair (no zero-size tensor on Core ML), computed and dropped
        assert shapes[f"{pre}_sa_pairs"][0] == int(modes.sum()) + 1
        assert shapes[f"{pre}_fa_pairs"][0] == int((~modes).sum()) + 1
        assert shapes[f"{pre}_sa_loc_scores"][-1] < T and shapes[f"{pre}_fa_scores"][1:] == (T, T)
