"""Training TSA decoders and their dense baseline on copy, sort and the character LM.

Loss = L_task + lambda * (1/(L-1)) * sum_l mean(1 - p_l) (the depth loss of docs/models/tsa.md;
lambda = 0 works: routing then only emerges from the task). The last `st_frac` of the steps run
straight-through (hard decisions forward, soft gradients back) so that the deployed hard model is
the trained one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

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
    # warm starts (--init): distillation and a controlled compute penalty
    distill: float = 0.0  # weight of KL(teacher || student); the task loss gets 1 - distill
    target_keep: float | None = None  # a keep rate to reach: lambda then follows dual ascent on the hard rate
    lambda_lr: float = 0.02  # dual ascent step: lambda += lambda_lr * (hard keep rate - target_keep)
    router_bias: float = -1.0  # the routers' output bias at init (p = sigmoid(bias) for every token)
    router_lr_mult: float = 1.0  # the routers' learning rate over the rest's
    router_init: str = "bias"  # "importance": fit fresh routers to skip what the start model's blocks change least


def _lm_loss(logits, batch, dp=None) -> torch.Tensor:
    """Mean cross-entropy over the target tokens of the (global, with dp) batch."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), reduction="none")
    m = batch.loss_mask.reshape(-1).float()
    return (ce * m).sum() / m.sum().clamp(min=1) if dp is None else dp.ratio((ce * m).sum(), m.sum())


def depth_loss(decisions: list[dict], mask: torch.Tensor, dp=None) -> torch.Tensor:
    """(1/(L-1)) * sum_l mean over real tokens (of the global batch, with dp) of (1 - p_l)."""
    m = mask.float()
    if dp is not None:
        return torch.stack([dp.ratio(((1 - d["p"]) * m).sum(), m.sum()) for d in decisions]).mean()
    return torch.stack([((1 - d["p"]) * m).sum() / m.sum().clamp(min=1) for d in decisions]).mean()


def optimizer(model: torch.nn.Module, tc: TSATrainConfig):
    """AdamW with a linear warm-up and a cosine decay over tc.steps (the routers at
    tc.router_lr_mult times the rate of the rest)."""
    routers = [p for n, p in model.named_parameters() if n.startswith("routers.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("routers.")]
    groups = [{"params": rest}, {"params": routers, "lr": tc.lr * tc.router_lr_mult}] \
        if routers and tc.router_lr_mult != 1.0 else model.parameters()
    opt = torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / tc.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / tc.steps))))
    return opt, sched


def optimizer_step(model: torch.nn.Module, opt, sched, loss: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def _kl_tokens(teacher_logits, logits, mask, dp=None) -> torch.Tensor:
    """Mean over the loss-mask tokens (of the global batch, with dp) of KL(teacher || student) between
    next-token distributions."""
    m = mask.reshape(-1)
    lp_t = teacher_logits.reshape(-1, teacher_logits.shape[-1])[m].float().log_softmax(-1)
    lp_s = logits.reshape(-1, logits.shape[-1])[m].float().log_softmax(-1)
    kl = (lp_t.exp() * (lp_t - lp_s)).sum(-1)
    return kl.mean() if dp is None or dp.world == 1 else dp.ratio(kl.sum(), m.sum().float())


@torch.no_grad()
def _block_inputs_and_updates(model: TSADecoder, b):
    """Per block of the (dense-mode) model: its input and its output, (B, T, d) each."""
    h, bias = model.embed(b.input_ids, b.attention_mask, 0)
    out = []
    for blk in model.blocks:
        new, _ = blk(h, bias, None, None, None, mode="dense")
        out.append((h, new))
        h = new
    return out


def init_routers_by_importance(model: TSADecoder, task, rng: np.random.Generator, target_keep: float,
                               batches: int = 8, batch_size: int = 32, fit_steps: int = 300,
                               kept_p: float = 0.05) -> dict:
    """A router initialisation that lets tokens leave: on a few batches of the start model (dense), score
    every token's next-block update by its size relative to the token's state, ||f_{l+1}(h)|| / ||h||;
    fit router l to skip the (1 - target_keep) of tokens with the smallest, then scale its last layer
    (p = 0.5 stays where it is) until the median kept token's p is `kept_p`, so that kept tokens'
    updates are barely scaled. Returns the fitted keep rates."""
    feats = [[] for _ in model.routers]
    scores = [[] for _ in model.routers]
    for _ in range(batches):
        b = task.sample(batch_size, rng)
        real = b.attention_mask.bool()
        io = _block_inputs_and_updates(model, b)
        for li in range(len(model.routers)):
            h = io[li][1]  # what router li sees: block li's output
            upd = io[li + 1][1] - io[li + 1][0]  # block li+1's update
            feats[li].append(h[real])
            scores[li].append((upd.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-6))[real])
    keeps = []
    for li, router in enumerate(model.routers):
        X, r = torch.cat(feats[li]), torch.cat(scores[li])
        y = (r <= torch.quantile(r, 1.0 - target_keep)).float()  # 1: skip
        opt = torch.optim.Adam(router.parameters(), lr=3e-3)
        for _ in range(fit_steps):
            idx = torch.from_numpy(rng.integers(0, len(X), size=min(4096, len(X))))
            loss = F.binary_cross_entropy_with_logits(router.net(X[idx]).squeeze(-1), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        with torch.no_grad():
            z = router.net(X).squeeze(-1)
            kept = z[z <= 0]
            if len(kept):
                scale = float(min(20.0, max(1.0, math.log(kept_p / (1 - kept_p)) / min(float(kept.median()), -1e-3))))
                router.net[2].weight.mul_(scale)
                router.net[2].bias.mul_(scale)
            keeps.append(float((router.probability(X) <= router.threshold).float().mean()))
    return {"keep_per_router": keeps}


def train_tsa(cfg: TSAConfig, task, tc: TSATrainConfig, desc: str = "train",
              init: dict | None = None, session=None, teacher=None, phase: str | None = None) -> TSADecoder:
    """Train from scratch, or from `init` (a state dict: e.g. a trained dense decoder's weights, the
    routers then starting fresh), distilled from `teacher` (a callable ids, mask -> logits) when
    tc.distill > 0. With tc.target_keep, lambda is a Lagrange multiplier: it rises while the
    deployed (hard) keep rate is above the target and falls below it, so tokens leave until the
    target is met whatever the scale of the task loss."""
    from adaptex.graphs.recipes.session import Session, seed_everything

    session = session or Session()
    seed_everything(tc.seed)
    rng = np.random.default_rng(tc.seed)
    model = TSADecoder(cfg)
    if cfg.adaptive:
        for r in model.routers:
            torch.nn.init.constant_(r.net[2].bias, tc.router_bias)
    if init is not None:
        missing, unexpected = model.load_state_dict(init, strict=False)
        if unexpected or any(not k.startswith("routers.") for k in missing):
            raise ValueError(f"init weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.adaptive and tc.router_init == "importance" and init is not None:
        init_routers_by_importance(model, task, rng, tc.target_keep if tc.target_keep is not None else 0.85)
    dp = session.dp
    dp.check_batch(tc.batch_size)
    net = dp.wrap(model)  # before the optimiser: sharding replaces the parameters
    opt, sched = optimizer(model, tc)
    st_from = int(tc.steps * (1 - tc.st_frac))
    state = {"lambda": 0.0 if tc.target_keep is not None else tc.lambda_depth}
    model.train()
    one = dp if dp.world > 1 else None  # one process computes exactly what it computes without torchrun
    for step in session.steps(phase or desc.strip(), model, opt, sched, rng, tc.steps, state, desc=desc):
        b = dp.rows(task.sample(tc.batch_size, rng))
        mode = "st" if (cfg.adaptive and step > st_from) else "soft"
        with dp.step():
            logits, decisions, _ = net(b.input_ids, b.attention_mask, mode=mode)
        task_loss = _lm_loss(logits, b, one)
        loss = task_loss
        if teacher is not None and tc.distill:
            with torch.no_grad():
                t_logits = teacher(b.input_ids, b.attention_mask)
            kl = _kl_tokens(t_logits, logits, b.loss_mask, one)
            loss = tc.distill * kl + (1 - tc.distill) * task_loss
        if cfg.adaptive and tc.target_keep is not None:
            hard = _global_alpha(decisions, b.attention_mask, one)
            loss = loss + state["lambda"] * depth_loss(decisions, b.attention_mask, one)
            state["lambda"] = max(0.0, state["lambda"] + tc.lambda_lr * (hard - tc.target_keep))
        elif cfg.adaptive and tc.lambda_depth:
            # a delayed, ramped depth loss: early on the FFNs have learnt nothing, so skipping them
            # costs nothing and the routers would learn to skip everything before the FFNs matter
            ramp = min(1.0, max(0.0, (step / tc.steps - tc.lambda_delay) / tc.lambda_delay)) if tc.lambda_delay else 1.0
            loss = loss + tc.lambda_depth * ramp * depth_loss(decisions, b.attention_mask, one)
        optimizer_step(model, opt, sched, loss)
        if step % 25 == 0 or step == tc.steps:
            fields = {"loss": float(task_loss.detach())}
            if teacher is not None and tc.distill:
                fields["kl"] = float(kl.detach())
            if cfg.adaptive:
                fields["alpha"] = _global_alpha(decisions, b.attention_mask, one, hard=(mode == "st"))
                if tc.target_keep is not None:
                    fields["keep"] = hard
                    fields["lambda"] = state["lambda"]
            session.show(**fields)
    return model.eval()


def _global_alpha(decisions: list[dict], mask: torch.Tensor, dp=None, hard: bool = True) -> float:
    """alpha (graphs/tsa.py) over the global batch's real tokens."""
    if dp is None:
        return alpha(decisions, mask, hard=hard)
    m = mask.float()
    with torch.no_grad():
        vals = [dp.ratio(((d["keep"].float() if hard else 1 - d["p"]) * m).sum(), m.sum()) for d in decisions]
    return float(torch.stack(vals).mean()) if vals else 1.0


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


# Per-task defaults. copy/sort: the model of the TSA paper (Mohammed, arXiv:2605.05222, 2026: d=128,
# L=6, H=4, d_ff=512). charlm: the same size rather than that paper's d=256 (4x the compute, too slow
# to train on 2 CPU cores), context 128, positions (and so the KV cache) up to 512 so prefill can be
# timed at T=512.
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


def summary_table_tsa(task_name: str, hard: dict, soft: dict, baseline: dict | None,
                      baseline_name: str | None = None) -> str:
    """TSA (hard, soft) against the dense decoder, with the TSA paper's figure for the task (PAPER:
    Mohammed, arXiv:2605.05222, 2026)."""
    lm = task_name in ("charlm", "file")
    head = f"{'model':<34} {'val loss':>9} {'tok acc':>8} {'seq acc':>8} {'alpha':>6} {'ops saved':>9}"
    rows = [head, "-" * len(head)]
    for name, r in (("TSA (hard, deployed)", hard), ("TSA (soft, training mode)", soft),
                    (baseline_name or "dense decoder (baseline)", baseline)):
        if r is None:
            continue
        rows.append(f"{name:<34} {r['loss']:9.4f} {r['token_accuracy']:8.4f} {r['sequence_accuracy']:8.4f} "
                    f"{r['alpha']:6.3f} {100 * r['ops_saved']:8.1f}%")
    if baseline is not None and lm:
        rows.append(f"loss increase of the deployed TSA over the {'model it started from' if baseline_name else 'dense decoder'}: "
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


# Warm starts (--init): distilled from the dense model; routers initialised by importance (fit to
# skip the tokens the start model's next block changes least, the last layer scaled so that kept
# tokens' gates stay near 1; router_bias is the constant-bias fallback), a larger rate for the
# routers, straight-through hard decisions throughout (the controller sees real skips), and lambda
# by dual ascent on the hard keep rate toward --ops-saved (default 15%). docs/training.md has the result.
WARM = dict(steps=300, batch_size=32, lr=3e-4, router_lr_mult=10.0, router_bias=-2.5, lambda_lr=1.0,
            st_frac=1.0, warmup=50, ops_saved=0.15, router_init="importance")


def _load_init(opts):
    """--init: an adaptex decoder checkpoint (tsa, dense or adaptive: routers dropped) or a GPT-2
    directory (its layers map onto TSA's blocks). Returns (TSAConfig kwargs, init state dict, teacher
    (ids, mask) -> logits, tokenizer spec or None (the task's), record for the checkpoint)."""
    from adaptex.graphs import checkpoint
    from adaptex.graphs.recipes import TrainError
    from adaptex.graphs.hf.tsa_weights import gpt2_as_tsa
    from adaptex.graphs.recipes.budgetformer import is_hf_dir

    if is_hf_dir(opts.init):
        return gpt2_as_tsa(opts.init)
    src, info = checkpoint.load(opts.init)
    if info["family"] != "tsa":
        raise TrainError(f"--init {opts.init}: a {info['family']} checkpoint; tsa starts from a decoder checkpoint "
                         "(tsa, e.g. charlm-dense or tsa-charlm) or a GPT-2 directory")
    c = src.cfg
    kw = dict(vocab_size=c.vocab_size, d_model=c.d_model, num_heads=c.num_heads, num_layers=c.num_layers,
              d_ff=c.d_ff, max_len=c.max_len, positions=c.positions, ln_eps=c.ln_eps, pad_id=c.pad_id)
    init = {k: v for k, v in src.state_dict().items() if not k.startswith("routers.")}
    mode = "hard" if c.adaptive else "dense"
    teacher = lambda ids, mask: src(ids, mask, mode=mode)[0]
    return kw, init, teacher, info.get("tokenizer"), {"checkpoint": opts.init, "sha256": info["sha256"]}


def run(opts, say, session=None):
    """`adaptex train tsa`: a TSA decoder on copy, sort or the character LM (and its dense baseline),
    from scratch or (opts.init) from a dense decoder's weights; with opts.dense the dense charlm
    decoder alone (the elastic decoder's backbone)."""
    from adaptex.graphs import checkpoint
    from adaptex.graphs.lm_tasks import LM_TASKS, get_lm_task
    from adaptex.graphs.recipes import TrainError, TrainResult
    from adaptex.graphs.recipes.session import Session

    session = session or Session()
    task_name = "file" if opts.data else (opts.task or ("charlm" if opts.init else "copy"))
    if task_name not in LM_TASKS + ("file",):
        raise TrainError(f"unknown task {task_name!r} for tsa; choose one of {', '.join(LM_TASKS)}, or --data FILE")
    p = dict(PRESETS["charlm" if opts.data else task_name])  # a user's text: the character LM's model
    if opts.init and not opts.dense:
        p.update({k: v for k, v in WARM.items() if k in ("steps", "batch_size", "lr")})
    for arg, key in (("d_model", "d_model"), ("heads", "num_heads"), ("layers", "num_layers"), ("d_ff", "d_ff"),
                     ("steps", "steps"), ("batch_size", "batch_size"), ("lr", "lr"),
                     ("lambda_depth", "lambda_depth"), ("max_len", "max_len")):
        if getattr(opts, arg, None) is not None:
            p[key] = getattr(opts, arg)
    if opts.dense:
        if task_name not in ("charlm", "file"):
            raise TrainError("--dense trains the dense charlm decoder (the elastic decoder's backbone); "
                             "use --task charlm or --data FILE")
        return _run_dense(opts, p, session)
    init = teacher = init_rec = None
    init_kw: dict = {}
    init_tok = None
    if opts.init:
        given = [f"--{a.replace('_', '-')}" for a in ("d_model", "heads", "layers", "d_ff") if getattr(opts, a) is not None]
        if given:
            raise TrainError(f"{given[0]} with --init: the shape comes from {opts.init}; leave {', '.join(given)} out")
        init_kw, init, teacher, init_tok, init_rec = _load_init(opts)
    data = None
    if opts.data:
        if init_tok is not None:  # the init model's tokenizer: its embeddings know no other
            from adaptex.graphs.data import TextCorpus, TextFiles, from_spec

            if opts.tokenizer:
                raise TrainError(f"--tokenizer with --init: {opts.init} brings its own tokenizer; leave --tokenizer out")
            files = TextFiles(opts.data, opts.eval_data)
            task, data = TextCorpus(files, from_spec(init_tok, str(opts.init)), opts.max_tokens or 128), files.describe()
        else:
            task, data = file_task(opts, opts.max_tokens or 128)
        p["max_len"] = opts.max_len or max(p["max_len"], task.seq_len)
    else:
        task = get_lm_task(task_name)
        if opts.init and init_tok is not None and task.tokenizer() != init_tok:
            raise TrainError(f"--init {opts.init}: its tokenizer is not the {task_name} task's; train on your text "
                             "with --data FILE (the model's tokenizer encodes it)")
    try:
        if opts.init:
            cfg = TSAConfig(**init_kw)
        else:
            cfg = TSAConfig(vocab_size=task.vocab_size, d_model=p["d_model"], num_heads=p["num_heads"],
                            num_layers=p["num_layers"], d_ff=p["d_ff"], max_len=p["max_len"], positions=p["positions"])
    except ValueError as e:
        raise TrainError(f"{e}; adjust --d-model/--heads/--layers") from None
    if cfg.max_len < task.seq_len:
        raise TrainError(f"--max-len {cfg.max_len} is shorter than the task's sequences ({task.seq_len}); "
                         + ("lower --max-tokens" if opts.init else "raise --max-len"))
    if opts.init and task.vocab_size > cfg.vocab_size:
        raise TrainError(f"--init {opts.init}: {cfg.vocab_size} embeddings, the task's vocabulary has {task.vocab_size}")
    tc = TSATrainConfig(steps=p["steps"], batch_size=p["batch_size"], lr=p["lr"], lambda_depth=p["lambda_depth"],
                        lambda_delay=p["lambda_delay"], seed=opts.seed, eval_size=opts.eval_size)
    if opts.init:
        target = WARM["ops_saved"] if opts.ops_saved is None else opts.ops_saved
        if not 0.0 < target < 1.0 - 1.0 / cfg.num_layers:
            raise TrainError(f"--ops-saved {target}: must lie in (0, {1 - 1 / cfg.num_layers:.3f}) (block 0 always runs)")
        tc.distill, tc.target_keep = 1.0, 1.0 - target * cfg.num_layers / (cfg.num_layers - 1)
        for k in ("router_lr_mult", "router_bias", "lambda_lr", "st_frac", "warmup", "router_init"):
            setattr(tc, k, WARM[k])
    elif opts.ops_saved is not None:
        raise TrainError("--ops-saved goes with --init (a warm start's target); from scratch use --lambda-depth")
    session.checkpoint_extra = {"description": opts.description or (
        f"TSA decoder from {opts.init}, fine-tuned on {opts.data or f'the {task_name} task'}" if opts.init else
        f"TSA decoder trained on {opts.data or f'the {task_name} task'}"), "tokenizer": init_tok or task.tokenizer()}
    t0 = time.perf_counter()
    model = train_tsa(cfg, task, tc, desc="tsa", session=session, init=init, teacher=teacher)
    checkpoint.round_weights(model, opts.save_dtype)  # evaluate exactly what gets stored
    n_eval = min(tc.eval_size, 400) if task_name in ("charlm", "file") else tc.eval_size
    hard = evaluate_tsa(model, task, n_eval, mode="hard")
    soft = evaluate_tsa(model, task, n_eval, mode="soft")
    baseline = start = None
    if opts.init:  # the model it started from, on the same held-out windows
        start = evaluate_teacher(teacher, task, n_eval)
    elif not opts.no_baseline:
        base = train_tsa(TSAConfig.from_dict({**cfg.to_dict(), "adaptive": False}), task, tc, desc="baseline",
                         session=session)
        checkpoint.round_weights(base, opts.save_dtype)
        baseline = evaluate_tsa(base, task, n_eval, mode="hard")
    table = summary_table_tsa(task_name, hard, soft, baseline or start,
                              baseline_name=f"--init {Path(opts.init).name} (start)" if opts.init else None)
    extra = {
        **session.checkpoint_extra,
        "training": {"task": task_name, "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     **session.record(), **({"init": init_rec} if init_rec else {}), **(data or {})},
        "evaluation": {"tsa_hard": hard, "tsa_soft": soft, "baseline": baseline, **({"init": start} if start else {})},
        "summary_table": table,
    }
    return TrainResult(model, extra, table)


@torch.no_grad()
def evaluate_teacher(teacher, task, n: int, seed: int = 12345, batch_size: int = 200) -> dict:
    """evaluate_tsa's loss and accuracy for a callable (ids, mask) -> logits (the model a warm start
    began from), on the same held-out windows."""
    rng = np.random.default_rng(seed)
    losses, tok_ok, tok_n = [], 0, 0
    for i in range(0, n, batch_size):
        kw = {"split": "val"} if getattr(task, "splits", False) else {}
        b = task.sample(min(batch_size, n - i), rng, **kw)
        logits = teacher(b.input_ids, b.attention_mask)
        losses.append(float(_lm_loss(logits, b)))
        tok_ok += int(((logits.argmax(-1) == b.targets) & b.loss_mask).sum())
        tok_n += int(b.loss_mask.sum())
    return {"loss": float(np.mean(losses)), "token_accuracy": tok_ok / max(tok_n, 1), "sequence_accuracy": 0.0,
            "alpha": 1.0, "ops_saved": 0.0}


def _run_dense(opts, preset: dict, session=None):
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
    session.checkpoint_extra = {"description": opts.description or "dense decoder", "tokenizer": task.tokenizer()}
    model = train_tsa(cfg, task, tc, desc="dense", init=init, session=session)
    checkpoint.round_weights(model, opts.save_dtype)
    n = min(tc.eval_size, 200)
    ev = evaluate_tsa(model, task, n, mode="dense", batch_size=20)
    table = (f"dense decoder: held-out loss {ev['loss']:.4f}, token accuracy {ev['token_accuracy']:.4f} "
             f"({n} windows of {context} characters)")
    what = f"language model on {opts.data}" if opts.data else "character LM on the Python stdlib sources"
    extra = {
        "description": opts.description or f"dense decoder, {what}, context {context}",
        "training": {"task": task.name, "context": context, "train_config": tc.__dict__, "init": opts.init,
                     "seconds": round(time.perf_counter() - t0, 1), **session.record(), **(data or {})},
        "evaluation": {"dense": ev}, "tokenizer": task.tokenizer(),
    }
    return TrainResult(model, extra, table, note="train elastic routers on it with "
                                                 "'adaptex train elastic --backbone {out} -o DIR'")
