"""passes.attention_by_sample: a large batch's attention runs a sample at a time in a Loop, behind an
If on the call's size, with the values of the batched kernels. The dense candidates get the pass
too (exporter/counterparts.py), so the yardstick has what the artifact has."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from adaptex.exporter.targets.onnx import programs
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.onnx.passes_by_sample import attention_by_sample, by_sample_ifs
from adaptex.graphs.ops.policy import OrtPolicy
from tests.support import planted

B, H, T, dh = 3, 2, 6, 4


def _attention(mask_batch: str | int, probabilities_out: bool = False) -> onnx.ModelProto:
    """q k^T / 2 + mask -> Softmax -> . v, the way the stock exporters write it (k transposed by its
    own node); the mask's first axis is the batch or 1 (shared)."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Div", ["s", "two"], ["s2"]),
             helper.make_node("Add", ["s2", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", H, "t", dh]) for n in ("q", "k", "v")]
    io.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [mask_batch, 1, "t", "t"]))
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", H, "t", dh])]
    if probabilities_out:
        outs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "attention", io, outs, [numpy_helper.from_array(np.float32(2.0), "two")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", fx.ONNX_OPSET)])


def _run(model: onnx.ModelProto, feeds: dict, tmp_path) -> tuple[np.ndarray, Counter]:
    (y,), kernels = planted.profile(model, feeds, tmp_path, ["y"])
    return y, Counter(k["op_name"] for k in kernels)


@pytest.mark.parametrize("mask_batch", ["b", 1])
def test_a_large_batchs_attention_runs_by_sample_with_the_same_values(mask_batch, tmp_path):
    rng = np.random.default_rng(0)
    before = _attention(mask_batch)
    after = _attention(mask_batch)
    # this batch is large, one sample is not
    assert attention_by_sample(after, OrtPolicy(by_sample_from=B * H * T * T)) == 1
    onnx.checker.check_model(after, full_check=True)
    for batch in (B, 1):
        feeds = {n: rng.standard_normal((batch, H, T, dh)).astype(np.float32) for n in "qkv"}
        mask = np.where(rng.random((batch if mask_batch == "b" else 1, 1, T, T)) < 0.3, -1e9, 0).astype(np.float32)
        feeds["mask"] = mask
        ref, _ = _run(before, feeds, tmp_path)
        y, ran = _run(after, feeds, tmp_path)
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
        assert ran["Loop"] == (batch > 1), ran
        assert ran["Softmax"] == batch, ran  # one a sample, or the batch's one


def _gathered_bias(op: str, read_again: bool = False) -> onnx.ModelProto:
    """Attention whose (b, H, t, t) bias is each head's plane of `planes` (P, t, t), picked by
    `pick` (b, H): a Gather on axis 0 or a GatherND, as an elastic decoder's masked short-call
    program picks a head's plane by its mode; read_again: the bias is an output too."""
    idx = ["pick"] if op == "Gather" else ["pick3"]
    nodes = ([] if op == "Gather" else [helper.make_node("Unsqueeze", ["pick", "last"], ["pick3"])]) + [
        helper.make_node(op, ["planes"] + idx, ["bias"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Add", ["s", "bias"], ["sb"]),
        helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", H, "t", dh]) for n in ("q", "k", "v")]
    io += [helper.make_tensor_value_info("planes", TensorProto.FLOAT, ["n", "t", "t"]),
           helper.make_tensor_value_info("pick", TensorProto.INT64, ["b", H])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", H, "t", dh])]
    if read_again:
        outs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["b", H, "t", "t"]))
    graph = helper.make_graph(nodes, "attention", io, outs, [numpy_helper.from_array(np.array([-1]), "last")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", fx.ONNX_OPSET)])


@pytest.mark.parametrize("op", ["Gather", "GatherND"])
def test_a_bias_gathered_by_sample_is_gathered_in_the_loop(op, tmp_path):
    """The gather that makes the (b, H, t, t) bias moves into the rewrite: the Loop gathers each
    sample's planes by its own row of indices, the batched branch the batch's, and the values stay
    the batched kernels'; a bias read again stays where it is, sliced a sample at a time."""
    rng = np.random.default_rng(1)
    for read_again in (False, True):
        before, after = _gathered_bias(op, read_again), _gathered_bias(op, read_again)
        assert attention_by_sample(after, OrtPolicy(by_sample_from=B * H * T * T)) == 1
        onnx.checker.check_model(after, full_check=True)
        assert [n.op_type for n in after.graph.node if n.op_type == op] == ([op] if read_again else [])
        for batch in (B, 1):
            feeds = {n: rng.standard_normal((batch, H, T, dh)).astype(np.float32) for n in "qkv"}
            feeds["planes"] = np.where(rng.random((2 * batch, T, T)) < 0.3, -1e9, 0).astype(np.float32)
            feeds["pick"] = (2 * np.arange(batch)[:, None] + rng.integers(0, 2, (batch, H))).astype(np.int64)
            ref, _ = _run(before, feeds, tmp_path)
            y, ran = _run(after, feeds, tmp_path)
            np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
            assert ran["Loop"] == (batch > 1), ran
            assert ran[op] == (batch if batch > 1 and not read_again else 1), ran  # one a sample in the Loop


@pytest.mark.parametrize("change", ["axis 1", "the chain reads the planes"])
def test_a_gather_the_loop_cannot_make_a_sample_at_a_time_stays_out_of_the_rewrite(change):
    model = _gathered_bias("Gather")
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    if change == "axis 1":
        gather.attribute.append(helper.make_attribute("axis", 1))
    else:  # the chain reads the gather's data itself, (H, t, t) broadcast: the Loop needs it whole there
        planes = next(i for i in model.graph.input if i.name == "planes")
        planes.CopyFrom(helper.make_tensor_value_info("planes", TensorProto.FLOAT, [H, "t", "t"]))
        at = next(k for k, n in enumerate(model.graph.node) if n.op_type == "Softmax")
        model.graph.node[at].input[0] = "sbp"
        model.graph.node.insert(at, helper.make_node("Add", ["sb", "planes"], ["sbp"]))
    assert attention_by_sample(model) == 1
    assert [n.op_type for n in model.graph.node][0] == "Gather"  # still in the main graph, before the If


def test_attention_whose_probabilities_are_read_again_is_left_alone():
    model = _attention("b", probabilities_out=True)
    before = model.SerializeToString()
    assert attention_by_sample(model) == 0 and model.SerializeToString() == before


def test_a_tsa_artifact_runs_its_attention_by_sample_with_the_same_outputs(tmp_path):
    """Every call counted large (policy.by_sample_from = 1): the gated blocks' attention (the op bodies)
    runs a sample at a time, with the outputs of the artifact exported as shipped. The first block's
    plain attention stays batched: a decoder's main graph also serves its decode steps, where the
    pass's If would only cost (with --dense-rows, its sparse branch gets it: the test below)."""
    from adaptex.graphs import checkpoint
    from tests.support import zoo

    checkpoint.save(tmp_path / "ck", zoo.tiny_tsa(), {"training": {"task": "copy"}, "description": "test decoder"})
    model, info = checkpoint.load(tmp_path / "ck")
    zoo.export(model, info, tmp_path / "batched.onnx", short_graph="off")
    zoo.export(model, info, tmp_path / "by_sample.onnx", short_graph="off", policy=OrtPolicy(by_sample_from=1))
    assert by_sample_ifs(onnx.load(tmp_path / "by_sample.onnx").graph.node) == 0
    rng = np.random.default_rng(0)
    ids = rng.integers(2, model.cfg.vocab_size, size=(3, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[2, 9:] = 0
    sess = ort.InferenceSession(str(tmp_path / "batched.onnx"), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.zeros([len(ids), *i.shape[1:2], 0, *i.shape[3:]], np.float32)  # an empty cache
             for i in sess.get_inputs() if i.name.startswith("past_key_values")}
    feeds.update(input_ids=ids, attention_mask=mask)
    want = sess.run(None, feeds)
    got, kernels = planted.profile(onnx.load(tmp_path / "by_sample.onnx"), feeds, tmp_path)
    assert sum(k["op_name"] == "Loop" for k in kernels) >= 1
    keeps = [w for o, w in zip(sess.get_outputs(), want) if o.name.endswith(".keep")]
    assert any(0 < k.mean() < 1 for k in keeps)  # mixed blocks: the loop attends each sample's own rows
    for o, a, b in zip(sess.get_outputs(), want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=o.name)


@pytest.mark.slow
def test_a_dense_branch_whose_calls_stay_small_gets_no_by_sample_if(tmp_path):
    """--dense-rows N: the dense branch runs calls of at most N token rows, whose scores are at most
    N x heads x the longest sequence; below the threshold its If would only cost (a decode step)."""
    from adaptex.graphs import checkpoint
    from tests.support import zoo

    checkpoint.save(tmp_path / "ck", zoo.tiny_tsa(), {"training": {"task": "copy"}, "description": "test decoder"})
    model, info = checkpoint.load(tmp_path / "ck")
    cfg = model.cfg
    policy = OrtPolicy(by_sample_from=8 * cfg.num_heads * cfg.max_len + 1)  # 8 rows stay below it
    for rows, dense_ifs in ((8, 0), (9, 1)):
        path = tmp_path / f"merged{rows}.onnx"
        zoo.export(model, info, path, dense_rows=rows, policy=policy)
        # the sparse branch holds the large-call If: its general program and the large-call one
        step, dense, general, large = (programs.program(onnx.load(path), p)
                                       for p in ((True,), (False, True), (False, False, False), (False, False, True)))
        assert not any(n.domain == fx.DOMAIN for g in (step, dense) for n in g.graph.node)
        assert any(n.domain == fx.DOMAIN for n in general.graph.node)
        ifs = [by_sample_ifs(g.graph.node) for g in (step, dense, general, large)]
        assert ifs == [dense_ifs, dense_ifs, 1, 1], rows


@pytest.mark.parametrize("modes", ["mixed", pytest.param("fa", marks=pytest.mark.slow)])
def test_an_elastic_decoders_full_attention_runs_by_sample_with_the_same_outputs(modes, tmp_path):
    """ElasticAttention's FA paths (every pair as it is; the gathered FA pairs of a mixed call) run a
    sample (a pair) at a time where the call is large; forced here (by_sample_from = 1, no masked
    path in the op's body and no short-call graphs, which would take this prefill), against the same
    export batched."""
    from adaptex.graphs import checkpoint
    from tests.support import zoo
    from tests.targets.test_decode_graph import _feeds

    checkpoint.save(tmp_path / "ck", zoo.tiny_elastic_decoder(), {"description": "test elastic decoder"})
    model, info = checkpoint.load(tmp_path / "ck")
    zoo.export(model, info, tmp_path / "batched.onnx", short_graph="off", policy=OrtPolicy(mixed_call_masked_up_to=0))
    zoo.export(model, info, tmp_path / "by_sample.onnx", short_graph="off",
               policy=OrtPolicy(mixed_call_masked_up_to=0, by_sample_from=1))
    sess = ort.InferenceSession(str(tmp_path / "batched.onnx"), providers=["CPUExecutionProvider"])
    feeds = _feeds(sess, 3, 24, 0, modes, pad=2)
    want = sess.run(None, feeds)
    got, kernels = planted.profile(onnx.load(tmp_path / "by_sample.onnx"), feeds, tmp_path)
    assert sum(k["op_name"] == "Loop" for k in kernels) >= 1
    for o, a, b in zip(sess.get_outputs(), want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=o.name)
