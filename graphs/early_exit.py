"""Early-exit baseline for TSA at matched compute (the comparison the TSA paper makes:
Mohammed, arXiv:2605.05222, 2026).

A dense decoder of the same size (TSADecoder with adaptive=False) with an exit after every block:
the shared final norm and tied LM head read the hidden state after block l. Training minimises the
mean over exits of the LM loss, so every exit learns to predict. At inference a token exits after
the first block whose exit is confident (max softmax probability >= threshold): its prediction is
that exit's, and its hidden state is frozen from then on. Later blocks still read it for their
keys and values (state propagation, as in CALM), so later tokens can attend to it. A token that
exits after block e ran e + 1 of the L blocks, so token-layer ops saved = 1 - mean(e + 1) / L,
TSA's metric, which counts a block's work per token the same way (keys and values aside).

The threshold is calibrated to match a target ops saved (TSA's) on held-out samples other than the
evaluation's, and the early-exit decoder is then evaluated on the same held-out data as TSA:
quality at matched compute. This is an eager reference for the comparison only; adaptex does not export it.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.recipes.progress import Progress
from adaptex.graphs.recipes.tsa import TSATrainConfig, _lm_loss, optimizer, optimizer_step
from adaptex.graphs.tsa import TSAConfig, TSADecoder


def _embed(model: TSADecoder, input_ids: Tensor, attention_mask: Tensor | None):
    return model.embed(input_ids, attention_mask, 0)


def _block(blk, h: Tensor, bias: Tensor, empty: tuple[Tensor, Tensor]) -> Tensor:
    a, _, _ = blk.attn(blk.ln1(h), bias, *empty)
    h = h + a
    return h + blk.ffn(blk.ln2(h))


def exit_logits(model: TSADecoder, h: Tensor) -> Tensor:
    """The shared exit: final norm and the tied LM head on any block's output."""
    return F.linear(model.ln_f(h), model.tok.weight)


def all_exit_logits(model: TSADecoder, input_ids: Tensor, attention_mask: Tensor | None = None) -> list[Tensor]:
    """Logits at every exit (after blocks 0..L-1), every token through every block (training)."""
    h, bias = _embed(model, input_ids, attention_mask)
    empty = model.empty_past(input_ids.shape[0])[0]
    out = []
    for blk in model.blocks:
        h = _block(blk, h, bias, empty)
        out.append(exit_logits(model, h))
    return out


@torch.no_grad()
def early_exit_forward(model: TSADecoder, input_ids: Tensor, attention_mask: Tensor | None,
                       threshold: float) -> tuple[Tensor, Tensor]:
    """Logits (B, T, V) from each token's exit, and the block each token exited after (B, T)."""
    h, bias = _embed(model, input_ids, attention_mask)
    empty = model.empty_past(input_ids.shape[0])[0]
    L = model.cfg.num_layers
    active = torch.ones(input_ids.shape, dtype=torch.bool)
    exited = torch.full(input_ids.shape, L - 1)
    final = None
    for li, blk in enumerate(model.blocks):
        h = torch.where(active[..., None], _block(blk, h, bias, empty), h)  # exited tokens stay frozen
        lg = exit_logits(model, h)
        final = lg if final is None else torch.where(active[..., None], lg, final)
        if li < L - 1:
            leave = active & (lg.softmax(-1).amax(-1) >= threshold)
            exited[leave] = li
            active &= ~leave
    return final, exited


def _ops_saved(exited: Tensor, mask: Tensor, L: int) -> float:
    m = mask.float()
    return 1.0 - float(((exited + 1).float() * m).sum() / m.sum().clamp(min=1)) / L


def train_early_exit(cfg: TSAConfig, task, tc: TSATrainConfig, desc: str = "early-exit") -> TSADecoder:
    """A dense decoder trained on the mean LM loss over its L exits (TSA's optimiser and schedule)."""
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    model = TSADecoder(TSAConfig.from_dict({**cfg.to_dict(), "adaptive": False}))
    opt, sched = optimizer(model, tc)
    bar = Progress(tc.steps, desc)
    model.train()
    for step in range(1, tc.steps + 1):
        b = task.sample(tc.batch_size, rng)
        losses = [_lm_loss(lg, b) for lg in all_exit_logits(model, b.input_ids, b.attention_mask)]
        loss = torch.stack(losses).mean()
        optimizer_step(model, opt, sched, loss)
        if step % 25 == 0 or step == tc.steps:
            bar.update(step, loss=float(losses[-1].detach()), first_exit=float(losses[0].detach()))
    return model.eval()


def _batches(task, n: int, seed: int, split: str | None, batch_size: int = 200):
    rng = np.random.default_rng(seed)
    kw = {"split": split} if task.name == "charlm" and split else {}
    for i in range(0, n, batch_size):
        yield task.sample(min(batch_size, n - i), rng, **kw)


@torch.no_grad()
def calibrate_threshold(model: TSADecoder, task, target_ops_saved: float, n: int = 400, seed: int = 777,
                        iters: int = 20) -> float:
    """The confidence threshold whose ops saved is closest to `target_ops_saved` (bisection: a lower
    threshold exits earlier and saves more), on held-out samples drawn with another seed than the
    evaluation's (for the character LM, other windows of the held-out text: calibrated on training
    text, the confidences ran higher and the held-out ops saved came out 3 points short)."""
    batches = list(_batches(task, n, seed, "val"))
    cache = {}

    def saved(thr: float) -> float:
        vals = [_ops_saved(early_exit_forward(model, b.input_ids, b.attention_mask, thr)[1], b.attention_mask,
                           model.cfg.num_layers) for b in batches]
        cache[thr] = float(np.mean(vals))
        return cache[thr]

    lo, hi = 0.0, 1.0 + 1e-6  # saved(lo) is the most, saved(hi) is 0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if saved(mid) > target_ops_saved:
            lo = mid
        else:
            hi = mid
    return min((lo, hi), key=lambda t: abs(cache.get(t, saved(t)) - target_ops_saved))


@torch.no_grad()
def evaluate_early_exit(model: TSADecoder, task, threshold: float, n: int = 2000, seed: int = 12345) -> dict:
    """evaluate_tsa's figures for the early-exit decoder at `threshold`, on the same held-out data."""
    losses, tok_ok, tok_n, seq_ok, saved = [], 0, 0, 0, []
    for b in _batches(task, n, seed, "val"):
        logits, exited = early_exit_forward(model, b.input_ids, b.attention_mask, threshold)
        losses.append(float(_lm_loss(logits, b)))
        right = (logits.argmax(-1) == b.targets) | ~b.loss_mask
        tok_ok += int((right & b.loss_mask).sum())
        tok_n += int(b.loss_mask.sum())
        seq_ok += int(right.all(-1).sum())
        saved.append(_ops_saved(exited, b.attention_mask, model.cfg.num_layers))
    return {"loss": float(np.mean(losses)), "token_accuracy": tok_ok / max(tok_n, 1),
            "sequence_accuracy": seq_ok / n, "ops_saved": float(np.mean(saved)), "threshold": threshold}
