"""Elastic Attention on the dense decoder adaptex trains (charlm-dense): head modes routed once at
prefill and reused by decode steps, one graph for both, training that leaves the backbone untouched,
export to every target with parity, the CLI path from a dense checkpoint, bench, and bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adaptex.cli import main
from adaptex.exporter.trace import adaptex_nodes, trace
from adaptex.graphs.family import family_contract
from adaptex.graphs import checkpoint
from adaptex.graphs.elastic_decoder import attention_flops
from adaptex.graphs.recipes.elastic_decoder import ElasticDecoderTrainConfig, train_elastic_decoder
from adaptex.graphs.errors import InputError
from tests.support import zoo


@pytest.fixture(scope="module")
def model():
    return zoo.tiny_elastic_decoder()


@pytest.fixture(scope="module")
def ckpt(family_checkpoints):
    return family_checkpoints / "eldec"  # zoo.tiny_elastic_decoder(), as `model`


def _ids(B=3, T=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :9] = 0  # left padding
    return ids * mask, mask


@torch.no_grad()
def test_full_mode_is_the_backbone_and_all_fa_matches_it(model):
    ids, mask = _ids()
    full, dec, _ = model(ids, mask, mode="full")
    dense, _, _ = model.backbone(ids, mask, mode="dense")
    assert dec == [] and torch.equal(full, dense)
    fa = [torch.zeros(3, 4, dtype=torch.bool)] * 2
    hard, _, _ = model(ids, mask, mode="hard", force_sa=fa)
    assert (hard - full)[mask.bool()].abs().max() < 1e-5


@torch.no_grad()
def test_modes_vary_and_the_op_matches_the_dense_reference(model):
    ids, mask = _ids(B=16, T=60, seed=1)
    hard, dec, _ = model(ids, mask, mode="hard")
    ref, _, _ = model(ids, mask, mode="hard_dense")
    sa = torch.stack([d["sa"] for d in dec])
    assert 0 < sa.float().mean() < 1
    assert (hard - ref)[mask.bool()].abs().max() < 1e-5


@torch.no_grad()
def test_decode_steps_reuse_the_prefill_modes(model):
    ids, mask = _ids(B=3, T=50, seed=2)
    logits, dec, past = model(ids[:, :40], mask[:, :40])
    modes = [d["sa"] for d in dec]
    steps = []
    for t in range(40, 50):
        # a decode step takes the modes as given, whatever its own routers would say
        lt, dt, past = model(ids[:, t:t + 1], mask[:, :t + 1], past=past, head_modes=modes)
        assert all(torch.equal(a["sa"], m) for a, m in zip(dt, modes))
        # the routers do not run: a step's logits are the given modes one-hot ([1, 0] FA, [0, 1] SA)
        assert all(torch.equal(a["logits"], torch.stack([~m, m], -1).float()) for a, m in zip(dt, modes))
        steps.append(lt[:, -1])
    whole, _, _ = model(ids, mask, force_sa=modes)
    assert (torch.stack(steps, 1) - whole[:, 40:]).abs().max() < 1e-5
    # at prefill the head_modes input is ignored
    flipped = [~m for m in modes]
    again, dec2, _ = model(ids[:, :40], mask[:, :40], head_modes=flipped)
    assert torch.equal(again, logits) and all(torch.equal(a["sa"], m) for a, m in zip(dec2, modes))


def test_training_moves_only_the_routers():
    model = zoo.tiny_elastic_decoder(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    class Task:
        def sample(self, n, rng):
            from adaptex.graphs.lm_tasks import LMBatch

            ids = torch.from_numpy(rng.integers(1, 40, size=(n, 33)))
            return LMBatch(ids[:, :-1], ids[:, 1:], torch.ones(n, 32, dtype=torch.bool), torch.ones(n, 32, dtype=torch.long))

    train_elastic_decoder(model, Task(), ElasticDecoderTrainConfig(steps=4, batch_size=4, context=32, lr=1e-2))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("backbone."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("routers."))


def test_one_traced_graph_serves_prefill_and_decode(model):
    ep = trace(model)
    assert len(adaptex_nodes(ep)) == model.cfg.num_layers  # one elastic_attention node per layer
    contract = family_contract(model)
    ins, outs = contract.input_names(), contract.output_names()
    assert ins[-2:] == ["head_modes.0", "head_modes.1"] and "past_key_values.1.value" in ins
    assert outs[-4:] == ["decisions.layer0.sa", "decisions.layer0.logits", "decisions.layer1.sa", "decisions.layer1.logits"]


def test_a_decode_step_runs_no_router(artifacts, model):
    """In an ONNX Runtime artifact's general graph each layer's router sits in the else branch of an
    If on the cache (torch.cond): a prefill runs it, a decode step runs none of it (its MatMuls'
    probes come back empty) and gives the fed modes one-hot as its logits, as eager does (the
    decode-step graph an artifact holds by default has no router at all: tests/targets/test_decode_graph.py).
    TensorRT-bound graphs compute both and select (no If in their main graph)."""
    from tests.support import planted

    proto = planted.general(artifacts("eldec", decode_graph="off", short_graph="off"))
    assert sum(n.op_type == "If" for n in proto.graph.node) == model.cfg.num_layers
    probes = planted.expose_branches(proto, "MatMul")
    L, H, dh = model.cfg.num_layers, model.cfg.num_heads, model.cfg.head_dim
    ids, mask = _ids(B=2, T=30, seed=4)
    feeds = {"input_ids": ids[:, :29].numpy(), "attention_mask": mask[:, :29].numpy(),
             **{f"past_key_values.{i}.{kv}": np.zeros((2, H, 0, dh), np.float32) for i in range(L) for kv in ("key", "value")},
             **{f"head_modes.{i}": np.zeros((2, H), bool) for i in range(L)}}
    out = planted.run(proto, feeds)
    assert planted.ran(out, probes) and len(planted.ran(out, probes)) == len(probes)  # every router ran
    modes = {f"head_modes.{i}": out[f"decisions.layer{i}.sa"] for i in range(L)}
    feeds = {"input_ids": ids[:, 29:].numpy(), "attention_mask": mask.numpy(), **modes,
             **{f"past_key_values.{i}.{kv}": out[f"present.{i}.{kv}"] for i in range(L) for kv in ("key", "value")}}
    step = planted.run(proto, feeds)
    assert planted.ran(step, probes) == []  # no router ran
    for i in range(L):
        m = modes[f"head_modes.{i}"]
        assert np.array_equal(step[f"decisions.layer{i}.sa"], m)
        assert np.array_equal(step[f"decisions.layer{i}.logits"], np.stack([~m, m], -1).astype(np.float32))
    trt = planted.load(artifacts("eldec", "tensorrt"))
    assert not any(n.op_type == "If" for n in trt.graph.node)


@pytest.mark.parametrize("target,variant,suffix", [("onnx", "sparse", ".onnx"), ("onnx", "dense", ".onnx"),
                                                   ("tensorrt", "sparse", ".trt.onnx"), ("coreml", "sparse", ".mlpackage"),
                                                   ("coreml", "dense", ".mlpackage")])
def test_export_and_parity_on_every_target(artifacts, capsys, target, variant, suffix):
    out = artifacts("eldec", target, variant)
    assert out.name.endswith(suffix)
    capsys.readouterr()
    assert main(["check", str(out), "--samples", "24", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["passed"] and r["unexcused_flips"] == 0 and r["decisions_vary"]
    seen = r["decisions"]["decisions.layer0.sa"]["values_seen"]
    assert seen["SA"] > 0 and seen["FA"] > 0
    if target == "tensorrt":
        import onnx

        from adaptex.exporter.targets.tensorrt import rules as tensorrt_rules

        assert tensorrt_rules.lint(onnx.load(str(out))) == []


@pytest.mark.slow
def test_bench_times_elastic_against_full_attention(artifacts, capsys):
    out = artifacts("eldec")
    capsys.readouterr()
    assert main(["bench", str(out), "--seq", "96", "--runs", "3", "--warmup", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert 0 < r["sa_fraction"] < 1 and r["dense_p50_ms"] > 0 and 0 < r["flop_ratio"] < 1
    assert main(["bench", str(out), "--seq", "1", "--past", "64", "--runs", "3", "--warmup", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["past"] == 64 and r["p50_ms"] > 0


def test_attention_flops_count_sa_heads_at_sink_plus_window(model):
    cfg = model.cfg
    L, H = cfg.num_layers, cfg.num_heads
    el, full = attention_flops(cfg, np.zeros((L, H), bool), 100)
    assert el == full
    el, full = attention_flops(cfg, np.ones((L, H), bool), 100)
    ctx = np.arange(1, 101)
    saved = L * H * 2 * cfg.head_dim * (ctx.sum() - np.minimum(ctx, cfg.sink + cfg.window).sum())
    assert full - el == pytest.approx(saved)


def test_bad_input(model, artifacts):
    with pytest.raises(InputError, match="exceed the decoder's 128 positions"):
        model(torch.ones(1, 129, dtype=torch.long))
    from adaptex.runtimes.open import open_artifact

    runner = open_artifact(artifacts("eldec"))
    H, dh = model.cfg.num_heads, model.cfg.head_dim
    feeds = {"input_ids": np.ones((1, 130), np.int64), "attention_mask": np.ones((1, 130), np.int64),
             **{f"past_key_values.{i}.{kv}": np.zeros((1, H, 0, dh), np.float32) for i in range(2) for kv in ("key", "value")},
             **{f"head_modes.{i}": np.zeros((1, H), bool) for i in range(2)}}
    with pytest.raises(InputError, match="exceeds the KV cache bound 128"):
        runner.infer(feeds)


def test_cli_trains_a_dense_backbone_then_its_routers(tmp_path, capsys):
    dense, el = tmp_path / "dense", tmp_path / "el"
    assert main(["train", "tsa", "--task", "charlm", "--dense", "--d-model", "32", "--heads", "4", "--layers", "2",
                 "--d-ff", "64", "--steps", "3", "--max-tokens", "96", "--max-len", "256", "--eval-size", "4",
                 "-o", str(dense)]) == 0
    # a dense decoder can start from a trained decoder's weights (here the one just written)
    again = tmp_path / "again"
    assert main(["train", "tsa", "--task", "charlm", "--dense", "--init", str(dense), "--d-model", "32", "--heads", "4",
                 "--layers", "2", "--d-ff", "64", "--steps", "2", "--max-tokens", "96", "--max-len", "256",
                 "--eval-size", "4", "-o", str(again)]) == 0
    assert json.loads((again / "config.json").read_text())["training"]["init"] == str(dense)
    assert main(["train", "elastic", "--backbone", str(dense), "--steps", "2", "--batch-size", "2",
                 "--eval-size", "4", "--window", "16", "-o", str(el)]) == 0
    out = capsys.readouterr().out
    assert "SA heads:" in out and "next-character loss" in out
    m, info = checkpoint.load(el)
    assert info["family"] == "elastic_decoder" and m.cfg.window == 16 and m.cfg.max_len == 256
    # a TSA checkpoint (routers of its own) is not a backbone
    tsa = tmp_path / "tsa"
    checkpoint.save(tsa, zoo.tiny_tsa(), {"training": {"task": "copy"}})
    assert main(["train", "elastic", "--backbone", str(tsa), "-o", str(tmp_path / "x")]) == 2
    assert "needs a dense decoder" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_generation_example_matches_eager_greedy_decoding(ckpt, artifacts):
    from examples.tsa_generate import Generator
    from adaptex.graphs.elastic_decoder import generate

    out = artifacts("eldec")
    loaded, _ = checkpoint.load(ckpt)
    gen = Generator(str(out))
    for prompt in ([1, 5, 9, 4, 2] * 8, [3] * 50, [7]):
        ids, sa = gen.generate(prompt, 20)
        assert ids == generate(loaded, prompt, 20)
        assert len(set(sa)) == 1  # the modes are fixed at prefill


@pytest.mark.parametrize("T, pad", [(10, 0), (7, 3), (1, 0)])
def test_within_reach_every_head_attends_as_the_op_does(T, pad):
    """Where every key lies within an SA query's sinks and window (a prefill of at most sink +
    window tokens), the short-call program's dense attention (ElasticAttention.attend_within_reach,
    one bias for every layer) gives what the op gives on every real query, and the same decisions."""
    from adaptex.graphs.elastic_decoder import _dense_bias
    from adaptex.graphs.nn import ElasticAttention

    torch.manual_seed(0)
    layer = ElasticAttention(4, 8, sink=2, window=8, causal=True, router_hidden=16, pool_tokens=8).eval()
    q, k, v = (torch.randn(3, 4, T, 8) for _ in range(3))
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1:, :pad] = False
    with torch.no_grad():
        want, dec = layer(q, k, v, mask, mode="hard", return_decisions=True)
        got, short = layer.attend_within_reach(q, k, v, mask, _dense_bias(mask, T))
    real = mask[:, None, :, None]
    assert torch.equal(short["sa"], dec["sa"]) and torch.allclose(short["logits"], dec["logits"], atol=1e-6)
    assert ((got - want).abs() * real).max() < 1e-5
    with pytest.raises(ValueError, match="causal"):
        ElasticAttention(4, 8, causal=False).attend_within_reach(q, k, v, mask, _dense_bias(mask, T))


@pytest.mark.parametrize("kv_groups", [1, 2])
def test_route_layers_routes_every_layer_as_its_own_router(kv_groups):
    """route_layers (the short-call program's routers, every layer in one chain after the last
    layer) gives each layer the logits and choice its own router gives, with left padding, grouped
    KV heads too; and attend_biased is attend_within_reach's attention."""
    from adaptex.graphs.elastic_decoder import _dense_bias
    from adaptex.graphs.nn import ElasticAttention
    from adaptex.graphs.nn.elastic import _choice, route_layers

    torch.manual_seed(0)
    routers = [ElasticAttention(2, 8, sink=2, window=8, causal=True, router_hidden=16, pool_tokens=4,
                                kv_groups=kv_groups).eval() for _ in range(3)]
    T = 9
    ks = [torch.randn(3, 2, T, 8) for _ in routers]
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        got = route_layers(routers, ks, mask)
        for router, k, (logits, sa) in zip(routers, ks, got):
            want = router.route(k, mask, expand=False)
            assert logits.shape == want.shape and torch.allclose(logits, want, atol=1e-6)
            assert torch.equal(sa, _choice(want))
        q, v = torch.randn(3, 2 * kv_groups, T, 8), torch.randn(3, 2, T, 8)
        o, _ = routers[0].attend_within_reach(q, ks[0], v, mask, _dense_bias(mask, T))
        assert torch.equal(routers[0].attend_biased(q, ks[0], v, _dense_bias(mask, T)), o)
