"""Training TSA decoders and their dense baseline on copy, sort and the character LM.

Loss = L_task + lambda * (1/(L-1)) * sum_l mean(1 - p_l) (DESIGN §1; lambda = 0 works: routing then
only emerges from the task). The last `st_frac` of the steps run straight-through (hard decisions
forward, soft gradients back) so that the deployed hard model is the trained one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from adaptex.graphs.recipes.progress import Progress
from adaptex.graphs.tsa import TSAConfig, TSADecoder, alpha, ops_saved


@dataclass
class TSATrainConfig:
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 100
    lambda_depth: float = 0.1
    st_frac: float = 0.3
    lambda_delay: float = 0.0  # fraction of steps before the depth loss starts (then a linear ramp as long)
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


def optimizer(model: torch.nn.Module, tc: TSATrainConfig):
    """AdamW with a linear warm-up and a cosine decay over tc.steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / tc.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / tc.steps))))
    return opt, sched


def optimizer_step(model: torch.nn.Module, opt, sched, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def train_tsa(cfg: TSAConfig, task, tc: TSATrainConfig, desc: str = "train",
              init: dict | None = None) -> TSADecoder:
    """Train from scratch, or from `init` (a state dict: e.g. a trained dense decoder's weights, the
    routers then starting fresh)."""
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    model = TSADecoder(cfg)
    if init is not None:
        missing, unexpected = model.load_state_dict(init, strict=False)
        if unexpected or any(not k.startswith("routers.") for k in missing):
            raise ValueError(f"init weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    opt, sched = optimizer(model, tc)
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
            # a delayed, ramped depth loss: early on the FFNs have learnt nothing, so skipping them
            # costs nothing and the routers would learn to skip everything before the FFNs matter
            ramp = min(1.0, max(0.0, (step / tc.steps - tc.lambda_delay) / tc.lambda_delay)) if tc.lambda_delay else 1.0
            loss = loss + tc.lambda_depth * ramp * depth_loss(decisions, b.attention_mask)
        optimizer_step(model, opt, sched, loss)
        if step % 25 == 0 or step == tc.steps:
            fields = {"loss": float(task_loss.detach())}
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
        kw = {"split": "val"} if getattr(task, "splits", False) else {}
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


# Per-task defaults. copy/sort: the paper's model (d=128, L=6, H=4, d_ff=512). charlm: the same
# size rather than the paper's d=256 (4x the compute, too slow to train on 2 CPU cores), context 128,
# positions (and so the KV cache) up to 512 so prefill can be timed at T=512.
PRESETS = {
    "copy": dict(d_model=128, num_heads=4, num_layers=6, d_ff=512, max_len=32, positions="learned",
                 steps=600, batch_size=64, lr=1e-3, lambda_depth=0.1, lambda_delay=0.2),
    "sort": dict(d_model=128, num_heads=4, num_layers=6, d_ff=512, max_len=32, positions="learned",
                 steps=1500, batch_size=64, lr=1e-3, lambda_depth=0.1, lambda_delay=0.2),
    "charlm": dict(d_model=128, num_heads=4, num_layers=6, d_ff=512, max_len=512, positions="sinusoid",
                   steps=3000, batch_size=32, lr=2e-3, lambda_depth=0.01, lambda_delay=0.3),
}
PAPER = {"copy": "54.9% saved at full accuracy", "sort": "22.5% saved",
         "charlm": "14-23% saved at < 0.5% loss increase"}


def summary_table_tsa(task_name: str, hard: dict, soft: dict, baseline: dict | None) -> str:
    """TSA (hard, soft) against the dense decoder, with the paper's figure for the task."""
    lm = task_name in ("charlm", "file")
    head = f"{'model':<34} {'val loss':>9} {'tok acc':>8} {'seq acc':>8} {'alpha':>6} {'ops saved':>9}"
    rows = [head, "-" * len(head)]
    for name, r in (("TSA (hard, deployed)", hard), ("TSA (soft, training mode)", soft),
                    ("dense decoder (baseline)", baseline)):
        if r is None:
            continue
        rows.append(f"{name:<34} {r['loss']:9.4f} {r['token_accuracy']:8.4f} {r['sequence_accuracy']:8.4f} "
                    f"{r['alpha']:6.3f} {100 * r['ops_saved']:8.1f}%")
    if baseline is not None and lm:
        rows.append(f"loss increase of the deployed TSA over the dense decoder: "
                    f"{100 * (hard['loss'] / baseline['loss'] - 1):+.2f}%")
    if task_name in PAPER:
        rows.append(f"paper (TSA, {task_name}): {PAPER[task_name]}")
    return "\n".join(rows)


def file_task(opts, context: int):
    """The user's text as next-token windows of `context` tokens, and what the checkpoint records of it."""
    from adaptex.graphs.data import TextCorpus, TextFiles, text_tokenizer

    files = TextFiles(opts.data, opts.eval_data, collect_chars=not opts.tokenizer)
    task = TextCorpus(files, text_tokenizer(files, opts.tokenizer), context)
    return task, files.describe()


# The dense decoder the elastic decoder sits on: the charlm decoder's size, trained at a longer
# context (SA only matters past the window) with positions to 4096 (benched up to there).
DENSE_DECODER = dict(context=512, max_len=4096, steps=1400, batch_size=8, lr=2e-3)


def run(opts, say):
    """`adaptex train tsa`: a TSA decoder on copy, sort or the character LM (and its dense baseline),
    or with opts.dense the dense charlm decoder alone (the elastic decoder's backbone)."""
    from adaptex.graphs import checkpoint
    from adaptex.graphs.lm_tasks import LM_TASKS, get_lm_task
    from adaptex.graphs.recipes import TrainError, TrainResult

    task_name = "file" if opts.data else (opts.task or "copy")
    if task_name not in LM_TASKS + ("file",):
        raise TrainError(f"unknown task {task_name!r} for tsa; choose one of {', '.join(LM_TASKS)}, or --data FILE")
    p = dict(PRESETS["charlm" if opts.data else task_name])  # a user's text: the character LM's model
    for arg, key in (("d_model", "d_model"), ("heads", "num_heads"), ("layers", "num_layers"), ("d_ff", "d_ff"),
                     ("steps", "steps"), ("batch_size", "batch_size"), ("lr", "lr"),
                     ("lambda_depth", "lambda_depth"), ("max_len", "max_len")):
        if getattr(opts, arg, None) is not None:
            p[key] = getattr(opts, arg)
    if opts.dense:
        if task_name not in ("charlm", "file"):
            raise TrainError("--dense trains the dense charlm decoder (the elastic decoder's backbone); "
                             "use --task charlm or --data FILE")
        return _run_dense(opts, p)
    data = None
    if opts.data:
        task, data = file_task(opts, opts.max_tokens or 128)
        p["max_len"] = opts.max_len or max(p["max_len"], task.seq_len)
    else:
        task = get_lm_task(task_name)
    try:
        cfg = TSAConfig(vocab_size=task.vocab_size, d_model=p["d_model"], num_heads=p["num_heads"],
                        num_layers=p["num_layers"], d_ff=p["d_ff"], max_len=p["max_len"], positions=p["positions"])
    except ValueError as e:
        raise TrainError(f"{e}; adjust --d-model/--heads/--layers") from None
    if cfg.max_len < task.seq_len:
        raise TrainError(f"--max-len {cfg.max_len} is shorter than the task's sequences ({task.seq_len}); "
                         "raise --max-len")
    tc = TSATrainConfig(steps=p["steps"], batch_size=p["batch_size"], lr=p["lr"], lambda_depth=p["lambda_depth"],
                        lambda_delay=p["lambda_delay"], seed=opts.seed, eval_size=opts.eval_size)
    t0 = time.perf_counter()
    model = train_tsa(cfg, task, tc, desc="tsa     ")
    checkpoint.round_weights(model, opts.save_dtype)  # evaluate exactly what gets stored
    n_eval = min(tc.eval_size, 400) if task_name in ("charlm", "file") else tc.eval_size
    hard = evaluate_tsa(model, task, n_eval, mode="hard")
    soft = evaluate_tsa(model, task, n_eval, mode="soft")
    baseline = None
    if not opts.no_baseline:
        base = train_tsa(TSAConfig.from_dict({**cfg.to_dict(), "adaptive": False}), task, tc, desc="baseline")
        checkpoint.round_weights(base, opts.save_dtype)
        baseline = evaluate_tsa(base, task, n_eval, mode="hard")
    table = summary_table_tsa(task_name, hard, soft, baseline)
    extra = {
        "description": opts.description or f"TSA decoder trained on {opts.data or f'the {task_name} task'}",
        "training": {"task": task_name, "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     "torch": torch.__version__, **(data or {})},
        "evaluation": {"tsa_hard": hard, "tsa_soft": soft, "baseline": baseline},
        "tokenizer": task.tokenizer(),
        "summary_table": table,
    }
    return TrainResult(model, extra, table)


def _run_dense(opts, preset: dict):
    """The dense decoder alone (no routers), optionally from a trained decoder's weights (--init)."""
    from adaptex.graphs import checkpoint
    from adaptex.graphs.lm_tasks import StdlibChars
    from adaptex.graphs.recipes import TrainError, TrainResult

    context = opts.max_tokens or DENSE_DECODER["context"]
    max_len = opts.max_len or DENSE_DECODER["max_len"]
    if context > max_len:
        raise TrainError(f"--max-tokens {context} (the training context) exceeds --max-len {max_len}; raise --max-len")
    task, data = file_task(opts, context) if opts.data else (StdlibChars(context=context), None)
    try:
        cfg = TSAConfig(vocab_size=task.vocab_size, d_model=preset["d_model"], num_heads=preset["num_heads"],
                        num_layers=preset["num_layers"], d_ff=preset["d_ff"], max_len=max_len, adaptive=False)
    except ValueError as e:
        raise TrainError(f"{e}; adjust --d-model/--heads/--layers") from None
    init = None
    if opts.init:  # start from a trained decoder's weights (a TSA checkpoint's routers are dropped)
        src, src_info = checkpoint.load(opts.init)
        if getattr(src.cfg, "family", "") != "tsa" or (src.cfg.d_model, src.cfg.num_layers, src.cfg.d_ff) != \
                (cfg.d_model, cfg.num_layers, cfg.d_ff):
            raise TrainError(f"--init {opts.init}: a {src_info['family']} checkpoint of another shape; pass a tsa "
                             f"checkpoint with d_model {cfg.d_model}, {cfg.num_layers} layers, d_ff {cfg.d_ff}")
        init = {k: v for k, v in src.state_dict().items() if not k.startswith("routers.")}
    tc = TSATrainConfig(steps=opts.steps or DENSE_DECODER["steps"],
                        batch_size=opts.batch_size or DENSE_DECODER["batch_size"],
                        lr=opts.lr or DENSE_DECODER["lr"], seed=opts.seed, eval_size=opts.eval_size,
                        warmup=50 if init else 100)
    t0 = time.perf_counter()
    model = train_tsa(cfg, task, tc, desc="dense   ", init=init)
    checkpoint.round_weights(model, opts.save_dtype)
    n = min(tc.eval_size, 200)
    ev = evaluate_tsa(model, task, n, mode="dense", batch_size=20)
    table = (f"dense decoder: held-out loss {ev['loss']:.4f}, token accuracy {ev['token_accuracy']:.4f} "
             f"({n} windows of {context} characters)")
    what = f"language model on {opts.data}" if opts.data else "character LM on the Python stdlib sources"
    extra = {
        "description": opts.description or f"dense decoder, {what}, context {context}",
        "training": {"task": task.name, "context": context, "train_config": tc.__dict__, "init": opts.init,
                     "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__, **(data or {})},
        "evaluation": {"dense": ev}, "tokenizer": task.tokenizer(),
    }
    return TrainResult(model, extra, table, note="train elastic routers on it with "
                                                 "'adaptex train elastic --backbone {out} -o DIR'")
