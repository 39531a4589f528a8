"""Training BudgetFormer and its same-size standard Transformer baseline, with a summary table."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from adaptex.graphs import losses
from adaptex.graphs.budgetformer import BudgetFormer, BudgetFormerConfig, RoutingSchedule, flops_per_sample

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    steps: int = 3000
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup: int = 100
    seed: int = 0
    budget_weight: float = 10.0
    tau_start: float = 2.0  # falls geometrically to the model's tau_infer
    noise_start: float = 0.5  # exploration noise std on head scores, falls linearly to 0
    beta_explore: float = -0.02  # entropy weight early (negative: rewards exploration)
    beta_exploit: float = 0.02  # entropy weight late (positive: rewards specialisation)
    rank_sharpness_start: float = 1.0  # budget-aware rank mask, sharpening to rank_sharpness_end
    rank_sharpness_end: float = 10.0
    eval_size: int = 2000


def schedule(tc: TrainConfig, cfg: BudgetFormerConfig, t: float) -> RoutingSchedule:
    return RoutingSchedule(
        tau=losses.geometric(t, tc.tau_start, cfg.tau_infer),
        noise_std=losses.linear(t, tc.noise_start, 0.0),
        rank_sharpness=losses.geometric(t, tc.rank_sharpness_start, tc.rank_sharpness_end),
    )


def distill_kl(teacher_logits: torch.Tensor, logits: torch.Tensor, dp=None) -> torch.Tensor:
    """Mean over rows (of the global batch, with dp) of KL(teacher || student) between the softmaxes
    of the last axis."""
    lp_t = teacher_logits.float().log_softmax(-1)
    rows = (lp_t.exp() * (lp_t - logits.float().log_softmax(-1))).sum(-1)
    return rows.mean() if dp is None else dp.mean_rows(rows)


def train_model(cfg: BudgetFormerConfig, task, tc: TrainConfig, desc: str = "train", session=None,
                init: dict | None = None, teacher: BudgetFormer | None = None, distill: float = 1.0,
                phase: str | None = None) -> BudgetFormer:
    """Train from scratch, or from `init` (a state dict: a dense model's weights, the routers fresh)
    with `teacher` (that model, frozen): the loss is then distill * KL(teacher || student) + (1 -
    distill) * cross-entropy, plus the budget and entropy terms."""
    from adaptex.graphs.recipes.session import Session, seed_everything

    session = session or Session()
    seed_everything(tc.seed)
    rng = np.random.default_rng(tc.seed)
    model = BudgetFormer(cfg)
    if init is not None:
        missing, unexpected = model.load_state_dict(init, strict=False)
        if unexpected or any(".router." not in k for k in missing):
            raise ValueError(f"init weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    dp = session.dp
    dp.check_batch(tc.batch_size)
    net = dp.wrap(model)  # before the optimiser: sharding replaces the parameters
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    lr_at = lambda step: tc.lr * min(1.0, (step + 1) / tc.warmup) * 0.5 * (1 + np.cos(np.pi * step / tc.steps))
    model.train()
    for step1 in session.steps(phase or desc.strip(), model, opt, None, rng, tc.steps, desc=desc):
        step = step1 - 1
        t = step / tc.steps
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        b = dp.rows(task.sample(tc.batch_size, rng))
        with dp.step():
            logits, decisions = net(b.input_ids, b.attention_mask, mode="soft", sched=schedule(tc, cfg, t))
        loss = task_loss = F.cross_entropy(logits, b.labels) if dp.world == 1 else \
            dp.mean_rows(F.cross_entropy(logits, b.labels, reduction="none"))
        if teacher is not None:
            with torch.no_grad():
                t_logits, _ = teacher(b.input_ids, b.attention_mask, mode="hard" if teacher.cfg.adaptive else "dense")
            loss = distill * distill_kl(t_logits, logits, dp) + (1 - distill) * task_loss
        if cfg.adaptive:
            budget = sum(losses.budget_hinge(dp.mean_rows(d["s"]), cfg.s_min, cfg.s_max) for d in decisions)
            entropy = sum(dp.mean_rows(losses.head_entropy(d["p"])) for d in decisions)
            beta = losses.entropy_beta(t, tc.beta_explore, tc.beta_exploit)
            loss = loss + tc.budget_weight * budget / len(decisions) + beta * entropy / len(decisions)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == tc.steps - 1:
            fields = {"loss": task_loss.item()}
            if cfg.adaptive:
                fields["s"] = torch.stack([dp.mean_rows(d["s"].detach()) for d in decisions]).mean().item()
            session.show(**fields)
    model.eval()
    return model


@torch.no_grad()
def evaluate(model: BudgetFormer, task, n: int, seed: int = 12345, mode: str = "hard") -> dict:
    """Held-out accuracy, heads used, FLOPs against the dense model, and mean s by difficulty."""
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    correct, per_level_s, per_level_k, per_level_acc, fracs, flop_ratios = [], {}, {}, {}, [], []
    for start in range(0, n, 256):
        b = task.sample(min(256, n - start), rng)
        logits, dec = model(b.input_ids, b.attention_mask, mode=mode if cfg.adaptive else "dense")
        ok = (logits.argmax(-1) == b.labels).float()
        correct.append(ok)
        lengths = b.attention_mask.sum(-1)
        for i in range(len(b.labels)):
            lv = int(b.difficulty[i])
            per_level_acc.setdefault(lv, []).append(float(ok[i]))
            if cfg.adaptive:
                ks = [float(d["k"][i]) for d in dec]
                per_level_s.setdefault(lv, []).append(float(np.mean([float(d["s"][i]) for d in dec])))
                per_level_k.setdefault(lv, []).append(np.mean(ks) / cfg.num_heads)
                fracs.append(np.mean(ks) / cfg.num_heads)
                T = int(lengths[i])
                flop_ratios.append(flops_per_sample(cfg, T, ks) / flops_per_sample(cfg, T, None))
    out = {
        "accuracy": float(torch.cat(correct).mean()),
        "accuracy_by_level": {lv: float(np.mean(v)) for lv, v in sorted(per_level_acc.items())},
    }
    if cfg.adaptive:
        out.update(
            heads_fraction=float(np.mean(fracs)),
            flop_ratio=float(np.mean(flop_ratios)),
            s_by_level={lv: float(np.mean(v)) for lv, v in sorted(per_level_s.items())},
            heads_by_level={lv: float(np.mean(v)) for lv, v in sorted(per_level_k.items())},
        )
    return out


def summary_table(task, adaptive: dict, soft: dict, baseline: dict | None) -> str:
    rows = [("model", "accuracy", "heads used", "FLOPs vs dense")]
    rows.append(("BudgetFormer (hard, deployed)", f"{adaptive['accuracy']:.4f}",
                 f"{adaptive['heads_fraction']:.1%}", f"{adaptive['flop_ratio']:.3f}"))
    rows.append(("BudgetFormer (soft, training mode)", f"{soft['accuracy']:.4f}", "100%", "1.000"))
    if baseline:
        rows.append(("standard Transformer, same size", f"{baseline['accuracy']:.4f}", "100%", "1.000"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    lines.append("")
    lines.append("difficulty level        mean s   heads(k/H)  acc(hard)" + ("  acc(baseline)" if baseline else ""))
    for lv, s in adaptive["s_by_level"].items():
        name = task.levels[lv] if lv < len(task.levels) else str(lv)
        frac = adaptive["heads_by_level"][lv]
        line = f"{lv} {name:<20}  {s:.3f}   {frac:6.1%}      {adaptive['accuracy_by_level'][lv]:.4f}"
        if baseline:
            line += f"     {baseline['accuracy_by_level'][lv]:.4f}"
        lines.append(line)
    return "\n".join(lines)


def soft_eval(model: BudgetFormer, task, tc: TrainConfig) -> dict:
    """Accuracy in training mode at the end of the schedule: the soft/hard gap is a quality figure."""
    rng = np.random.default_rng(12345)
    sched = RoutingSchedule(tau=model.cfg.tau_infer, noise_std=0.0, rank_sharpness=tc.rank_sharpness_end)
    correct = []
    with torch.no_grad():
        for start in range(0, tc.eval_size, 256):
            b = task.sample(min(256, tc.eval_size - start), rng)
            logits, _ = model(b.input_ids, b.attention_mask, mode="soft", sched=sched)
            correct.append((logits.argmax(-1) == b.labels).float())
    return {"accuracy": float(torch.cat(correct).mean())}


def is_hf_dir(path: str) -> bool:
    """A Hugging Face directory (a config.json without adaptex's 'family' key)."""
    import json

    cfg = Path(path, "config.json")
    if not cfg.is_file():
        return False
    try:
        return "family" not in json.loads(cfg.read_text())
    except (ValueError, UnicodeDecodeError):
        return False


def load_init(path: str, cfg_kw: dict):
    """A budgetformer checkpoint to start from (--init): its model (the teacher) and its weights
    without routers. Its shape and vocabulary are the new model's; any other family is refused."""
    from adaptex.graphs import checkpoint
    from adaptex.graphs.recipes import TrainError

    p = str(path)
    if is_hf_dir(p):
        raise TrainError(f"--init {p}: a Hugging Face directory; BudgetFormer (pre-norm, sinusoid positions, "
                         "max-pooled two-layer head) has no counterpart of BERT, RoBERTa or DistilBERT's post-norm "
                         "layers and learned positions; start from a budgetformer checkpoint (adaptex train "
                         "budgetformer --dense), or put elastic routers on it (adaptex train elastic --backbone DIR)")
    src, info = checkpoint.load(p)
    if info["family"] != "budgetformer":
        raise TrainError(f"--init {p}: a {info['family']} checkpoint; budgetformer starts from a budgetformer "
                         "checkpoint (a dense one from 'adaptex train budgetformer --dense', or an adaptive one)")
    c = src.cfg
    for key in ("d_model", "heads", "layers", "d_ff"):
        given = cfg_kw.get(key)
        have = {"d_model": c.d_model, "heads": c.num_heads, "layers": c.num_layers, "d_ff": c.d_ff}[key]
        if given is not None and given != have:
            raise TrainError(f"--{key.replace('_', '-')} {given}: --init {p} has {have}; leave it out (the "
                             "shape comes from the checkpoint)")
    init = {k: v for k, v in src.state_dict().items() if ".router." not in k}
    return src.eval(), init, info


def run(opts, say, session=None):
    """`adaptex train budgetformer`: the adaptive model and (unless no_baseline) its same-size baseline;
    with opts.dense the standard Transformer alone; with opts.init from a trained model's weights,
    distilled from it."""
    from adaptex.graphs import checkpoint
    from adaptex.graphs.recipes import TrainError, TrainResult
    from adaptex.graphs.recipes.session import Session
    from adaptex.graphs.tasks import get_task

    session = session or Session()
    defaults = dict(steps=3000, batch_size=64, lr=2e-3, d_model=256, heads=8, layers=2, d_ff=1024, task="graded")
    o = {k: getattr(opts, k) if getattr(opts, k) is not None else v for k, v in defaults.items()}
    teacher, init, init_info = None, None, None
    if opts.init:
        teacher, init, init_info = load_init(opts.init, {k: getattr(opts, k) for k in ("d_model", "heads", "layers", "d_ff")})
        c = teacher.cfg
        o.update(d_model=c.d_model, heads=c.num_heads, layers=c.num_layers, d_ff=c.d_ff)
        if opts.steps is None:
            o["steps"] = 1000
        if opts.lr is None:
            o["lr"] = 5e-4
    max_len = (opts.max_len or 256) if opts.data else 256  # positions; longer lines of a file are cut
    if opts.data:  # the user's JSONL: evaluated on its held-out lines (every model on the same ones)
        from adaptex.graphs.data import JsonlClassification

        task = JsonlClassification(opts.data, opts.eval_data, opts.tokenizer, max_len=max_len)
        held, eval_size, labels = task.held_out(), min(opts.eval_size, task.eval_count), task.labels
    else:
        task = get_task(o["task"])
        held, eval_size, labels = task, opts.eval_size, []
    if teacher is not None:
        c = teacher.cfg
        if (c.vocab_size, c.num_classes) != (task.vocab_size, task.num_classes) or list(c.labels) != list(labels):
            raise TrainError(f"--init {opts.init}: vocabulary {c.vocab_size} and {c.num_classes} classes "
                             f"{list(c.labels) or ''}, the data has {task.vocab_size} and {task.num_classes} "
                             f"{labels or ''}; start from a model trained on data of this task")
        max_len = c.max_len
    try:
        cfg = BudgetFormerConfig(vocab_size=task.vocab_size, num_classes=task.num_classes, d_model=o["d_model"],
                                 num_heads=o["heads"], num_layers=o["layers"], d_ff=o["d_ff"], max_len=max_len,
                                 s_min=opts.s_min, s_max=opts.s_max, labels=labels, adaptive=not opts.dense)
    except ValueError as e:
        raise TrainError(f"{e}; adjust --d-model/--heads or --s-min/--s-max") from None
    tc = TrainConfig(steps=o["steps"], batch_size=o["batch_size"], lr=o["lr"], seed=opts.seed, eval_size=eval_size,
                     warmup=50 if init else 100)
    what = f"{opts.data}" if opts.data else f"the {task.name} task"
    tokenizer = task.tokenizer_spec() if opts.data else (task.tokenizer() if hasattr(task, "tokenizer") else None)
    kind = "standard Transformer (dense)" if opts.dense else "BudgetFormer"
    session.checkpoint_extra = {"description": opts.description or f"{kind} trained on {what}",
                                **({"tokenizer": tokenizer} if tokenizer else {})}
    t0 = time.perf_counter()
    model = train_model(cfg, task, tc, desc="dense" if opts.dense else "budgetformer", session=session,
                        init=init, teacher=teacher, distill=1.0 if teacher is not None else 0.0)
    checkpoint.round_weights(model, opts.save_dtype)  # evaluate exactly what gets stored
    adaptive = evaluate(model, held, tc.eval_size)
    if opts.dense:
        table = f"standard Transformer (dense): held-out accuracy {adaptive['accuracy']:.4f}"
        evaluation = {"dense": adaptive}
    else:
        soft = soft_eval(model, held, tc)
        baseline = start = None
        if teacher is not None:  # the model it started from, on the same held-out examples
            start = evaluate(teacher, held, tc.eval_size)
        if not opts.no_baseline and teacher is None:
            base = train_model(BudgetFormerConfig.from_dict({**cfg.to_dict(), "adaptive": False}), task, tc,
                               desc="baseline", session=session)
            baseline = evaluate(base, held, tc.eval_size)
        table = summary_table(task, adaptive, soft, baseline or start)
        if start is not None:
            table = table.replace("standard Transformer, same size", f"--init {Path(opts.init).name} (start)")
        evaluation = {"budgetformer": adaptive, "soft_mode": soft, "baseline": baseline}
        if start is not None:
            evaluation["init"] = start
    extra = {
        **session.checkpoint_extra,
        "training": {"task": task.name, "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     **session.record(), **({"init": {"checkpoint": opts.init, "sha256": init_info["sha256"]}}
                                            if init_info else {})},
        "evaluation": evaluation,
        "summary_table": table,
    }
    if opts.data:
        extra["training"].update(task.describe())
    return TrainResult(model, extra, table)
