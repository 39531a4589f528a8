"""Core ML target, elastic family: adaptex::elastic_attention translated to MIL (sparse: mode groups by
non_zero + gather, block-local SA heads; dense: band masks), packages checked on Linux by MIL
reference evaluation of the saved program (the Core ML runtime itself needs macOS)."""
import json

import numpy as np
import pytest

import torch

import adaptex.graphs.ops.elastic_attention as ea
from adaptex.cli import main
from adaptex.graphs.family import family_contract
from adaptex.exporter.targets import coreml as target
from adaptex.graphs import checkpoint
from adaptex.runtimes import coreml_mil, parity
from adaptex.runtimes.coreml_mil import MilReferenceRunner
from adaptex.runtimes.torch_ref import TorchRunner
from tests.support import zoo

SAMPLES = 40


@pytest.fixture(scope="module")
def elastic(family_checkpoints, artifacts):
    """The tiny elastic checkpoint and its packages: sparse and dense fp32, and the default precision
    (shared with the session)."""
    ck = family_checkpoints / "el"
    model, _ = checkpoint.load(ck)
    packages = {}
    for variant, precision in (("sparse", "fp32"), ("dense", "fp32"), ("sparse", None)):
        path = artifacts("el", "coreml", variant, precision)
        packages[(variant, precision)] = (path, coreml_mil.read_package_meta(path))
    return ck, model, packages


def _ops(path):
    return list(MilReferenceRunner(path).program.functions["main"].operations)


@pytest.mark.parametrize("variant", ["sparse", "dense"])
def test_package_passes_adaptex_check(elastic, variant, capsys):
    ck, model, packages = elastic
    path, meta = packages[(variant, "fp32")]
    assert meta["family"] == "elastic" and meta["lowerings"] == {
        "adaptex::elastic_attention": f"elastic_attention_coreml_{variant}"}
    assert main(["check", str(path), "--samples", str(SAMPLES), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["samples"] == SAMPLES and report["max_abs_err"] <= 1e-4
    assert report["unexcused_flips"] == 0 and report["decisions_vary"]
    for li in range(model.cfg.num_layers):  # both modes occur in every layer
        seen = report["decisions"][f"decisions.layer{li}.sa"]["values_seen"]
        assert seen["SA"] > 0 and seen["FA"] > 0


def test_package_interface_and_metadata(elastic):
    import coremltools as ct

    _, model, packages = elastic
    path, meta = packages[("sparse", "fp32")]
    assert coreml_mil.read_package_meta(path)["family"] == "elastic"
    assert meta["sink"] == model.cfg.sink and meta["window"] == model.cfg.window
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    assert spec.description.metadata.userDefined["adaptex.family"] == "elastic"
    assert [i.name for i in spec.description.input] == ["input_ids", "attention_mask"]
    fp32 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT32
    outs = {o.name: o.type.multiArrayType.dataType for o in spec.description.output}
    want = ["sentence_embedding"] + [f"decisions_layer{i}_{f}" for i in range(model.cfg.num_layers)
                                     for f in ("sa", "logits")]
    assert list(outs) == want and set(outs.values()) == {fp32}


def test_sparse_program_gathers_modes_and_blocks(elastic):
    """SA pairs are gathered (non_zero + gather_nd) and scored block-local against a gathered run of
    L keys plus the sinks: on a full-length input no SA score tensor is T x S, the FA ones are."""
    _, model, packages = elastic
    cfg = model.cfg
    sparse, dense = _ops(packages[("sparse", "fp32")][0]), _ops(packages[("dense", "fp32")][0])
    types = {op.op_type for op in sparse}
    assert {"non_zero", "gather_nd", "gather", "scatter_nd"} <= types
    assert not {"non_zero", "gather_nd", "scatter_nd"} & {op.op_type for op in dense}
    runs = [op for op in sparse if op.op_type == "gather" and op.name.endswith("_sa_k_runs")]
    assert len(runs) == cfg.num_layers and all(op.inputs["indices"].rank == 2 for op in runs)  # (blocks, L)

    T = cfg.max_len
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, size=(8, T)).astype(np.int32)
    shapes = {}
    coreml_mil.run(MilReferenceRunner(packages[("sparse", "fp32")][0]).program,
                   {"input_ids": ids, "attention_mask": np.ones_like(ids)},
                   on_op=lambda op, outs: shapes.__setitem__(op.name, outs[0].shape))
    Bq, L = min(cfg.window, T), min(cfg.window, T) + 2 * (cfg.window // 2)
    for li in range(cfg.num_layers):
        pre = "elastic_attention" + (f"_{li}" if li else "")
        n_sa, n_fa = shapes[f"{pre}_sa_pairs"][0], shapes[f"{pre}_fa_pairs"][0]
        assert n_sa + n_fa == 8 * cfg.num_heads + 2  # and a spare pair per group: never an empty group
        assert shapes[f"{pre}_sa_loc_scores"] == (n_sa, -(-T // Bq), Bq, L)  # O(T * window), not T x S
        assert shapes[f"{pre}_sa_sink_scores"] == (n_sa, -(-T // Bq), Bq, cfg.sink)
        assert shapes[f"{pre}_fa_scores"] == (n_fa, T, T)
    assert sum(shapes[f"elastic_attention{s}_sa_pairs"][0] for s in ("", "_1")) > 0


def test_default_fp16_package_keeps_routing_fp32(elastic):
    from coremltools.converters.mil.mil import types

    _, model, packages = elastic
    path, meta = packages[("sparse", None)]
    assert meta["precision"] == target.default_precision(family_contract(model)) == "fp16"
    assert meta["routing_precision"] == "fp32"
    ops = _ops(path)
    dtype = {op.name: types.builtin_to_string(op.outputs[0].dtype) for op in ops}
    router = [op for op in ops if op.op_type not in ("const", "cast") and (
        op.name.startswith("route_") or any(v.name.startswith(("route_", "decisions_")) for v in op.outputs))]
    assert {op.op_type for op in router} >= {"linear", "gelu", "reduce_sum", "cumsum"}
    assert {dtype[op.name] for op in router if dtype[op.name] not in ("bool", "int32")} == {"fp32"}
    assert {dtype[op.name] for op in ops if op.op_type == "clip"} == {"fp32"}  # the routers' clamp (clip_N)
    # the sa decision reads fp32 logits (the larger of [FA, SA]); the body (projections, attention) is fp16
    choices = [op for op in ops if op.op_type == "reduce_argmax"]
    assert len(choices) == model.cfg.num_layers
    assert all(types.builtin_to_string(op.inputs["x"].dtype) == "fp32" for op in choices)
    assert {dtype[op.name] for op in ops if op.op_type == "softmax"} == {"fp16"}
    assert "fp16" in {dtype[op.name] for op in ops if op.op_type == "linear"}
    assert {dtype[op.name] for op in ops if op.op_type == "reduce_l2_norm"} == {"fp32"}  # pooling tail
    report = parity.check(MilReferenceRunner(path), TorchRunner(model), samples=SAMPLES, precision="fp16")
    assert report.passed, report.format()
    assert report.unexcused_flips == 0 and report.tolerance == {"atol": 1e-2, "rtol": 1e-2}


class _Op(torch.nn.Module):
    """The op alone, int32 masks in (Core ML has no bool inputs)."""

    def __init__(self, sink: int, window: int, causal: bool):
        super().__init__()
        self.sink, self.window, self.causal = sink, window, causal

    def forward(self, q, k, v, sa, key_mask):
        return ea.elastic_attention(q, k, v, sa != 0, key_mask != 0, self.sink, self.window, self.causal)


@pytest.mark.parametrize("variant, sink, window, causal", [("sparse", 2, 4, True), ("dense", 2, 4, True),
                                                           ("sparse", 0, 3, False)])
def test_op_translation_matches_eager_kernel(variant, sink, window, causal, tmp_path):
    """Decoder shapes (a past: S > T, causal) and sink 0, which the encoder model does not reach:
    the translated op against the eager kernel, T below, at and above the window."""
    H, dh = 3, 8
    B, T, S = (torch.export.Dim(n, min=1, max=32) for n in ("B", "T", "S"))
    ex = (torch.randn(2, H, 5, dh), torch.randn(2, H, 9, dh), torch.randn(2, H, 9, dh),
          torch.ones(2, H, dtype=torch.int32), torch.ones(2, 9, dtype=torch.int32))
    ep = torch.export.export(_Op(sink, window, causal), ex, dynamic_shapes=(
        {0: B, 2: T}, {0: B, 2: S}, {0: B, 2: S}, {0: B}, {0: B, 1: S})).run_decompositions({})
    import coremltools as ct

    from adaptex.exporter.registry import lookup
    from adaptex.exporter.targets.coreml.mil_ops import register_translations
    from adaptex.exporter.trace import adaptex_nodes

    node = adaptex_nodes(ep)[0]
    register_translations({node.name: lookup("adaptex::elastic_attention", "coreml", variant, node).fn(None, node)})
    path = tmp_path / "op.mlpackage"
    ct.convert(ep, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS17,
               compute_precision=ct.precision.FLOAT32, outputs=[ct.TensorType(name="o")]).save(str(path))
    _, program = coreml_mil.load_program(path)
    g = torch.Generator().manual_seed(0)
    for b, t, s in ((1, 1, 1), (2, 1, 11), (2, 4, 4), (3, 5, 12), (2, 13, 13), (1, 7, 20)):
        q, k, v = torch.randn(b, H, t, dh, generator=g), torch.randn(b, H, s, dh, generator=g), torch.randn(b, H, s, dh, generator=g)
        sa = torch.rand(b, H, generator=g) < 0.5
        sa[0, 0], sa[0, -1] = True, False  # both modes
        km = torch.rand(b, s, generator=g) < 0.8
        km[:, 0] = True
        want = ea.elastic_attention_eager(q, k, v, sa, km, sink, window, causal)
        got = coreml_mil.run(program, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(),
                                       "sa": sa.int().numpy(), "key_mask": km.int().numpy()})["o"]
        # rows whose query sees no key at all are unspecified (padding); compare the others
        fa, sa_vis = ea.visibility(t, s, sink, window, causal)
        seen = (torch.where(sa[:, :, None, None], sa_vis, fa) & km[:, None, None, :]).any(-1)  # (b, H, t)
        err = np.abs(got - want.numpy())[seen.numpy()]
        assert err.size and err.max() < 1e-5, (b, t, s, float(err.max()))


def test_the_checker_flags_a_zero_size_intermediate(elastic, monkeypatch):
    """A program that empties a tensor on some input fails the check by name (Core ML may refuse
    zero-size tensors at prediction time; coremltools #1040, #2516), though its values are right."""
    from adaptex.runtimes import coreml_mil as cm

    runner = MilReferenceRunner(elastic[2][("sparse", "fp32")][0])
    real = cm.EVAL["non_zero"]
    monkeypatch.setitem(cm.EVAL, "non_zero", lambda x: real(x)[:0] if x.shape[0] > 1 else real(x))
    ids = np.ones((2, 12), np.int32)
    runner.infer({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    found = runner.findings()
    assert found and "zero-size tensor" in found[0] and "non_zero" in found[0]
    assert runner.findings() == []  # reported once
