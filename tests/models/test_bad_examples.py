"""The Python API refuses, in one InputError, what cannot export a usable artifact or what its layers
cannot take, before any work; and export leaves the caller's model as it found it."""
from __future__ import annotations

import pytest
import torch

import adaptex
import adaptex.nn as ann
from adaptex.graphs.errors import InputError
from tests.support.user_models import patch_classifier


def _example(B=2, N=6):
    return torch.randn(B, N, 12), torch.ones(B, N, dtype=torch.bool)


@pytest.mark.parametrize("shape, message", [
    ((0, 6), r"patches: the example has batch 0 .* pass an example of batch >= 2"),
    ((1, 6), r"patches: the example has batch 1 .* meant to be dynamic.* batch >= 2, or mark the axis static in "
             r"dynamic_shapes"),
    ((2, 1), r"patches: the example has length 1 .* length >= 2"),
])
def test_examples_that_cannot_export_a_usable_artifact_are_refused(tmp_path, shape, message):
    with pytest.raises(InputError, match=message):
        adaptex.export(patch_classifier(), _example(*shape), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_size_1_axis_marked_static_is_taken():
    from adaptex.graphs.family import refuse_unexportable_examples

    refuse_unexportable_examples(["x"], (torch.randn(1, 5, 12),), ({0: None, 1: torch.export.Dim.AUTO},),
                                 explicit=True)
    with pytest.raises(InputError, match="length 1"):
        refuse_unexportable_examples(["x"], (torch.randn(3, 1, 12),), ([None, torch.export.Dim.AUTO, None],),
                                     explicit=True)


def _modes(model):
    return {name: m.training for name, m in model.named_modules()}


def test_a_refused_export_restores_the_training_mode(tmp_path):
    model = patch_classifier().train()
    model.head.eval()  # a mixed state comes back as it was, module by module
    before = _modes(model)
    with pytest.raises(InputError):  # refused after the model ran once in eval mode
        adaptex.export(model, _example(1), tmp_path / "n.onnx")
    assert _modes(model) == before


@pytest.mark.slow
def test_an_export_restores_the_training_mode(tmp_path):
    model = patch_classifier().train()
    before = _modes(model)
    adaptex.export(model, _example(), tmp_path / "m.onnx")
    assert _modes(model) == before and all(before.values())


@pytest.mark.parametrize("x, mask, message", [
    (torch.full((2, 5, 16), float("nan")), None, "x holds NaN or Inf"),
    (torch.tensor([[[float("inf")] * 16] * 5] * 2), None, "x holds NaN or Inf"),
    (torch.ones(2, 5, 16, dtype=torch.int64), None, "x has dtype torch.int64; pass floating-point features"),
    (torch.randn(2, 5), None, r"x has shape \[2, 5\]; this layer takes \(B, T, 16\)"),
    (torch.randn(2, 5, 8), None, r"x has shape \[2, 5, 8\]; this layer takes \(B, T, 16\)"),
    (torch.randn(2, 5, 16), torch.ones(2, 4, dtype=torch.bool),
     r"mask has shape \[2, 4\].*pass a mask of shape \[2, 5\]"),
    (torch.randn(2, 5, 16), torch.full((2, 5), 0.5), "mask has dtype torch.float32; pass a bool or integer 0/1 mask"),
])
def test_budgeted_attention_refuses_what_it_cannot_take(x, mask, message):
    layer = ann.BudgetedAttention(16, 4, router_hidden=8).eval()
    with pytest.raises(InputError, match=message):
        layer(x, mask)
    assert layer(torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.bool)).shape == (2, 5, 16)


def test_a_misspelt_input_name_is_one_line():
    from adaptex.api import _feeds

    with pytest.raises(InputError, match=r"'input_id': not an input of this artifact \(did you mean 'input_ids'\?\); "
                                         r"its inputs are input_ids, attention_mask"):
        _feeds([{"input_id": [[1, 2]], "attention_mask": [[1, 1]]}], ["input_ids", "attention_mask"])
