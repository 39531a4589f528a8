"""Every decision margin pinned: a flip where the reference sat at twice the stated margin from its
boundary fails the run, one at half of it is excused (and its values then agree, replayed), on both
sides of each boundary; a flip at a fixed distance fails whatever the margins hold; and the margins
and tolerances docs/parity.md publishes are the code's.

The reference is a tiny model whose router is set so that every input sits at a chosen distance from
one boundary (a constant budget, head preference, keep probability or FA/SA logit gap). The
"artifact" is the same model with that one decision flipped and the rest computed from the flip, so
nothing but the margin decides the verdict."""
from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptex.graphs.family import family_contract
from adaptex.runtimes.parity import check
from adaptex.runtimes.report import FLIP_BOUNDS, MARGIN_UNITS, MARGINS, TOLERANCES
from adaptex.runtimes.torch_ref import TorchRunner
from tests.support import zoo


@functools.lru_cache(maxsize=None)
def _base(build):
    return build()


def fresh(build):
    """A private copy of a zoo model (the decoder's takes a second to centre its routers)."""
    return copy.deepcopy(_base(build))


def _ids(B: int, T: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, vocab, size=(B, T)).astype(np.int64)


def encoder_inputs(vocab: int) -> list[dict]:
    ids = _ids(3, 20, vocab)
    mask = np.ones_like(ids)
    mask[2, 12:] = 0  # a padded row
    return [{"input_ids": ids * mask, "attention_mask": mask}]


def decoder_inputs(vocab: int) -> list[dict]:
    """A prefill past the streaming window, then two decode steps."""
    ids = _ids(2, 14, vocab)
    return [{"input_ids": ids, "attention_mask": np.ones_like(ids), "prefill": 12}]


class Flipped(TorchRunner):
    """The model, with the decisions `flip(reference outputs)` returns forced in."""

    def __init__(self, model, flip):
        super().__init__(model)
        self.flip = flip

    def _infer(self, feeds):
        ref = self.reference(feeds)
        return self.reference(feeds, force=self.flip(ref.outputs)).outputs


def _top(p: np.ndarray, heads: list[int]) -> np.ndarray:
    mask = np.zeros(p.shape, bool)
    mask[:, heads] = True
    return mask


def _top_n(name: str, n: int):
    """The flip: the reference's top `n` heads (heads are preferred in index order)."""
    return lambda out: {name: _top(out[name], list(range(n)))}


def budget(gap: float, side: int = 1):
    """Layer 0's s*H sits `gap` from an integer for every input, heads preferred in index order:
    above it (s*H = 2 + gap: k = 2, the flip computes k = 1, head 0, as a k = 1 artifact must) or
    below it (s*H = 3 - gap: k = 2, the flip computes k = 3). s*H stays inside (0, H)."""
    model = fresh(zoo.tiny_model)
    router = model.layers[0].attn.router
    H = model.cfg.num_heads
    sH = min(max(2 + gap, 1e-6), H - 1e-6) if side > 0 else min(max(3 - gap, 1e-6), H - 1e-6)
    s = sH / H
    with torch.no_grad():
        router.budget[2].weight.zero_()
        router.budget[2].bias.fill_(math.log(s / (1 - s)))
        router.scorer[2].weight.zero_()
        router.scorer[2].bias.copy_(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    return model, _top_n("decisions.layer0.head_mask", 1 if side > 0 else 3), "decisions.layer0.k"


def head_set(gap: float, side: int = 1):
    """Layer 0 keeps k = 2 heads (s*H = 2.5) of preferences [0.4, 0.25 + gap/2, 0.25 - gap/2, 0.1]:
    heads 0 and 1, with a gap of `gap` between the 2nd and the 3rd; the flip takes heads 0 and 2.
    (A head set has one boundary, the gap; `side` is unused. The gap stays below 0.5: p sums to 1.)"""
    model = fresh(zoo.tiny_model)
    attn = model.layers[0].attn
    gap = min(gap, 0.5 - 1e-6)
    p = np.array([0.4, 0.25 + gap / 2, 0.25 - gap / 2, 0.1], np.float64)
    with torch.no_grad():
        attn.router.budget[2].weight.zero_()
        attn.router.budget[2].bias.fill_(math.log(0.625 / 0.375))
        attn.router.scorer[2].weight.zero_()
        attn.router.scorer[2].bias.copy_(torch.from_numpy(attn.tau * np.log(p)))
    swap = lambda out: {"decisions.layer0.head_mask": _top(out["decisions.layer0.head_mask"], [0, 2])}
    return model, swap, "decisions.layer0.head_mask"


def keep(gap: float, side: int = 1):
    """Block 1's router gives p = 0.5 + gap for every token (skipped; the flip keeps them) or
    p = 0.5 - gap (kept; the flip skips them). p stays inside (0, 1), whatever the gap."""
    model = fresh(zoo.tiny_tsa)
    last = model.routers[0].net[2]
    p = min(max(0.5 + side * gap, 1e-6), 1 - 1e-6)
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(math.log(p / (1 - p)))
    value = np.ones_like if side > 0 else np.zeros_like
    flip = lambda out: {"decisions.layer1.keep": value(out["decisions.layer1.keep"])}
    return model, flip, "decisions.layer1.keep"


def _head_mode(model, gap: float, side: int):
    with torch.no_grad():
        last = model.routers[0].router[2]
        last.weight.zero_()
        last.bias.copy_(torch.tensor([0.0, side * gap]))  # SA - FA = side * gap: every head SA, or every head FA
    value = np.zeros_like if side > 0 else np.ones_like
    flip = lambda out: {"decisions.layer0.sa": value(out["decisions.layer0.sa"])}
    return model, flip, "decisions.layer0.sa"


def head_mode(gap: float, side: int = 1):
    """Layer 0's router puts every head at SA (side +1) or FA (side -1) by a logit gap of `gap`; the
    flip gives every head the other mode."""
    return _head_mode(fresh(zoo.tiny_elastic), gap, side)


def head_mode_decoder(gap: float, side: int = 1):
    """As head_mode, at a decoder's prefill: the flip then rides into the decode steps as their
    head_modes input, which parity feeds from the replayed reference."""
    return _head_mode(fresh(zoo.tiny_elastic_decoder), gap, side)


CASES = {"budget": budget, "head_set": head_set, "keep": keep, "head_mode": head_mode,
         "head_mode (decoder)": head_mode_decoder}
# each kind's boundary approached from both sides (a head set's gap has one)
SIDES = {"budget": (1, -1), "head_set": (1,), "keep": (1, -1), "head_mode": (1, -1), "head_mode (decoder)": (1, -1)}
# the farthest a decision can sit from its boundary: s*H from the nearest integer, p from 0.5 and a head-set gap 0.5
REACH = {"budget": 0.5, "head_set": 0.5, "keep": 0.5, "head_mode": math.inf, "head_mode (decoder)": math.inf}


def _flip_report(case: str, gap: float, side: int, precision: str):
    model, flip, name = CASES[case](gap, side)
    inputs = (decoder_inputs if family_contract(model).decoder else encoder_inputs)(model.cfg.vocab_size)
    report = check(Flipped(model, flip), TorchRunner(model), inputs=inputs, precision=precision)
    stat = report.decisions[name]
    assert stat.kind == case.split()[0]
    assert stat.excused + stat.unexcused > 0, f"{case}: the planted flip did not happen"
    return report, stat, name


def _assert_verdict(report, stat, name: str, excused: bool, margin: float) -> None:
    if excused:
        assert stat.unexcused == 0 and report.passed, report.format()
        assert stat.excused == stat.compared - stat.agreed
    else:
        assert stat.excused == 0 and stat.unexcused > 0 and not report.passed, report.format()
        assert any(f.startswith(f"{name}: unexcused flip") and f"stated margin {margin:g}" in f
                   for f in report.failures), report.failures[:3]


CELLS = [(c, s) for c in sorted(CASES) for s in SIDES[c]]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case, side", CELLS, ids=[f"{c}{'+' if s > 0 else '-'}" for c, s in CELLS])
def test_a_flip_at_twice_the_margin_fails_and_at_half_is_excused(case, side, precision):
    """Both sides of each boundary: s*H = 2 + gap and 3 - gap, p = 0.5 + gap and 0.5 - gap, an
    SA - FA logit gap of +gap and -gap. A margin too wide for its kind's range (a keep margin of
    0.25 or more puts 2x past p = 0 or 1) is a failed assertion naming it, never an exception."""
    kind = case.split()[0]
    margin = MARGINS[precision][kind]
    assert 2 * margin < REACH[case], (f"the {precision} {kind} margin {margin:g} leaves no room for a flip outside "
                                      f"it: a {kind} decision is never more than {REACH[case]:g} from its boundary")
    for factor, excused in ((2.0, False), (0.5, True)):
        report, stat, name = _flip_report(case, factor * margin, side, precision)
        _assert_verdict(report, stat, name, excused, margin)


# A flip this far from its boundary fails at each precision: every published margin is below it, so
# a margin loosened past the published one (1e-4 -> 1e-2 for k in fp32) excuses it and fails here.
FIXED = {"fp32": 1e-3, "fp16": 5e-2}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_flip_at_a_fixed_distance_fails(case, precision):
    report, stat, name = _flip_report(case, FIXED[precision], SIDES[case][-1], precision)
    _assert_verdict(report, stat, name, False, MARGINS[precision][case.split()[0]])


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table under the line starting with `header` (cells stripped)."""
    lines = text[text.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_the_published_margins_and_tolerances_are_the_codes():
    """docs/parity.md's two tables, read cell by cell, equal report.MARGINS and report.TOLERANCES."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "parity.md").read_text()
    margins = {"fp32": {}, "fp16": {}}
    for row in _table(text, "| decision kind |"):  # the unit's |x| splits cells: kind first, figures last
        kind, fp32, fp16 = row[0].split("`")[1], row[-2], row[-1]
        margins["fp32"][kind], margins["fp16"][kind] = float(fp32), float(fp16)
    assert margins == {p: dict(MARGINS[p]) for p in ("fp32", "fp16")}
    tolerances = {}
    for precision, atol, rtol in _table(text, "| precision | atol | rtol |"):
        tolerances[precision.split()[0]] = {"atol": float(atol), "rtol": float(rtol)}
    assert tolerances == {p: dict(TOLERANCES[p]) for p in ("fp32", "fp16")}
    scaled, bounds = {}, {}
    for scheme, atol, bound in _table(text, "| scheme | atol (of the largest"):
        atol, _, floor = atol.partition(" (or ")  # "0.3 (or 0.01)": a fraction, or an absolute floor
        scaled[scheme] = {"atol": float(atol), "rtol": 0.0, "of_largest": True,
                          **({"floor": float(floor.rstrip(")"))} if floor else {})}
        bounds[scheme] = float(bound)
    assert scaled == {p: dict(TOLERANCES[p]) for p in scaled} and set(scaled) == set(FLIP_BOUNDS)
    assert bounds == FLIP_BOUNDS
    assert set(MARGINS["fp32"]) == set(MARGINS["fp16"]) == set(MARGIN_UNITS)
    for precision, distance in FIXED.items():
        assert max(MARGINS[precision].values()) < distance
