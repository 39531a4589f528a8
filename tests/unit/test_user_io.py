"""torch.export's conventions for a model of your own: dynamic_shapes as a dict by argument name, a tuple
or a list (Dim, Dim.AUTO, Dim.DYNAMIC), keyword arguments, dict, tuple and nested outputs; anything else
is refused in one line naming the accepted forms. The README's "Bring your own model" model, on ONNX."""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import adaptex
import adaptex.nn as ann
from adaptex.graphs.errors import InputError
from tests.support.user_models import ReadmeTiny


Tiny = ReadmeTiny  # the README's model (tests/support/user_models.py)


class Nested(torch.nn.Module):
    """Keyword-only inputs, a constant keyword, and a nested dict / tuple output with a None in it."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.attn = ann.BudgetedAttention(16, 4, router_hidden=8)

    def forward(self, features, *, mask, scale: float = 1.0, pooled: bool = True):
        h = self.attn(self.embed(features), mask) * scale
        m = mask.to(h.dtype)[..., None]
        mean = (h * m).sum(1) / m.sum(1).clamp_min(1)
        return {"tokens": h, "pooled": (mean, h.amax(1)) if pooled else None, "extra": None}


B, S = Dim("batch", max=32), Dim("sequence", max=64)
EXAMPLE = (torch.randn(2, 10, 16), torch.ones(2, 10, dtype=torch.bool))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()


def _inputs(width: int = 16):
    out = []
    for b, t in [(1, 1), (1, 5), (4, 30), (3, 64)]:
        mask = torch.ones(b, t, dtype=torch.bool)
        mask[1:, t // 2 + 1:] = False
        out.append((torch.randn(b, t, width), mask))
    return out


@pytest.mark.parametrize("shapes", [
    {"features": {0: B, 1: S}, "mask": {0: B, 1: S}},  # torch.export's dict by argument name
    ({0: B, 1: S}, {0: B, 1: S}),
    [(B, S, None), (B, S)],  # a list, one Dim per axis
    {"features": {0: Dim.DYNAMIC, 1: Dim.AUTO}},  # the mask left out: every axis AUTO
], ids=["dict", "tuple", "list-per-axis", "hints"])
def test_every_dynamic_shapes_form_exports_and_checks(tiny, tmp_path, shapes):
    meta = adaptex.export(tiny, EXAMPLE, tmp_path / "t.onnx", dynamic_shapes=shapes)
    assert meta["inputs"]["features"]["shape"][2] == 16 and all(isinstance(a, str) for a in
                                                                 meta["inputs"]["features"]["shape"][:2])
    report = adaptex.check(tmp_path / "t.onnx", tiny, inputs=_inputs())
    assert report.passed, report.format()


def test_the_dict_form_names_the_axes(tiny, tmp_path):
    meta = adaptex.export(tiny, EXAMPLE, tmp_path / "t.onnx",
                          dynamic_shapes={"features": {0: B, 1: Dim("tokens", max=64)}, "mask": {0: B, 1: Dim("tokens", max=64)}})
    assert meta["inputs"]["features"]["shape"] == ["batch", "tokens", 16]
    assert meta["inputs"]["mask"]["shape"] == ["batch", "tokens"]


@pytest.mark.parametrize("shapes, says", [
    ({"feats": {0: B}}, "'feats', not an argument"),
    ("batch", "is a str"),
    (({0: B},), "1 entries for 2 arguments"),
    (({0: "batch"}, None), "dynamic_shapes['features'][0]"),
    (({7: B}, None), "dynamic_shapes['features'][7]"),
    (((B, S), None), "has 2 axes; features has 3"),
    ((5, None), "dynamic_shapes['features'] is a int"),
])
def test_any_other_form_is_refused_in_one_line(tiny, tmp_path, shapes, says):
    with pytest.raises(InputError) as e:
        adaptex.export(tiny, EXAMPLE, tmp_path / "t.onnx", dynamic_shapes=shapes)
    msg = str(e.value)
    assert says in msg and "a dict keyed by argument name (features, mask)" in msg and "Dim.DYNAMIC" in msg
    assert "\n" not in msg and not (tmp_path / "t.onnx").exists()


def test_keyword_arguments_constants_and_nested_outputs(tmp_path):
    torch.manual_seed(1)
    model = Nested().eval()
    x, mask = torch.randn(3, 7, 6), torch.ones(3, 7, dtype=torch.bool)
    meta = adaptex.export(model, (x,), tmp_path / "n.onnx", example_kwargs={"mask": mask, "scale": 2.0},
                          dynamic_shapes={"features": {0: B, 1: S}, "mask": {0: B, 1: S}})
    assert list(meta["inputs"]) == ["features", "mask"]
    assert meta["call"] == {"keyword": ["mask"], "constants": {"scale": 2.0}}
    assert [n for n in meta["outputs"] if not n.startswith("decisions.")] == ["tokens", "pooled.0", "pooled.1"]
    report = adaptex.check(tmp_path / "n.onnx", model, inputs=_inputs(6))
    assert report.passed, report.format()
    # every argument by keyword: example_inputs as a dict
    meta = adaptex.export(model, {"features": x, "mask": mask}, tmp_path / "k.onnx")
    assert meta["call"]["keyword"] == ["features", "mask"]
    assert adaptex.check(tmp_path / "k.onnx", model, inputs=[{"features": a, "mask": m} for a, m in _inputs(6)]).passed


@pytest.mark.parametrize("example, kwargs, says", [
    ([torch.randn(2, 3, 6)], {"mask": object()}, "keyword argument 'mask' is a object"),
    ({"features": torch.randn(2, 3, 6)}, {"features": torch.randn(2, 3, 6)}, "given twice"),
    ("features", None, "example_inputs is a str"),
])
def test_bad_example_arguments_are_refused_in_one_line(tmp_path, example, kwargs, says):
    with pytest.raises(InputError, match=says):
        adaptex.export(Nested().eval(), example, tmp_path / "n.onnx", example_kwargs=kwargs)
