"""Training TSA decoders and their dense baseline on copy, sort and the character LM.

Loss = L_task + lambda * (1/(L-1)) * sum_l mean(1 - p_l) (DESIGN §1; lambda = 0 works: routing then
only emerges from the task). The last `st_frac` of the steps run straight-through (hard decisions
forward, soft gradients back) so that the deployed hard model is the trained one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from graphs.train import Progress
from graphs.tsa import TSAConfig, TSADecoder, alpha, ops_saved


@dataclass
class TSATrainConfig:
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 100
    lambda_depth: float = 0.1
    st_frac: float = 0.3
    seed: int = 0
    eval_size: int = 2000


def _lm_loss(logits, batch) -> torch.Tensor:
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), reduction="none")
    m = batch.loss_mask.reshape(-1).float()
    return (ce * m).sum() / m.sum().clamp(min=1)


def depth_loss(decisions: list[dict], mask: torch.Tensor) -> torch.Tensor:
    """(1/(L-1)) * sum_l mean over real tokens of (1 - p_l)."""
    m = mask.float()
    return torch.stack([((1 - d["p"]) * m).sum() / m.sum().clamp(min=1) for d in decisions]).mean()


def train_tsa(cfg: TSAConfig, task, tc: TSATrainConfig, desc: str = "train") -> TSADecoder:
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    model = TSADecoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / tc.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / tc.steps))))
    bar = Progress(tc.steps, desc)
    st_from = int(tc.steps * (1 - tc.st_frac))
    model.train()
    for step in range(1, tc.steps + 1):
        b = task.sample(tc.batch_size, rng)
        mode = "st" if (cfg.adaptive and step > st_from) else "soft"
        logits, decisions, _ = model(b.input_ids, b.attention_mask, mode=mode)
        task_loss = _lm_loss(logits, b)
        loss = task_loss
        if cfg.adaptive and tc.lambda_depth:
            loss = loss + tc.lambda_depth * depth_loss(decisions, b.attention_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == tc.steps:
            fields = {"loss": float(task_loss)}
            if cfg.adaptive:
                fields["alpha"] = alpha(decisions, b.attention_mask, hard=(mode == "st"))
            bar.update(step, **fields)
    return model.eval()


@torch.no_grad()
def evaluate_tsa(model: TSADecoder, task, n: int = 2000, seed: int = 12345, mode: str = "hard",
                 batch_size: int = 200) -> dict:
    """Held-out loss, answer accuracy (copy/sort: per token and per sequence), alpha and ops saved."""
    rng = np.random.default_rng(seed)
    model.eval()
    losses, tok_ok, tok_n, seq_ok, alphas = [], 0, 0, 0, []
    for i in range(0, n, batch_size):
        kw = {"split": "val"} if task.name == "charlm" else {}
        b = task.sample(min(batch_size, n - i), rng, **kw)
        logits, decisions, _ = model(b.input_ids, b.attention_mask, mode=mode)
        losses.append(float(_lm_loss(logits, b)))
        right = (logits.argmax(-1) == b.targets) | ~b.loss_mask
        tok_ok += int((right & b.loss_mask).sum())
        tok_n += int(b.loss_mask.sum())
        seq_ok += int(right.all(-1).sum())
        alphas.append(alpha(decisions, b.attention_mask, hard=(mode != "soft")))
    a = float(np.mean(alphas)) if model.cfg.adaptive and mode != "dense" else 1.0
    return {"loss": float(np.mean(losses)), "token_accuracy": tok_ok / max(tok_n, 1),
            "sequence_accuracy": seq_ok / n, "alpha": a, "ops_saved": ops_saved(a, model.cfg.num_layers)}
