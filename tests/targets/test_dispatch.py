"""The ONNX Runtime lowerings of TSA's ops. The FFN runs its kept rows only, whatever the mix (no If:
zero rows where none is kept). Attention dispatches at run time: a block no token keeps runs no
query side, a mixed one the gathered rows, and a block where some sample keeps most of its tokens
(every token kept included) every row, masked. Each case is checked against the dense reference,
and ORT's profiler shows which kernels ran: the skipped work is not in the trace."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.graphs.ops import conditional_attention as ca
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.graphs.ops import conditional_ffn as cf
from tests.support import planted

B, T, P, d, f, H = 2, 5, 3, 16, 32, 4


def _model(function, node, inputs, weights) -> bytes:
    graph = helper.make_graph(
        [node], "t", [helper.make_tensor_value_info(n, t, [f"{n}{i}" for i in range(r)]) for n, t, r in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "t", "d"])],
        [numpy_helper.from_array(w.numpy().astype(np.float32), n) for n, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", fx.ONNX_OPSET),
                                                    helper.make_opsetid(fx.DOMAIN, fx.OPSET_VERSION)],
                              functions=[function])
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def _run(model: bytes, feeds: dict, tmp_path, shapes_of: str | None = None):
    """(y, kernels run by op type), and with shapes_of an op type, the output shapes of its kernels."""
    (y,), kernels = planted.profile(model, feeds, tmp_path)
    ran = Counter(k["op_name"] for k in kernels)
    if shapes_of is None:
        return y, ran
    return y, ran, [list(k["output_type_shape"][0].values())[0] for k in kernels if k["op_name"] == shapes_of]


def _keeps(seed=0):
    mixed = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.5
    mixed[0, 0], mixed[1, 1] = True, False
    assert mixed.sum(1).max() < DEFAULT.dense_query_share * T  # attention gathers this mix
    most = torch.ones(B, T, dtype=torch.bool)
    most[1, 2:] = False  # sample 0 keeps all T: attention runs every row of this mix, masked
    return {"none": torch.zeros(B, T, dtype=torch.bool), "all": torch.ones(B, T, dtype=torch.bool), "mixed": mixed,
            "most": most}


@pytest.mark.parametrize("case", ["none", "all", "mixed", "most"])
def test_conditional_ffn_runs_the_kept_rows(case, tmp_path):
    g = torch.Generator().manual_seed(1)
    w = {"ln_w": 1 + 0.3 * torch.randn(d, generator=g), "ln_b": 0.3 * torch.randn(d, generator=g),
         "w1": 0.3 * torch.randn(f, d, generator=g), "b1": 0.3 * torch.randn(f, generator=g),
         "w2": 0.3 * torch.randn(d, f, generator=g), "b2": 0.3 * torch.randn(d, generator=g)}
    x = torch.randn(B, T, d, generator=g)
    keep = _keeps()[case]
    gate = torch.rand(B, T, generator=g)
    node = helper.make_node("ConditionalFFN", ["x", "keep", "gate", *w], ["y"], domain=fx.DOMAIN, eps=1e-5)
    model = _model(fx.conditional_ffn_function("sparse"), node,
                   [("x", TensorProto.FLOAT, 3), ("keep", TensorProto.BOOL, 2), ("gate", TensorProto.FLOAT, 2)], w)
    y, ran, matmuls = _run(model, {"x": x.numpy(), "keep": keep.numpy(), "gate": gate.numpy()}, tmp_path,
                           shapes_of="MatMul")
    ref = cf.conditional_ffn_dense_reference(x, keep, gate, *w.values(), 1e-5)
    np.testing.assert_allclose(y, ref.numpy(), atol=1e-5)
    assert ran["If"] == 0 and ran["NonZero"] == 1 and ran["ScatterND"] == 1, ran  # one path for every mix
    assert [m[1] for m in matmuls] == [int(keep.sum())] * 2, matmuls  # the FFN's MatMuls: the kept rows
    if case == "none":
        np.testing.assert_array_equal(y, x.numpy())
    # MatMul + BiasGelu, as the dense graph's FFN runs, not Gemm + Gelu
    assert ran["BiasGelu"] == 1 and ran["Gelu"] == ran["Gemm"] == ran["FusedGemm"] == 0, ran


@pytest.mark.parametrize("by_sample", [False, True])
@pytest.mark.parametrize("case", ["none", "all", "mixed", "most"])
def test_conditional_attention_dispatch(case, by_sample, tmp_path):
    """by_sample: every call counts as large (policy.by_sample_from = 1), so attention runs a sample
    at a time in a Loop; a mixed call attends each sample's own kept rows and pads the rest with zeros."""
    from adaptex.graphs.tsa import attention_mask_4d

    policy = OrtPolicy(by_sample_from=1) if by_sample else OrtPolicy()
    g = torch.Generator().manual_seed(2)
    w = {"wq": 0.3 * torch.randn(d, d, generator=g), "bq": 0.1 * torch.randn(d, generator=g),
         "wo": 0.3 * torch.randn(d, d, generator=g), "bo": 0.1 * torch.randn(d, generator=g)}
    x, hn = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    k, v = torch.randn(B, H, P + T, d // H, generator=g), torch.randn(B, H, P + T, d // H, generator=g)
    keep = _keeps(3)[case]
    gate = torch.rand(B, T, generator=g)
    key_ok = torch.ones(B, P + T, dtype=torch.bool)
    key_ok[1, :2] = False
    bias = torch.zeros(B, 1, T, P + T).masked_fill(~attention_mask_4d(key_ok, P, T)[:, None], float("-inf"))
    node = helper.make_node("ConditionalAttention", ["x", "hn", "keep", "gate", "k", "v", "bias", *w], ["y"],
                            domain=fx.DOMAIN, num_heads=H)
    feeds = {n: t.numpy() for n, t in dict(x=x, hn=hn, keep=keep, gate=gate, k=k, v=v, bias=bias).items()}
    model = _model(fx.conditional_attention_function("sparse", dispatch=True, policy=policy), node,
                   [(n, TensorProto.BOOL if n == "keep" else TensorProto.FLOAT, a.ndim) for n, a in feeds.items()], w)
    y, ran, softmax = _run(model, feeds, tmp_path, shapes_of="Softmax")
    ref = ca.conditional_attention_dense_reference(x, hn, keep, gate, k, v, bias, *w.values(), H)
    np.testing.assert_allclose(y, ref.numpy(), atol=1e-5)
    query_side = ran["MatMul"] + ran["FusedMatMul"] + ran["Softmax"] + ran["Gemm"]
    assert ran["Loop"] == (by_sample and case != "none"), ran
    if by_sample and case == "mixed":  # one softmax a sample, over its own kept rows only
        assert sorted(s[2] for s in softmax) == sorted(keep.sum(1).tolist()), softmax
    elif by_sample and case != "none":  # every row of each sample
        assert [s[2] for s in softmax] == [T] * B, softmax
    if case == "none":
        assert query_side == 0, ran  # no projection, no scores, no softmax
        np.testing.assert_array_equal(y, x.numpy())
    elif case in ("all", "most"):  # every query row: no partition, no gather, no scatter
        assert query_side > 0 and ran["TopK"] == 0 and ran["ScatterND"] == 0 and ran["Gather"] == 0, ran
    else:
        assert query_side > 0 and ran["TopK"] == 1 and ran["ScatterND"] == 1, ran


def test_tensorrt_bodies_have_no_if():
    """TensorRT keeps the single-path bodies (its conditionals are not what these were checked on)."""
    for fn in (fx.conditional_ffn_function("sparse"), fx.conditional_attention_function("sparse", partition="cumsum")):
        assert "If" not in {n.op_type for n in fn.node}
