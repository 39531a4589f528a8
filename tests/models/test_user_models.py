"""Models of your own (tests/support/user_models.py, written against adaptex.nn only) through the public API:
every target, parity on 200 varied inputs with 0 unexcused flips, decisions named by module path."""
from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import onnx
import pytest

import adaptex
from adaptex.cli import main
from adaptex.exporter import registry
from adaptex.exporter.errors import UnsupportedLowering
from adaptex.exporter.targets.tensorrt import rules
from tests.support import user_models as um

TARGETS = [("onnx", "sparse", {}, ".onnx"), ("onnx", "dense", {}, ".onnx"),
           ("coreml", "sparse", {"precision": "fp32"}, ".mlpackage"),
           ("coreml", "sparse", {"precision": "fp16"}, ".fp16.mlpackage"),
           ("tensorrt", "sparse", {"onnx_only": True}, ".trt.onnx")]
IDS = ["onnx-sparse", "onnx-dense", "coreml-fp32", "coreml-fp16", "tensorrt-onnx"]


def _slow_but(keep: set[str]) -> list:
    """TARGETS, those whose id is not in `keep` marked slow (make test-slow runs them)."""
    return [t if i in keep else pytest.param(*t, marks=pytest.mark.slow, id=i) for t, i in zip(TARGETS, IDS)]


@pytest.fixture(scope="module")
def patch_model():
    return um.patch_classifier()


@pytest.fixture(scope="module")
def decoder():
    return um.mixed_decoder()


def _export_and_check(model, example, inputs, tmp_path, target, variant, options, suffix, **kw):
    path = tmp_path / f"m.{variant}{suffix}"
    meta = adaptex.export(model, example, path, target=target, variant=variant, validate=False, **options, **kw)
    report = adaptex.check(path, model, inputs=inputs)
    assert report.passed, report.format()
    assert report.unexcused_flips == 0 and report.decisions_vary
    assert report.samples >= 200
    if target == "tensorrt":
        assert rules.lint(onnx.load(str(path))) == []
    return meta, report


@pytest.mark.parametrize("target, variant, options, suffix", _slow_but(set(IDS) - {"coreml-fp32"}), ids=IDS)
def test_patch_classifier_on_every_target(patch_model, tmp_path, target, variant, options, suffix):
    """(a): float patches and a mask in, budgeted attention in two of three blocks, a custom head."""
    example = (np.random.default_rng(0).normal(size=(3, 10, 12)).astype(np.float32), np.ones((3, 10), bool))
    import torch

    example = tuple(torch.from_numpy(a) for a in example)
    meta, report = _export_and_check(patch_model, example, um.patch_inputs(200), tmp_path, target, variant, options,
                                     suffix)
    assert meta["family"] == "custom" and meta["model"] == "PatchClassifier"
    assert list(meta["decisions"]) == ["decisions.encoder.layers.0.attn.k", "decisions.encoder.layers.0.attn.head_mask",
                                       "decisions.encoder.layers.2.attn.k", "decisions.encoder.layers.2.attn.head_mask"]
    assert meta["decisions"]["decisions.encoder.layers.2.attn.k"] == {"kind": "budget", "layer": "encoder.layers.2.attn",
                                                                     "field": "k"}
    assert meta["inputs"]["patches"]["shape"] == ["batch", "sequence", 12]
    assert report.outputs["output"].needed_atol <= report.tolerance["atol"]
    seen = report.decisions["decisions.encoder.layers.0.attn.k"].values_seen
    assert len(seen) >= 2  # the inputs exercise the budget


@pytest.mark.parametrize("target, variant, options, suffix", _slow_but({"onnx-sparse", "coreml-fp16"}), ids=IDS)
def test_mixed_decoder_on_every_target(decoder, tmp_path, target, variant, options, suffix):
    """(b): TSA blocks and elastic layers alternating, a stacked KV cache, prefill and decode steps."""
    meta, report = _export_and_check(decoder, um.decoder_example(), um.decoder_inputs(decoder, 200), tmp_path,
                                     target, variant, options, suffix, dynamic_shapes=um.decoder_dynamic_shapes())
    assert {d["kind"] for d in meta["decisions"].values()} == {"keep", "head_mode"}
    assert "decisions.gates.1.keep" in meta["decisions"] and "decisions.layers.3.mix.sa" in meta["decisions"]
    assert meta["inputs"]["attention_mask"]["shape"] == ["batch", "past_sequence + sequence"]
    assert meta["inputs"]["past_keys"]["shape"] == [4, "batch", 4, "past_sequence", 8]
    for name in ("decisions.gates.1.keep", "decisions.layers.1.mix.sa"):
        assert len(report.decisions[name].values_seen) == 2


def test_decisions_are_readable_in_eager_mode(patch_model):
    import torch

    from adaptex import nn as ann

    x, mask = torch.randn(2, 9, 12), torch.ones(2, 9, dtype=torch.bool)
    with ann.record_decisions(patch_model) as rec:
        patch_model(x, mask)
    assert set(rec.decisions) == {"encoder.layers.0.attn", "encoder.layers.2.attn"}
    k = rec.decisions["encoder.layers.0.attn"]["k"]
    assert k.shape == (2,) and (rec.decisions["encoder.layers.0.attn"]["head_mask"].sum(-1) == k).all()
    # a replay: every sample of layer 0 forced to the first head only
    forced = torch.zeros(2, 4, dtype=torch.bool)
    forced[:, 0] = True
    with ann.record_decisions(patch_model, force={"encoder.layers.0.attn": {"head_mask": forced}}) as rec2:
        patch_model(x, mask)
    assert torch.equal(rec2.decisions["encoder.layers.0.attn"]["head_mask"], forced)


def test_soft_mode_trains_and_the_losses_read_the_recorder(patch_model):
    import copy

    import torch

    from adaptex import nn as ann

    model = copy.deepcopy(patch_model).train()
    x, mask = torch.randn(4, 9, 12), torch.ones(4, 9, dtype=torch.bool)
    with ann.record_decisions(model) as rec:
        logits = model(x, mask)
    loss = logits.pow(2).mean() + ann.budget_loss(rec, 0.25, 0.5, beta=0.01)
    loss.backward()
    router = model.encoder["layers"][0].attn.router.budget[0].weight
    assert router.grad is not None and router.grad.abs().sum() > 0  # soft mode: routing is differentiable
    assert "k" not in rec.decisions["encoder.layers.0.attn"]  # no hard decision while training


def test_an_op_without_a_lowering_names_op_target_and_reason(patch_model, tmp_path):
    import torch

    def refuse(ctx, node):
        """Test refusal."""

    entry = registry.Lowering("adaptex::budgeted_attention", "coreml", "sparse", refuse,
                              unsupported_reason="this test's Core ML has no dynamic gather")
    example = (torch.randn(3, 10, 12), torch.ones(3, 10, dtype=torch.bool))
    with registry.override(entry, replace=True):
        with pytest.raises(UnsupportedLowering) as e:
            adaptex.export(patch_model, example, tmp_path / "m.mlpackage", target="coreml")
    msg = str(e.value)
    assert "adaptex::budgeted_attention" in msg and "coreml" in msg and "no dynamic gather" in msg
    assert not (tmp_path / "m.mlpackage").exists()


def test_export_needs_example_inputs_for_a_model_of_your_own(patch_model, tmp_path):
    from adaptex.graphs.errors import InputError

    with pytest.raises(InputError, match="example_inputs are needed"):
        adaptex.export(patch_model, None, tmp_path / "m.onnx")


MODULE = textwrap.dedent('''
    import torch
    import adaptex.nn as ann


    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(6, 16)
            self.attn = ann.BudgetedAttention(16, 4, router_hidden=8)
            self.head = torch.nn.Linear(16, 3)

        def forward(self, features, mask):
            x = self.embed(features)
            return self.head(self.attn(x, mask).mean(1))


    def build():
        torch.manual_seed(1)
        model = Tiny().eval()
        with torch.no_grad():
            model.attn.router.budget[2].weight.mul_(10)
            model.attn.router.scorer[2].weight.mul_(10)
            model.head.weight.mul_(10)
        return model, (torch.randn(2, 5, 6), torch.ones(2, 5, dtype=torch.bool))
''')


def test_the_cli_takes_a_model_of_your_own(tmp_path, capsys, monkeypatch):
    """`adaptex export MODULE:FUNCTION`, then check and inspect with --inputs FILE.npz."""
    (tmp_path / "my_tiny_model.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "inputs.npz", features=rng.normal(size=(40, 7, 6)).astype(np.float32),
             mask=np.ones((40, 7), bool))
    for target, out in (("onnx", "tiny.onnx"), ("coreml", "tiny.mlpackage")):
        assert main(["export", "my_tiny_model:build", "--target", target, "-o", str(tmp_path / out)]) == 0
        assert main(["check", str(tmp_path / out), "--model", "my_tiny_model:build", "--inputs",
                     str(tmp_path / "inputs.npz"), "--json"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["passed"] and r["samples"] == 40 and r["unexcused_flips"] == 0
    assert main(["inspect", str(tmp_path / "tiny.onnx")]) == 0
    out = capsys.readouterr().out
    assert "decisions.attn.k" in out and "budget" in out and "custom" in out
    # without its model, the CLI says how to check it
    assert main(["check", str(tmp_path / "tiny.onnx")]) == 2
    assert "adaptex.check(path, model, inputs=...)" in capsys.readouterr().err
    del sys.modules["my_tiny_model"]


def test_a_spec_naming_something_not_callable_is_refused_in_one_line(tmp_path, capsys):
    """MODULE:NAME where NAME is data, not a function (a fuzz-found case): a usage error, exit 2."""
    out = tmp_path / "m.onnx"
    assert main(["export", "tests.support.zoo:TINY_TSA", "--target", "onnx", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is a dict, not a function" in err and "unexpected" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("spec, says", [(":", "needs both names"), ("tests.support.zoo:", "needs both names"),
                                         (":tiny_model", "needs both names"), (".zoo:f", "cannot import")])
def test_a_spec_missing_a_name_is_refused_in_one_line(tmp_path, capsys, spec, says):
    """MODULE:FUNCTION with a name missing or one importlib refuses (':' was a fuzz-found case: a raw
    ValueError): a usage error, exit 2, no file."""
    out = tmp_path / "m.onnx"
    assert main(["export", spec, "--target", "onnx", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and "unexpected" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_check_refuses_a_model_that_is_not_the_source(patch_model, tmp_path):
    import copy

    import torch

    from adaptex.graphs.errors import AdaptexError

    example = (torch.randn(3, 10, 12), torch.ones(3, 10, dtype=torch.bool))
    adaptex.export(patch_model, example, tmp_path / "m.onnx")
    other = copy.deepcopy(patch_model)
    with torch.no_grad():
        other.head[1].bias.add_(1.0)
    with pytest.raises(AdaptexError, match="not the ones this artifact was exported from"):
        adaptex.check(tmp_path / "m.onnx", other, inputs=um.patch_inputs(2))
