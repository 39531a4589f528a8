"""Elastic decoders' training recipe: routers by distillation from the frozen backbone, calibration of
the SA-logit shift, evaluation and its summary table."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.elastic_decoder import ElasticDecoder, ElasticDecoderConfig
from adaptex.graphs.nn import sparsity


@dataclass
class ElasticDecoderTrainConfig:
    steps: int = 300
    batch_size: int = 8
    context: int = 512
    lr: float = 3e-3
    lambda_lr: float = 0.05
    tau_start: float = 1.0
    tau_end: float = 0.1
    seed: int = 0


def _kl(full_logits: Tensor, logits: Tensor) -> Tensor:
    """Mean over tokens of KL(full || elastic) between next-token distributions."""
    return _kl_terms(full_logits, logits).mean()


def _kl_terms(full_logits: Tensor, logits: Tensor) -> Tensor:
    """KL(full || elastic) of each position (N,)."""
    lp_full = full_logits.log_softmax(-1)
    return (lp_full.exp() * (lp_full - logits.log_softmax(-1))).sum(-1)


def train_elastic_decoder(model: ElasticDecoder, task, tc: ElasticDecoderTrainConfig, session=None) -> ElasticDecoder:
    """Routers only, by distillation from the frozen backbone's full attention: min over the routers,
    max over lambda1, lambda2. Data-parallel under torchrun (session.dp): the KL is a mean over the
    global batch's real tokens and the SA fraction over its samples, so lambda moves alike in every
    process."""
    from adaptex.graphs.nn.elastic import sparsity_per_row
    from adaptex.graphs.recipes.session import Session, seed_everything

    session = session or Session()
    dp = session.dp
    dp.check_batch(tc.batch_size)
    seed_everything(tc.seed)
    rng = np.random.default_rng(tc.seed)
    net = dp.wrap(model)  # before the optimiser: sharding replaces the parameters
    opt = torch.optim.AdamW(model.routers.parameters(), lr=tc.lr, weight_decay=0.0)
    state, t = {"lam1": 0.0, "lam2": 0.0}, model.cfg.target_sparsity
    model.train()
    for step in session.steps("elastic", model, opt, None, rng, tc.steps, state):
        lam1, lam2 = state["lam1"], state["lam2"]
        tau = tc.tau_start * (tc.tau_end / tc.tau_start) ** ((step - 1) / max(1, tc.steps - 1))
        b = dp.rows(task.sample(tc.batch_size, rng))
        with torch.no_grad():
            full, _, _ = model(b.input_ids, b.attention_mask, mode="full")
        with dp.step():
            logits, decisions, _ = net(b.input_ids, b.attention_mask, mode="soft", tau=tau)
        m = b.loss_mask
        if dp.world == 1:  # one process computes exactly what it computes without torchrun
            kl, omega = _kl(full[m], logits[m]), sparsity(decisions)
        else:
            kl = dp.ratio(_kl_terms(full[m], logits[m]).sum(), m.sum().float())
            omega = dp.mean_rows(sparsity_per_row(decisions))
        gap = omega - t
        loss = kl + lam1 * gap + lam2 * gap ** 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        gap = float(gap.detach())
        lam1 += tc.lambda_lr * gap
        lam2 = max(0.0, lam2 + tc.lambda_lr * gap ** 2)
        state["lam1"], state["lam2"] = lam1, lam2
        if step % 10 == 0 or step == tc.steps:
            session.show(**{"kl": kl.item(), "sa": omega.item(), "tau": tau, "lam1": lam1})
    return model.eval()


@torch.no_grad()
def evaluate_elastic_decoder(model: ElasticDecoder, task, n: int = 64, context: int = 512, seed: int = 1,
                             batch_size: int = 8, delta: float = 0.0, split: str = "val") -> dict:
    """Next-token loss of full attention and of the hard elastic model (SA logits shifted by -delta),
    the SA fraction, and the mean KL between them, on `n` windows of `context` tokens of `split`
    (the task's held-out text by default; `task.sample(n, rng, split=...)` draws them)."""
    rng = np.random.default_rng(seed)
    lf, le, kl, sa = [], [], [], []
    for start in range(0, n, batch_size):
        b = task.sample(min(batch_size, n - start), rng, split=split)
        ids, mask, m = b.input_ids, b.attention_mask, b.loss_mask
        full, _, _ = model(ids, mask, mode="full")
        force = None
        if delta:
            _, dec, _ = model(ids, mask, mode="hard")
            force = [(d["logits"][..., 1] - delta) > d["logits"][..., 0] for d in dec]
        el, dec, _ = model(ids, mask, mode="hard", force_sa=force)
        lf.append(F.cross_entropy(full[m], b.targets[m]))
        le.append(F.cross_entropy(el[m], b.targets[m]))
        kl.append(_kl(full[m], el[m]))
        sa.append(torch.stack([d["sa"].float() for d in dec], 1))  # (B, L, Hkv)
    sa = torch.cat(sa)
    full_loss, el_loss = float(torch.stack(lf).mean()), float(torch.stack(le).mean())
    return {"full_loss": full_loss, "elastic_loss": el_loss, "loss_increase": el_loss / full_loss - 1,
            "kl": float(torch.stack(kl).mean()), "sa_fraction": float(sa.mean()),
            "sa_fraction_per_layer": [float(x) for x in sa.mean((0, 2))], "n": n, "context": context}


@torch.no_grad()
def calibrate_decoder(model: ElasticDecoder, task, min_sparsity: float, deltas=(0.0, 0.25, 0.5, 1.0, 1.5),
                      n: int = 32, context: int = 512) -> dict:
    """The SA-logit shift (on training text: the held-out split stays held out) with the lowest loss
    whose SA fraction stays >= min_sparsity, baked into the routers' output bias (see
    graphs.elastic.calibrate)."""
    best = None
    for delta in deltas:
        r = evaluate_elastic_decoder(model, task, n=n, context=context, seed=7, delta=delta, split="train")
        if r["sa_fraction"] >= min_sparsity and (best is None or r["elastic_loss"] < best["elastic_loss"]):
            best = {**r, "delta": delta}
    best = best or {"delta": 0.0}
    for router in model.routers:
        router.router[2].bias[1] -= best["delta"]
    return {"delta": best["delta"], "sa_fraction": best.get("sa_fraction"), "elastic_loss": best.get("elastic_loss"),
            "min_sparsity": min_sparsity, "windows": n, "split": "train"}


def summary_table_decoder(r: dict, cfg: ElasticDecoderConfig, name: str = "the dense charlm decoder",
                          on_file: bool = False) -> str:
    per_layer = ", ".join(f"{x:.2f}" for x in r["sa_fraction_per_layer"])
    unit, where = ("token", "held-out lines of the data") if on_file else ("character", "json, email packages")
    heads = "SA KV heads" if cfg.kv_groups > 1 else "SA heads"
    return "\n".join([
        f"Elastic decoder on {name} (sink {cfg.sink}, window {cfg.window}, "
        f"target SA fraction {cfg.target_sparsity:.2f})",
        f"held-out windows: {r['n']} x {r['context']} {unit}s ({where})",
        f"{heads}: {100 * r['sa_fraction']:.1f}% (per layer: {per_layer})",
        f"next-{unit} loss: full attention {r['full_loss']:.4f}, elastic {r['elastic_loss']:.4f} "
        f"({100 * r['loss_increase']:+.2f}%); KL(full || elastic) {r['kl']:.4f} nats/{unit}",
    ])
