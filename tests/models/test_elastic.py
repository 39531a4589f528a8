"""Elastic Attention: the op (eager, block-local SA, ONNX bodies), the routers on a frozen encoder,
training that leaves the backbone untouched, export and parity, and bad input."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from adaptex.graphs.ops.policy import OrtPolicy
from adaptex.cli import main
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.graphs import checkpoint
from adaptex.graphs.errors import AdaptexError, InputError
from adaptex.graphs.ops import elastic_attention as ea
from tests.support import zoo

CASES = [(2, 4, 16, 16), (2, 4, 1, 20), (1, 3, 5, 30), (3, 2, 40, 40)]  # (B, H, T new, S keys)


def _inputs(B, H, T, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, 8, generator=g) for n in (T, S, S))
    sa = torch.rand(B, H, generator=g) > 0.5
    km = torch.ones(B, S, dtype=torch.bool)
    km[0, :2] = False  # left padding in row 0
    return q, k, v, sa, km


def _real_rows(km, T, S):
    return km[:, S - T:][:, None, :, None]  # a padded query's row is ignored (it sees nothing)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sink,window", [(2, 4), (0, 6), (4, 64)])
def test_eager_kernel_matches_the_dense_reference(causal, sink, window):
    for B, H, T, S in CASES:
        q, k, v, sa, km = _inputs(B, H, T, S)
        got = ea.elastic_attention_eager(q, k, v, sa, km, sink, window, causal)
        ref = ea.elastic_attention_dense_reference(q, k, v, sa, km, sink, window, causal)
        assert ((got - ref) * _real_rows(km, T, S)).abs().max() < 1e-5


def test_block_local_layout_costs_sink_plus_window_per_query():
    Bq, idx, valid = ea.block_index(T=2048, S=2048, sink=4, window=64, causal=True)
    assert Bq == 64 and idx.shape == (32, 127)  # each block of 64 queries reads 127 keys, not 2048
    assert int(valid.sum(-1).max()) == 64  # a query's window: at most `window` keys
    Bq, idx, _ = ea.block_index(T=1, S=500, sink=4, window=64, causal=True)  # a decode step
    assert Bq == 1 and idx.shape == (1, 64) and int(idx.max()) == 499


def _function_model(variant, sink, window, causal, decode_step=True, fused=False, dispatch=True, masked_up_to=0):
    """One ElasticAttention call as a model: ONNX Runtime's body (dispatch: If nodes pick the path;
    decode_step: a step's own branch), or dispatch=False TensorRT's; fused: ONNX Runtime's encoder
    body (the call's causal flag known False at export, FA pairs through
    com.microsoft.MultiHeadAttention where unpadded). masked_up_to (policy.mixed_call_masked_up_to):
    0 (here) sends the small calls of these tests down the paths that gather pairs; None, the
    artifacts' policy (OrtPolicy())."""
    vi = lambda n, t: helper.make_tensor_value_info(n, t, None)  # noqa: E731
    node = helper.make_node("ElasticAttention", fx.EA_INPUTS, ["o"], domain="adaptex", sink=sink, window=window,
                            causal=int(causal))
    ins = [vi(n, TensorProto.BOOL if n in ("sa", "key_mask") else TensorProto.FLOAT) for n in fx.EA_INPUTS]
    body = fx.elastic_attention_function(variant, causal_known=False if fused else None, dispatch=dispatch,
                                         decode_step=decode_step, fused=fused,
                                         policy=OrtPolicy() if masked_up_to is None
                                         else OrtPolicy(mixed_call_masked_up_to=masked_up_to))
    return helper.make_model(helper.make_graph([node], "g", ins, [vi("o", TensorProto.FLOAT)]),
                             opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("adaptex", 1),
                                            helper.make_opsetid(fx.MS_DOMAIN, 1)],
                             functions=[body])


def _pairs(shape) -> tuple:
    """A probe's shape with the pairs it holds on one axis: (B, H, T, S) or (N, T, S) -> (pairs, T, S)."""
    return (int(np.prod(shape[:-2])), *shape[-2:])


def _function_session(variant, sink, window, causal, masked_up_to=0):
    return ort.InferenceSession(_function_model(variant, sink, window, causal, masked_up_to=masked_up_to)
                                .SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("variant, masked_up_to", [("sparse", 0), ("sparse", None), ("dense", 0)])
@pytest.mark.parametrize("causal", [True, False])
def test_onnx_bodies_match_the_reference_for_any_mix_of_modes(variant, masked_up_to, causal):
    """Every path: the dense body, the sparse one gathering pairs by mode (masked_up_to=0), and the
    sparse one as artifacts have it, whose small calls mask instead."""
    sess = _function_session(variant, 2, 6, causal, masked_up_to)
    for B, H, T, S in CASES:
        q, k, v, sa, km = _inputs(B, H, T, S, seed=1)
        for modes in (sa, torch.zeros_like(sa), torch.ones_like(sa)):
            ref = ea.elastic_attention_dense_reference(q, k, v, modes, km, 2, 6, causal)
            got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": modes.numpy(),
                                  "key_mask": km.numpy()})[0]
            assert np.abs((got - ref.numpy()) * _real_rows(km, T, S).numpy()).max() < 1e-5


@pytest.mark.parametrize("sink,window", [(2, 6), (0, 3), (4, 64), (3, 1)])
def test_onnx_encoder_body_matches_the_reference(sink, window):
    """ONNX Runtime's encoder body (fused kernel for FA and SA pairs) against the reference, for
    any mix of modes, padded keys, calls shorter than a block and a last block cut short."""
    proto = _function_model("sparse", sink, window, False, fused=True)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for B, H, T, S in CASES + [(2, 3, 1, 1), (1, 2, 65, 65)]:
        q, k, v, sa, km = _inputs(B, H, T, S, seed=3)
        for modes in (sa, torch.zeros_like(sa), torch.ones_like(sa)):
            ref = ea.elastic_attention_dense_reference(q, k, v, modes, km, sink, window, False)
            got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": modes.numpy(),
                                  "key_mask": km.numpy()})[0]
            assert np.abs((got - ref.numpy()) * _real_rows(km, T, S).numpy()).max() < 1e-5, (B, H, T, S, modes)


@pytest.mark.parametrize("sink,window", [(2, 6), (0, 3), (4, 64), (3, 1)])
def test_onnx_decode_step_reads_sinks_and_window_only(sink, window):
    """A decode step (T = 1, causal) takes the sparse body's step branch: the same output as the
    reference for caches shorter and longer than sink + window, with padded keys, and its SA pairs'
    scores are (N_sa, 1, L) with L = min(sink, S) + the window's keys past them, not S. A step whose
    pairs are all FA or all SA takes a branch of its own (no gather of pairs, no scatter), and so
    does a step whose cache lies within sink + window (the FA branch: SA sees every key there)."""
    from tests.support import planted

    proto = _function_model("sparse", sink, window, True)
    # the general body's probes (else branch: mixed FA and SA, all FA, all SA) come first, then the
    # step's, in the same order (a whole call's pairs as they are, (B, H, 1, keys))
    (*general, mixed_fa, mixed_sa, every_fa, every_sa), = planted.expose(proto, "ElasticAttention", "Softmax", rank=3)
    assert len(general) == 4
    for B, H, S in ((2, 4, 1), (1, 3, 5), (2, 2, 40)):
        q, k, v, sa, km = _inputs(B, H, 1, S, seed=S)
        for modes in (sa, torch.zeros_like(sa), torch.ones_like(sa)):
            ref = ea.elastic_attention_dense_reference(q, k, v, modes, km, sink, window, True)
            out = planted.run(proto, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": modes.numpy(),
                                      "key_mask": km.numpy()})
            assert np.abs((out["o"] - ref.numpy()) * _real_rows(km, 1, S).numpy()).max() < 1e-5, (B, H, S, modes)
            n_sa = int(modes.sum())
            width = min(sink, S) + S - max(S - window, min(sink, S))
            assert width <= min(S, sink + window) and not planted.ran(out, general)
            ran = {p for p in (mixed_fa, mixed_sa, every_sa, every_fa) if out[p].size}
            if S <= sink + window:  # SA sees every key FA sees: the FA branch for any modes
                n_sa = 0
            fa, sa = (every_fa, None) if n_sa == 0 else (None, every_sa) if n_sa == B * H else (mixed_fa, mixed_sa)
            assert ran == {fa, sa} - {None}, (B, H, S, modes)
            if fa:
                assert _pairs(out[fa].shape) == (B * H - n_sa, 1, S)
            if sa:
                assert _pairs(out[sa].shape) == (n_sa, 1, width)


@pytest.mark.parametrize("causal", [True, False])
def test_onnx_calls_of_one_mode_take_their_own_body(causal):
    """ONNX Runtime bodies (T > 1): a call whose pairs are all FA attends in place, one all SA runs
    the block-local body on every pair, and only a mix splits the pairs (NonZero, gathers,
    ScatterND); each gives the reference's output."""
    from tests.support import planted

    proto = _function_model("sparse", 2, 6, causal)
    probes, = planted.expose(proto, "ElasticAttention", "Softmax", rank=3)
    # else branches first: the general body (mixed FA, mixed SA), then all FA, all SA (then the
    # causal step branch's four, which a call with T > 1 never takes)
    mixed_fa, mixed_sa, every_fa, every_sa = probes[:4]
    B, H, T, S = 2, 3, 20, 20
    q, k, v, sa, km = _inputs(B, H, T, S, seed=3)
    sa[0, 0], sa[0, 1] = True, False  # a mix
    for modes, fa_probe, sa_probe in ((sa, mixed_fa, mixed_sa), (torch.zeros_like(sa), every_fa, None),
                                      (torch.ones_like(sa), None, every_sa)):
        ref = ea.elastic_attention_dense_reference(q, k, v, modes, km, 2, 6, causal)
        out = planted.run(proto, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": modes.numpy(),
                                  "key_mask": km.numpy()})
        assert np.abs((out["o"] - ref.numpy()) * _real_rows(km, T, S).numpy()).max() < 1e-5
        assert {p for p in probes if out[p].size} == {fa_probe, sa_probe} - {None}, modes
        n_sa = int(modes.sum())
        if fa_probe:
            assert _pairs(out[fa_probe].shape) == (B * H - n_sa, T, S)
        if sa_probe:
            assert out[sa_probe].shape[0] == n_sa


@pytest.mark.parametrize("causal", [True, False])
def test_onnx_calls_whose_keys_all_lie_in_the_window_take_the_fa_body(causal):
    """ONNX Runtime bodies: where an SA query's sinks and window cover every key (causal: S <= sink +
    window; encoder: S - 1 <= window // 2), SA sees what FA sees, so a call of any modes runs the
    plain FA body on every pair; one key more and a mixed call splits its pairs again. The output
    is the reference's on both sides of the boundary, prefill and (causal) decode step."""
    from tests.support import planted

    sink, window = 2, 6
    proto = _function_model("sparse", sink, window, causal)
    probes, = planted.expose(proto, "ElasticAttention", "Softmax", rank=3)
    limit = sink + window if causal else window // 2 + 1  # the largest S whose keys SA sees all of
    for S, T in ((limit, limit), (limit + 1, limit + 1)) + (((limit, 1), (limit + 1, 1)) if causal else ()):
        q, k, v, sa, km = _inputs(2, 3, T, S, seed=S + T)
        sa[0, 0], sa[0, 1] = True, False  # a mix
        ref = ea.elastic_attention_dense_reference(q, k, v, sa, km, sink, window, causal)
        out = planted.run(proto, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": sa.numpy(),
                                  "key_mask": km.numpy()})
        assert np.abs((out["o"] - ref.numpy()) * _real_rows(km, T, S).numpy()).max() < 1e-5, (S, T)
        ran = [out[p].shape for p in probes if out[p].size]
        ran = [_pairs(r) if r[-2:] == (T, S) else r for r in ran]  # FA: the pairs on one axis
        if S == limit:  # one softmax over every pair: the FA body
            assert ran == [(6, T, S)], (S, T, ran)
        else:  # the mix splits: an FA group and an SA group
            assert len(ran) == 2 and ran[0][0] + ran[1][0] == 6, (S, T, ran)


@pytest.mark.parametrize("causal", [True, False])
def test_onnx_small_calls_with_sa_pairs_mask_instead_of_gathering(causal):
    """A call with SA pairs and at most policy.mixed_call_masked_up_to scores a sample (H T S, whatever the
    batch) attends every pair over every key as it is, the SA pairs' keys outside their reach masked
    (one (B, H, T, S) softmax, no gather): the reference's output, all SA or mixed; past the
    threshold it gathers again."""
    from tests.support import planted

    sink, window = 2, 6
    B, H, T = 2, 3, 20
    for up_to, gathers in ((H * T * T, False), (H * T * T - 1, True)):
        proto = _function_model("sparse", sink, window, causal, decode_step=False, masked_up_to=up_to)
        probes, = planted.expose(proto, "ElasticAttention", "Softmax", rank=3)
        q, k, v, sa, km = _inputs(B, H, T, T, seed=5)
        sa[0, 0], sa[0, 1] = True, False  # a mix
        for modes in (sa, torch.ones_like(sa)):
            ref = ea.elastic_attention_dense_reference(q, k, v, modes, km, sink, window, causal)
            out = planted.run(proto, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": modes.numpy(),
                                      "key_mask": km.numpy()})
            assert np.abs((out["o"] - ref.numpy()) * _real_rows(km, T, T).numpy()).max() < 1e-5, (up_to, modes)
            ran = [out[p].shape for p in probes if out[p].size]
            assert (ran != [(B, H, T, T)]) == gathers, (up_to, ran)


def test_onnx_encoder_calls_also_mask_where_masking_adds_few_scores():
    """An encoder's body (causal known False) also attends every pair masked where the scores masking
    adds over block-local SA, B H T (T - sink - 2 window), fit policy.masked_excess_up_to, though H T T
    is past policy.mixed_call_masked_up_to; one score past that bound it gathers. The reference's
    output either way, as call_runs_masked says."""
    from adaptex.graphs.ops.elastic_attention import call_runs_masked
    from tests.support import planted

    sink, window = 2, 4
    B, H, T = 2, 3, 24
    excess = B * H * T * (T - sink - 2 * window)
    q, k, v, sa, km = _inputs(B, H, T, T, seed=7)
    sa[0, 0], sa[0, 1] = True, False  # a mix

    def runs(masks: bool, policy) -> None:  # the reference's output, by the path call_runs_masked names
        assert call_runs_masked(B, H, T, sink, window, policy=policy) == masks
        vi = lambda n, t: helper.make_tensor_value_info(n, t, None)  # noqa: E731
        node = helper.make_node("ElasticAttention", fx.EA_INPUTS, ["o"], domain="adaptex", sink=sink, window=window,
                                causal=0)
        ins = [vi(n, TensorProto.BOOL if n in ("sa", "key_mask") else TensorProto.FLOAT) for n in fx.EA_INPUTS]
        body = fx.elastic_attention_function("sparse", causal_known=False, dispatch=True, decode_step=False,
                                             fused=True, policy=policy)
        proto = helper.make_model(helper.make_graph([node], "g", ins, [vi("o", TensorProto.FLOAT)]),
                                  opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("adaptex", 1),
                                                 helper.make_opsetid(fx.MS_DOMAIN, 1)], functions=[body])
        probes, = planted.expose(proto, "ElasticAttention", "Softmax", rank=3)
        out = planted.run(proto, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": sa.numpy(),
                                  "key_mask": km.numpy()})
        ref = ea.elastic_attention_dense_reference(q, k, v, sa, km, sink, window, False)
        assert np.abs((out["o"] - ref.numpy()) * _real_rows(km, T, T).numpy()).max() < 1e-5, policy
        ran = [out[p].shape for p in probes if out[p].size]
        assert (ran == [(B, H, T, T)]) == masks, (policy, ran)

    for bound, masks in ((excess, True), (excess - 1, False)):  # per sample past the plain rule
        runs(masks, OrtPolicy(mixed_call_masked_up_to=H * T * T - 1, masked_excess_up_to=bound))


def test_onnx_encoder_pairs_run_ort_fused_attention(artifacts):
    """ONNX Runtime's encoder body runs the FA pairs of a call with no padded key in ONNX Runtime's
    fused kernel (com.microsoft.MultiHeadAttention) over every key (the plain body where a key is
    padded); the SA pairs, padded or not, stay block-local outside it (the kernel's band mask would
    send its exp through subnormal floats): one Softmax over (pairs, blocks, Bq = min(window, T),
    sinks + Bq + window). Both give the reference's output. Only encoder bodies on ONNX Runtime
    hold the kernel: decoders (their dense yardstick has no fused attention) and TensorRT-bound
    bodies never do."""
    from tests.support import planted

    sink, window = 2, 6
    proto = _function_model("sparse", sink, window, False, fused=True)
    outs, = planted.expose(proto, "ElasticAttention", "MultiHeadAttention", rank=3)
    keys, = planted.expose(proto, "ElasticAttention", "MultiHeadAttention", rank=3, port=1)
    softmaxes, = planted.expose(proto, "ElasticAttention", "Softmax", rank=4)
    B, H, T = 2, 3, 20
    Bq, width = window, sink + window + 2 * (window // 2)
    blocks = -(-T // Bq)
    for padded in (False, True):
        q, k, v, sa, km = _inputs(B, H, T, T, seed=7)
        if not padded:
            km[:] = True
        for modes in (sa, torch.zeros_like(sa), torch.ones_like(sa)):
            ref = ea.elastic_attention_dense_reference(q, k, v, modes, km, sink, window, False)
            out = planted.run(proto, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": modes.numpy(),
                                      "key_mask": km.numpy()})
            assert np.abs((out["o"] - ref.numpy()) * _real_rows(km, T, T).numpy()).max() < 1e-5, (padded, modes)
            fa = [(out[o].shape, out[kk].shape) for o, kk in zip(outs, keys) if out[o].size]
            sa_runs = [out[p].shape for p in softmaxes if out[p].size and out[p].shape[2:] == (Bq, width)]
            n_sa = int(modes.sum())
            # FA pairs in the kernel over all T keys, unpadded calls only; SA pairs as blocks of `width` keys
            assert sum(o[0] for o, _ in fa) == (0 if padded else B * H - n_sa), (padded, fa)
            assert all(o[1] == kk[1] == T for o, kk in fa), fa
            assert sum(s[0] for s in sa_runs) == n_sa and all(s[1] == blocks for s in sa_runs), (padded, sa_runs)

    def has_kernel(body) -> bool:
        return any(n.op_type == "MultiHeadAttention" for _, n in planted.walk(body.node))
    for name, target, expected in (("el", "onnx", True), ("el", "tensorrt", False),
                                   ("eldec", "onnx", False)):
        body = planted.function(planted.load(artifacts(name, target, "sparse")), "ElasticAttention")
        assert has_kernel(body) == expected, (name, target)


def test_tensorrt_bodies_have_no_decode_step_branch(artifacts):
    """TensorRT before 10.6 wants an If's branches to give equal shapes; the step branch gives
    (BH, 1, dh) against (BH, T, dh), so the TensorRT-bound body is the general one alone, with no If
    at all (it computes a decode step too), and the ONNX Runtime body (of an artifact without a
    decode-step graph) holds the step If at its top."""
    from tests.support import planted

    for target, ifs, options in (("tensorrt", 0, {}), ("onnx", 1, {"decode_graph": "off", "short_graph": "off"})):
        proto = planted.load(artifacts("eldec", target, "sparse", **options))
        body = planted.function(proto, "ElasticAttention")
        assert sum(n.op_type == "If" for n in body.node) == ifs, target
    assert not any(n.op_type == "If" for _, n in planted.walk(
        planted.function(planted.load(artifacts("eldec", "tensorrt", "sparse")), "ElasticAttention").node))
    q, k, v, sa, km = _inputs(2, 3, 1, 20, seed=1)
    ref = ea.elastic_attention_dense_reference(q, k, v, sa, km, 2, 5, True)
    sess = ort.InferenceSession(_function_model("sparse", 2, 5, True, decode_step=False, dispatch=False).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "sa": sa.numpy(), "key_mask": km.numpy()})[0]
    assert np.abs((got - ref.numpy()) * _real_rows(km, 1, 20).numpy()).max() < 1e-5


# --- the model ------------------------------------------------------------------------------------

def test_router_pools_first_and_last_real_tokens():
    r = ea_router = __import__("adaptex.graphs.elastic", fromlist=["HeadRouter"]).HeadRouter(2, 4, 8, pool_tokens=2)
    k = torch.arange(6, dtype=torch.float32)[None, None, :, None].expand(1, 2, 6, 4)  # key j = j
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # 5 real tokens
    pooled = r.pool(k, mask)  # first 2 real: mean 0.5; last 2 real (3, 4): mean 3.5; padding ignored
    assert torch.allclose(pooled[0, 0], torch.tensor([0.5] * 4 + [3.5] * 4))
    assert ea_router(k, mask).shape == (1, 2, 2)


def test_training_moves_only_the_routers():
    from adaptex.graphs.elastic import ElasticTrainConfig, train_elastic

    model = zoo.tiny_elastic()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    class Tok:  # random token batches stand in for text
        def encode(self, texts, max_length=None):
            ids = torch.randint(1, 64, (len(texts), 24))
            return ids, torch.ones_like(ids)

    class Text:
        def sample(self, n, rng, split="train", join=3):
            return ["x"] * n

    train_elastic(model, Tok(), Text(), ElasticTrainConfig(steps=4, batch_size=4, lr=1e-2))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("backbone."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("routers."))
    assert all(not p.requires_grad for p in model.backbone.parameters())


@pytest.fixture(scope="module")
def elastic_ckpt(family_checkpoints):
    return family_checkpoints / "el"


def _checked(capsys, path) -> dict:
    """`adaptex check` of an artifact over 40 inputs: passed, no unexcused flip, decisions that vary."""
    capsys.readouterr()
    assert main(["check", str(path), "--samples", "40", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and r["unexcused_flips"] == 0 and r["decisions_vary"]
    return r


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_export_and_parity(artifacts, capsys, variant):
    out = artifacts("el", "onnx", variant)
    r = _checked(capsys, out)
    seen = r["decisions"]["decisions.layer0.sa"]["values_seen"]
    assert seen["SA"] > 0 and seen["FA"] > 0


@pytest.mark.parametrize("up_to", [None] + [pytest.param(u, marks=pytest.mark.slow) for u in (0, "excess")])
def test_onnx_encoder_layers_read_what_they_derive_alike_from_one_computation(elastic_ckpt, tmp_path, capsys, up_to):
    """An encoder's ONNX Runtime calls read what every layer derives alike from the key mask
    (fx.ENCODER_SHARED: the reach and padding tests, the pairs' key mask, a masked call's bias planes)
    as inputs that the graph computes once; the artifact passes parity with its small calls masked
    (the default threshold), with every call gathering pairs by mode (the threshold at 0), and with
    every call masked by the encoder's second test alone (masking adds few scores: "excess")."""
    import onnx

    model, info = checkpoint.load(elastic_ckpt)
    if up_to == "excess":  # no call masks per sample, every call by the second test
        policy = OrtPolicy(mixed_call_masked_up_to=1, masked_excess_up_to=1 << 40)
    else:
        policy = OrtPolicy() if up_to is None else OrtPolicy(mixed_call_masked_up_to=up_to)
    path = tmp_path / "el.onnx"
    zoo.export(model, info, path, policy=policy)
    graph = onnx.load(path).graph
    calls = [n for n in graph.node if n.op_type == "ElasticAttention"]
    shared = {tuple(n.input[len(fx.EA_INPUTS):]) for n in calls}
    assert len(calls) > 1 and len(shared) == 1, shared
    names, = shared
    step, encoder = names[:len(fx.STEP_SHARED)], names[len(fx.STEP_SHARED):]  # a decode step's, left empty
    assert step == ("",) * len(fx.STEP_SHARED) and len(encoder) == len(fx.ENCODER_SHARED) and all(encoder)
    producer = {o: n for n in graph.node for o in n.output}
    todo, made = list(encoder), {}
    while todo:  # what the shared inputs are computed from
        n = producer.get(todo.pop())
        if n is not None and n.name not in made:
            made[n.name] = n
            todo += list(n.input)
    assert sum(n.op_type == "Range" for n in made.values()) == 3  # query and key positions, samples: once
    # the profile counts them as the op's work: only nodes computing the shared inputs, the Ranges among them
    from adaptex.exporter.targets.onnx import passes

    proto = onnx.load(path)
    passes.name_op_nodes(proto)
    marked = {o for n in proto.graph.node if n.name.startswith(passes.OP_NODE) for o in n.output}
    assert marked <= {o for n in made.values() for o in n.output}
    assert {o for n in made.values() if n.op_type == "Range" for o in n.output} <= marked
    # which path a call of 2 unpadded samples of T = 20 took: masked, every pair's (B, H, T, S) Softmax
    from tests.support import planted

    probed = onnx.load(path)
    probes = planted.expose(probed, "ElasticAttention", "Softmax", rank=4)
    rng = np.random.default_rng(0)
    out = planted.run(probed, {"input_ids": rng.integers(1, model.cfg.vocab_size, (2, 20)),
                               "attention_mask": np.ones((2, 20), np.int64)})
    H = np.asarray(out["decisions.layer0.sa"]).shape[-1]
    masked = [[out[p].shape for p in call if out[p].size] == [(2, H, 20, 20)] for call in probes]
    assert masked == [up_to != 0] * len(calls), masked
    _checked(capsys, path)


@pytest.mark.parametrize("sink,window", [(3, 1)] + [pytest.param(*c, marks=pytest.mark.slow) for c in ((0, 3), (4, 64))])
def test_onnx_encoder_block_local_passes_parity_for_any_sink_and_window(tmp_path, capsys, sink, window):
    """An encoder's artifact, its calls reading what every layer derives alike (fx.ENCODER_SHARED),
    with SA pairs block-local in every call (the masked threshold at 0): no sink and an odd window, a
    window of one (no key beside the query's own) and a window wider than most calls (one block, a
    call shorter than it). It passes `adaptex check` over prompts of many lengths, padded and not."""
    checkpoint.save(tmp_path / "ck", zoo.tiny_elastic(sink=sink, window=window), {"description": "blocks"})
    model, info = checkpoint.load(tmp_path / "ck")
    path = tmp_path / "el.onnx"
    zoo.export(model, info, path, policy=OrtPolicy(mixed_call_masked_up_to=0))
    _checked(capsys, path)


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_tensorrt_bound_onnx_lints_and_passes(artifacts, capsys, variant):
    import onnx

    from adaptex.exporter.targets.tensorrt import rules as tensorrt_rules

    out = artifacts("el", "tensorrt", variant)
    assert tensorrt_rules.lint(onnx.load(str(out))) == []
    capsys.readouterr()
    assert main(["check", str(out), "--samples", "24"]) == 0


def test_bad_input(elastic_ckpt, tmp_path):
    model, _ = checkpoint.load(elastic_ckpt)
    with pytest.raises(InputError, match="truncate"):
        model(torch.ones(1, 65, dtype=torch.long), torch.ones(1, 65, dtype=torch.long))
    cfg = json.loads((elastic_ckpt / "config.json").read_text())
    cfg["config"]["backbone"] = "gpt2"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((elastic_ckpt / "model.safetensors").read_bytes())
    with pytest.raises(AdaptexError, match="unknown elastic backbone 'gpt2'"):
        checkpoint.load(bad)


def test_train_cli_refuses_unknown_backbones(tmp_path, capsys):
    assert main(["train", "elastic", "--backbone", "gpt2", "-o", str(tmp_path / "x")]) == 2
    assert "unknown backbone 'gpt2'" in capsys.readouterr().err
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "weights.bin").write_bytes(b"\x00")
    assert main(["train", "elastic", "--backbone", str(odd), "-o", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "unknown backbone format" in err and "config.json" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_training_on_the_packaged_minilm_records_no_machine_path(tmp_path, capsys):
    """The packaged backbone lies where pip put it, which differs per machine: a checkpoint records
    the package, not this machine's site-packages path (a directory backbone records its path:
    tests/models/test_hf.py)."""
    from adaptex.graphs.recipes.elastic import MINILM_RECORD

    out = tmp_path / "routers"
    assert main(["train", "elastic", "--backbone", "minilm", "--steps", "1", "--batch-size", "2", "--max-tokens", "16",
                 "--eval-size", "4", "-o", str(out)]) == 0
    info = json.loads((out / "config.json").read_text())
    assert info["training"]["backbone"]["path"] == MINILM_RECORD and info["config"]["backbone_path"] == ""
    assert info["training"]["backbone"]["sha256"] == info["config"]["backbone_sha256"]
