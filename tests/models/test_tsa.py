"""TSA: the conditional_ffn and conditional_attention ops, the decoder (soft/hard, KV cache), its ONNX export and parity,
generation from the artifact, bad input, and training."""
import numpy as np
import pytest
import torch

from adaptex.graphs import checkpoint
from adaptex.graphs.errors import InputError
from adaptex.graphs.ops import conditional_attention as ca
from adaptex.graphs.ops import conditional_ffn as cf
from tests.support import zoo


def _ffn_args(d=16, f=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3  # noqa: E731
    return (1 + r(d), r(d), r(f, d), r(f), r(d, f), r(d), 1e-5)


def test_conditional_ffn_matches_the_dense_reference_and_leaves_skipped_tokens_alone():
    x = torch.randn(3, 7, 16)
    keep = torch.rand(3, 7) > 0.5
    keep[0] = False  # a row with nothing kept
    gate = torch.rand(3, 7) * keep
    y = cf.conditional_ffn(x, keep, gate, *_ffn_args())
    ref = cf.conditional_ffn_dense_reference(x, keep, gate, *_ffn_args())
    assert torch.allclose(y, ref, atol=1e-6)
    assert torch.equal(y[~keep], x[~keep])


def test_conditional_ffn_runs_the_ffn_on_kept_tokens_only(monkeypatch):
    seen = []
    real = cf.ffn_update
    monkeypatch.setattr(cf, "ffn_update", lambda x, *a: seen.append(tuple(x.shape)) or real(x, *a))
    keep = torch.zeros(2, 9, dtype=torch.bool)
    keep[0, 1], keep[1, 4], keep[1, 8] = True, True, True
    cf.conditional_ffn_eager(torch.randn(2, 9, 16), keep, keep.float(), *_ffn_args())
    assert seen == [(3, 16)]  # 3 of 18 tokens went through the FFN


def _attention_case(B=3, T=7, P=3, d=16, H=4, seed=0):
    """x, hn, keep, gate, k, v, causal bias over P cached + T new positions (row 1 left-padded), weights."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, hn = r(B, T, d), r(B, T, d)
    keep = torch.rand(B, T, generator=g) > 0.4
    keep[0] = False  # a row with nothing kept
    gate = torch.rand(B, T, generator=g) * keep
    k, v = r(B, H, P + T, d // H), r(B, H, P + T, d // H)
    from adaptex.graphs.tsa import attention_mask_4d

    key_ok = torch.ones(B, P + T, dtype=torch.bool)
    key_ok[1, :4] = False
    bias = torch.zeros(B, 1, T, P + T).masked_fill(~attention_mask_4d(key_ok, P, T)[:, None], float("-inf"))
    w = (r(d, d) * 0.3, r(d) * 0.1, r(d, d) * 0.3, r(d) * 0.1)
    return x, hn, keep, gate, k, v, bias, w, H


def test_conditional_attention_matches_the_dense_reference_and_leaves_skipped_tokens_alone():
    x, hn, keep, gate, k, v, bias, w, H = _attention_case()
    y = ca.conditional_attention(x, hn, keep, gate, k, v, bias, *w, H)
    ref = ca.conditional_attention_dense_reference(x, hn, keep, gate, k, v, bias, *w, H)
    assert torch.allclose(y, ref, atol=1e-5)
    assert torch.equal(y[~keep], x[~keep])
    assert not torch.allclose(y[keep], x[keep])
    none = torch.zeros_like(keep)
    assert torch.equal(ca.conditional_attention(x, hn, none, gate, k, v, bias, *w, H), x)


def test_conditional_attention_projects_and_attends_kept_query_rows_only(monkeypatch):
    seen = []
    real = ca._attend_rows
    monkeypatch.setattr(ca, "_attend_rows", lambda hq, *a: seen.append(tuple(hq.shape)) or real(hq, *a))
    x, hn, keep, gate, k, v, bias, w, H = _attention_case()
    keep = torch.zeros_like(keep)
    keep[1, 2], keep[2, 0], keep[2, 5] = True, True, True
    ca.conditional_attention_eager(x, hn, keep, gate, k, v, bias, *w, H)
    assert seen == [(3, 2, 16)]  # 2 query rows per sample (the batch's largest kept count), not 7
    assert ca.kept_rows(keep).tolist() == [[0, 1], [2, 0], [0, 5]]  # kept positions first, in order


def test_hard_mode_equals_the_dense_reference_and_the_cache_equals_a_full_pass():
    m = zoo.tiny_tsa()
    ids = torch.randint(3, 32, (2, 12))
    with torch.no_grad():
        full, dec, _ = m(ids, mode="hard")
        dense, _, _ = m(ids, mode="hard_dense")
        assert torch.allclose(full, dense, atol=1e-5)
        keeps = torch.cat([d["keep"].flatten() for d in dec]).float()
        assert 0 < keeps.mean() < 1, "the tiny model's decisions should vary"
        out, _, past = m(ids[:, :5], mode="hard")
        steps = [out]
        for t in range(5, 12):
            mask = torch.ones(2, t + 1, dtype=torch.int64)
            o, _, past = m(ids[:, t:t + 1], mask, past=past, mode="hard")
            steps.append(o)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_trace_keeps_one_node_per_op_per_gated_block():
    from adaptex.exporter.trace import adaptex_nodes, trace

    ep = trace(zoo.tiny_tsa(), mode="hard")
    ops = [n.target.name() for n in adaptex_nodes(ep)]
    assert ops == ["adaptex::conditional_attention", "adaptex::conditional_ffn"] * 2  # blocks 1 and 2 of 3


@pytest.fixture(scope="module")
def tsa_checkpoint(family_checkpoints):
    return family_checkpoints / "tsa"


@pytest.fixture(scope="module")
def tsa_onnx(artifacts):
    return {variant: artifacts("tsa", "onnx", variant) for variant in ("sparse", "dense")}


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_the_exported_router_is_two_gemms_and_one_where(tsa_onnx, variant):
    """Each router Linear runs as a Gemm (on a 2-D view of the hidden states: a (B, T, d) input
    exports as a MatMul and an Add), and the gate is one Where on the keep mask, not a Cast and a Mul
    (docs/benchmarking.md#never-slower-than-dense: each kernel counts at a decode step)."""
    import onnx

    g = onnx.load(str(tsa_onnx[variant])).graph
    readers = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.op_type)
    weights = [t.name for t in g.initializer if ".routers." in f".{t.name}" and t.name.endswith("weight")]
    assert len(weights) == 2 * 2 and all(readers.get(w) == ["Gemm"] for w in weights), \
        {w: readers.get(w) for w in weights}
    keeps = [o.name for o in g.output if o.name.endswith(".keep")]
    made = {o: n for n in g.node for o in n.output}
    gates = [n for n in g.node if n.op_type == "Where" and n.input[0] in keeps]
    assert len(gates) == len(keeps) == 2 and all(made[n.input[1]].op_type == "Sub" for n in gates)
    assert not [n for n in g.node if n.op_type == "Cast" and n.input[0] in keeps and "Mul" in readers.get(n.output[0], [])]


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_onnx_artifact_passes_parity_on_prefill_and_decode_steps(tsa_onnx, tsa_checkpoint, variant):
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.torch_ref import TorchRunner

    model, _ = checkpoint.load(tsa_checkpoint)
    report = check(OnnxRuntimeRunner(tsa_onnx[variant]), TorchRunner(model), samples=40, task="copy")
    assert report.passed, report.format()
    assert report.unexcused_flips == 0 and report.decisions_vary
    assert report.max_abs_err < 1e-4 and "present.0.key" in report.outputs and report.batches > report.samples / 8


def _body_ops(proto, name) -> set[str]:
    """Op types in a function's body, If branches included."""
    def walk(nodes):
        for n in nodes:
            yield n.op_type
            for a in n.attribute:
                for g in ([a.g] if a.HasField("g") else list(a.graphs)):
                    yield from walk(g.node)
    return {op for f in proto.functions if f.name == name for op in walk(f.node)}


def test_onnx_graph_shape_names_and_lowerings(tsa_onnx):
    import onnx

    for variant, want, unwanted in (("sparse", {"NonZero", "ScatterND"}, set()), ("dense", set(), {"NonZero", "ScatterND"})):
        proto = onnx.load(str(tsa_onnx[variant]))
        nodes = [n for n in proto.graph.node if n.domain == "adaptex"]
        assert [n.op_type for n in nodes] == ["ConditionalAttention", "ConditionalFFN"] * 2
        body = _body_ops(proto, "ConditionalFFN")
        assert want <= body and not (unwanted & body)
        attn = _body_ops(proto, "ConditionalAttention")
        if variant == "sparse":
            assert {"TopK", "Gather", "ScatterND"} <= attn
        else:
            assert not {"TopK", "ScatterND"} & attn
        names = [i.name for i in proto.graph.input]
        assert names[:4] == ["input_ids", "attention_mask", "past_key_values.0.key", "past_key_values.0.value"]
        outs = [o.name for o in proto.graph.output]
        assert outs[:3] == ["logits", "present.0.key", "present.0.value"] and "decisions.layer1.keep" in outs
        past = proto.graph.input[2].type.tensor_type.shape.dim
        assert [d.dim_param or d.dim_value for d in past] == ["batch", 4, "past_sequence", 8]


def test_generation_example_matches_eager_greedy_decoding(tsa_onnx, tsa_checkpoint):
    from examples.tsa_generate import Generator
    from adaptex.graphs.tsa import generate

    model, _ = checkpoint.load(tsa_checkpoint)
    gen = Generator(str(tsa_onnx["sparse"]))
    for prompt in ([1, 5, 9, 4, 2], [1, 30, 3, 3, 17, 22, 2], [7]):
        ids, keep = gen.generate(prompt, 12)
        ref_ids, ref_keep = generate(model, prompt, 12)
        assert ids == ref_ids
        assert np.allclose(keep, ref_keep)


@pytest.mark.parametrize("feeds_fn, match", [
    (lambda z: {"input_ids": np.ones((1, 30), np.int64), "attention_mask": np.ones((1, 35), np.int64), **z(5)},
     "5 cached \\+ 30 new tokens = 35 exceeds the KV cache bound 32"),
    (lambda z: {"input_ids": np.ones((1, 0), np.int64), "attention_mask": np.ones((1, 0), np.int64), **z(0)},
     "empty prompt"),
    (lambda z: {"input_ids": np.full((1, 3), 40, np.int64), "attention_mask": np.ones((1, 3), np.int64), **z(0)},
     "values must lie in \\[0, 32\\)"),
    (lambda z: {"input_ids": np.ones((1, 3), np.int64), "attention_mask": np.ones((1, 3), np.int64), **z(2)},
     "attention_mask: shape \\[1, 3\\], expected \\[1, 5\\]"),
])
def test_bad_decoder_input_is_refused_with_the_fix(tsa_onnx, feeds_fn, match):
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner

    def z(P):
        return {f"past_key_values.{i}.{kv}": np.zeros((1, 4, P, 8), np.float32) for i in range(3) for kv in ("key", "value")}

    with pytest.raises(InputError, match=match):
        OnnxRuntimeRunner(tsa_onnx["sparse"]).infer(feeds_fn(z))


def test_generation_example_refuses_bad_prompts(tsa_onnx, capsys):
    from examples.tsa_generate import main

    assert main([str(tsa_onnx["sparse"]), "--prompt-ids", "1 2", "--max-new-tokens", "40"]) == 2
    assert "exceed the KV cache bound 32" in capsys.readouterr().err
    assert main([str(tsa_onnx["sparse"]), "--prompt-ids", ""]) == 2
    assert "empty prompt" in capsys.readouterr().err


@pytest.mark.parametrize("lam", [0.0, 0.1])
def test_training_runs_with_and_without_the_depth_loss(lam):
    from adaptex.graphs.lm_tasks import get_lm_task
    from adaptex.graphs.recipes.tsa import TSATrainConfig, evaluate_tsa, train_tsa
    from adaptex.graphs.tsa import TSAConfig

    task = get_lm_task("copy")
    cfg = TSAConfig(**{**zoo.TINY_TSA, "vocab_size": task.vocab_size})
    m = train_tsa(cfg, task, TSATrainConfig(steps=12, batch_size=16, lambda_depth=lam, warmup=2))
    r = evaluate_tsa(m, task, 40, batch_size=20)
    assert np.isfinite(r["loss"]) and 0 <= r["alpha"] <= 1 and r["ops_saved"] == pytest.approx(
        1 - (1 + 2 * r["alpha"]) / 3)


def test_cli_trains_a_tsa_checkpoint(tmp_path, capsys):
    from adaptex.cli import main

    out = tmp_path / "ck"
    assert main(["train", "tsa", "--task", "sort", "-o", str(out), "--steps", "6", "--batch-size", "8",
                 "--d-model", "32", "--heads", "4", "--layers", "3", "--d-ff", "64", "--eval-size", "20"]) == 0
    table = capsys.readouterr().out
    assert "TSA (hard, deployed)" in table and "dense decoder (baseline)" in table and "paper (TSA, sort)" in table
    model, info = checkpoint.load(out)
    assert info["family"] == "tsa" and info["tokenizer"]["kind"] == "ids"
    assert main(["train", "tsa", "--task", "graded", "-o", str(tmp_path / "x")]) == 2
    assert "unknown task 'graded' for tsa; choose one of copy, sort, charlm" in capsys.readouterr().err


@pytest.mark.slow
def test_reproduction_script_prints_the_table(capsys):
    from examples.tsa_reproduce import main

    assert main(["--tasks", "copy", "sort", "--steps", "3", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    assert "copy" in out and "54.9% saved at full accuracy" in out and "22.5% saved" in out and "ops saved" in out
    assert "early exit, same ops saved" in out and "token acc" in out.split("early exit")[-1]
