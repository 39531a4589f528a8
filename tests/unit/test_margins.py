"""Every decision margin pinned: a flip where the reference sat at twice the stated margin from its
boundary fails the run, one at half of it is excused (and its values then agree, replayed).

The reference is a tiny model whose router is set so that every input sits at a chosen distance from
one boundary (a constant budget, head preference, keep probability or FA/SA logit gap). The
"artifact" is the same model with that one decision flipped and the rest computed from the flip, so
nothing but the margin decides the verdict."""
from __future__ import annotations

import copy
import functools
import math

import numpy as np
import pytest
import torch

from adaptex.graphs.family import family_contract
from adaptex.runtimes.parity import check
from adaptex.runtimes.report import MARGINS
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


def budget(gap: float):
    """Layer 0's s*H = 2 + gap for every input (k = 2, margin gap), heads preferred in index order;
    the flip computes k = 1 (head 0, the top one, as a k = 1 artifact must)."""
    model = fresh(zoo.tiny_model)
    router = model.layers[0].attn.router
    s = (2 + gap) / model.cfg.num_heads
    with torch.no_grad():
        router.budget[2].weight.zero_()
        router.budget[2].bias.fill_(math.log(s / (1 - s)))
        router.scorer[2].weight.zero_()
        router.scorer[2].bias.copy_(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    top1 = lambda out: {"decisions.layer0.head_mask": out["decisions.layer0.head_mask"]
                        & (np.cumsum(out["decisions.layer0.head_mask"], -1) == 1)}
    return model, top1, "decisions.layer0.k"


def head_set(gap: float):
    """Layer 0 keeps k = 2 heads (s*H = 2.5) of preferences [0.4, 0.25 + gap/2, 0.25 - gap/2, 0.1]:
    heads 0 and 1, with a gap of `gap` between the 2nd and the 3rd; the flip takes heads 0 and 2."""
    model = fresh(zoo.tiny_model)
    attn = model.layers[0].attn
    p = np.array([0.4, 0.25 + gap / 2, 0.25 - gap / 2, 0.1], np.float64)
    with torch.no_grad():
        attn.router.budget[2].weight.zero_()
        attn.router.budget[2].bias.fill_(math.log(0.625 / 0.375))
        attn.router.scorer[2].weight.zero_()
        attn.router.scorer[2].bias.copy_(torch.from_numpy(attn.tau * np.log(p)))
    swap = lambda out: {"decisions.layer0.head_mask": _top(out["decisions.layer0.head_mask"], [0, 2])}
    return model, swap, "decisions.layer0.head_mask"


def keep(gap: float):
    """Block 1's router gives p = 0.5 + gap for every token (skipped, margin gap); the flip keeps them."""
    model = fresh(zoo.tiny_tsa)
    last = model.routers[0].net[2]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(math.log((0.5 + gap) / (0.5 - gap)))
    kept = lambda out: {"decisions.layer1.keep": np.ones_like(out["decisions.layer1.keep"])}
    return model, kept, "decisions.layer1.keep"


def _head_mode(model, gap: float):
    with torch.no_grad():
        last = model.routers[0].router[2]
        last.weight.zero_()
        last.bias.copy_(torch.tensor([0.0, gap]))  # SA - FA = gap: every head SA
    full = lambda out: {"decisions.layer0.sa": np.zeros_like(out["decisions.layer0.sa"])}
    return model, full, "decisions.layer0.sa"


def head_mode(gap: float):
    """Layer 0's router puts every head at SA by a logit gap of `gap`; the flip makes them FA."""
    return _head_mode(fresh(zoo.tiny_elastic), gap)


def head_mode_decoder(gap: float):
    """As head_mode, at a decoder's prefill: the flip then rides into the decode steps as their
    head_modes input, which parity feeds from the replayed reference."""
    return _head_mode(fresh(zoo.tiny_elastic_decoder), gap)


CASES = {"budget": budget, "head_set": head_set, "keep": keep, "head_mode": head_mode,
         "head_mode (decoder)": head_mode_decoder}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_flip_at_twice_the_margin_fails_and_at_half_is_excused(case, precision):
    kind = case.split()[0]
    margin = MARGINS[precision][kind]
    for factor, excused in ((2.0, False), (0.5, True)):
        model, flip, name = CASES[case](factor * margin)
        inputs = (decoder_inputs if family_contract(model).decoder else encoder_inputs)(model.cfg.vocab_size)
        report = check(Flipped(model, flip), TorchRunner(model), inputs=inputs, precision=precision)
        stat = report.decisions[name]
        assert stat.kind == kind
        assert stat.excused + stat.unexcused > 0, f"{case}: the planted flip did not happen"
        if excused:
            assert stat.unexcused == 0 and report.passed, report.format()
            assert stat.excused == stat.compared - stat.agreed
        else:
            assert stat.excused == 0 and stat.unexcused > 0 and not report.passed
            assert any(f.startswith(f"{name}: unexcused flip") and f"stated margin {margin:g}" in f
                       for f in report.failures), report.failures[:3]
