"""`adaptex train FAMILY`: train an adaptive model (and its same-size baseline) into a checkpoint."""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

from adaptex.cli._util import UsageError, add_memory_flag, count, say, set_threads


def add_parser(sub) -> None:
    s = sub.add_parser("train", help="train an adaptive model and its same-size baseline")
    s.add_argument("family", help="model family: budgetformer, tsa or elastic")
    s.add_argument("--task", default=None, help="budgetformer: graded (default) or stdlib; "
                                                "tsa: copy (default), sort or charlm")
    s.add_argument("--data", default=None, metavar="FILE|DIR",
                   help="train on your data instead of --task: budgetformer a JSONL file (each line {\"text\": ..., "
                        "\"label\": ...} or {\"ids\": [...], \"label\": ...}); tsa and elastic a text file or a "
                        "directory of them. Streamed, never loaded whole; about 10%% of the lines held out by a hash "
                        "of each line unless --eval is given")
    s.add_argument("--eval", dest="eval_data", default=None, metavar="FILE|DIR",
                   help="held-out data in --data's format (default: the hash-held-out lines of --data)")
    s.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                   help="a tokenizer.json (the tokenizers library) for text in --data; default: characters "
                        "seen in the data (an elastic backbone brings its own tokenizer)")
    s.add_argument("-o", "--output", required=True, help="checkpoint directory to write")
    s.add_argument("--backbone", default="minilm",
                   help="elastic: the frozen backbone: minilm (the packaged all-MiniLM-L6-v2), a Hugging Face "
                        "directory (config.json, model.safetensors, tokenizer.json) of BERT, RoBERTa, DistilBERT, "
                        "GPT-2 or LLaMA layout, or a dense decoder checkpoint (adaptex train tsa --dense)")
    s.add_argument("--target-sparsity", type=float, default=None,
                   help="elastic: target fraction of SA heads (default 0.6 encoder, 0.7 decoder)")
    s.add_argument("--sink", type=int, default=4, help="elastic: SA heads' sink tokens")
    s.add_argument("--window", type=int, default=None, help="elastic: SA heads' local window (default 32 encoder, 64 decoder)")
    s.add_argument("--max-tokens", type=count, default=None,
                   help="training text length: elastic encoder 256 tokens, elastic decoder and tsa --dense 512 "
                        "characters (a Hugging Face decoder: min(512, its positions) tokens), tsa --data 128 tokens")
    s.add_argument("--dense", action="store_true",
                   help="train the dense model alone: tsa --task charlm the dense decoder (the elastic decoder's "
                        "backbone), budgetformer the standard Transformer (a checkpoint to --init from)")
    s.add_argument("--init", default=None, metavar="CHECKPOINT|HF_DIR",
                   help="start from a trained dense model's weights, routers fresh, distilled from it (KL to its "
                        "logits) with a compute penalty that makes tokens leave: tsa from a decoder checkpoint "
                        "(e.g. charlm-dense) or a GPT-2 directory; budgetformer from a budgetformer checkpoint. "
                        "With --dense: the dense decoder's starting weights (e.g. tsa-charlm)")
    s.add_argument("--ops-saved", type=float, default=None,
                   help="tsa --init: the fraction of token-layer ops to save (default 0.15); the compute "
                        "penalty follows it")
    s.add_argument("--steps", type=count, default=None,
                   help="default: 3000 (budgetformer), per task (tsa), 300 (elastic)")
    s.add_argument("--batch-size", type=count, default=None)
    s.add_argument("--lr", type=float, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eval-size", type=count, default=2000, help="held-out examples for the summary")
    s.add_argument("--d-model", type=count, default=None, help="default: 256 (budgetformer), 128 (tsa)")
    s.add_argument("--heads", type=count, default=None)
    s.add_argument("--layers", type=count, default=None)
    s.add_argument("--d-ff", type=count, default=None)
    s.add_argument("--lambda-depth", type=float, default=None, help="tsa: weight of the depth loss (0 works)")
    s.add_argument("--max-len", type=count, default=None,
                   help="tsa: positions and KV cache bound; budgetformer --data: positions, longer lines are cut "
                        "(default 256)")
    s.add_argument("--s-min", type=float, default=0.25, help="budget target interval, lower end")
    s.add_argument("--s-max", type=float, default=0.375, help="budget target interval, upper end")
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--no-baseline", action="store_true", help="skip training the standard Transformer")
    s.add_argument("--save-dtype", default="float16", choices=["float16", "float32"],
                   help="weights storage; float16 halves the checkpoint, the model still computes in fp32")
    s.add_argument("--description", default=None)
    s.add_argument("--save-every", type=count, default=None, metavar="N",
                   help="write the checkpoint (with the state to resume from) to -o every N steps")
    s.add_argument("--resume", action="store_true",
                   help="continue the run that --save-every left at -o, bit for bit (same options and threads)")
    s.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train data-parallel in N processes on this machine (torchrun with "
                        "DistributedDataParallel: gloo on CPU, nccl on CUDA); --batch-size is the global batch. "
                        "Under your own torchrun, leave it out (docs/training.md)")
    s.add_argument("--fsdp", action="store_true",
                   help="with --nproc or under torchrun: shard the model's parameters, gradients and optimiser "
                        "state over the processes (FSDP) instead of a whole copy in each (DDP), for a backbone "
                        "that does not fit one device; the same results (docs/training.md)")
    s.add_argument("--quiet", action="store_true", help="no progress or notes on stderr")
    s.add_argument("--json", action="store_true", help="print the summary as JSON (also written to -o/summary.json)")
    add_memory_flag(s)
    s.set_defaults(run=run)


def run(args) -> int:
    from adaptex.graphs import checkpoint
    from adaptex.graphs.recipes import TrainError, recipes
    from adaptex.graphs.recipes.parallel import DataParallel

    if args.nproc is not None:
        return _launch(args)
    known = recipes()
    if args.family not in known:
        raise TrainError(f"unknown family {args.family!r}; 'adaptex train' knows: {', '.join(known)}")
    if args.save_every is not None and args.save_every < 1:
        raise UsageError(f"--save-every {args.save_every}: must be at least 1")
    out = Path(args.output)
    if out.exists() and not checkpoint.is_checkpoint_dir(out):
        raise UsageError(f"{out}: exists and is not a checkpoint directory; choose a new -o "
                         "(adaptex only replaces a directory holding config.json and model.safetensors)")
    parent = out.absolute().parent
    existing = next(p for p in (parent, *parent.parents) if p.exists())  # -o creates the missing directories
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UsageError(f"{out}: {existing} is not a writable directory; choose another -o")
    if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise UsageError("--fsdp shards the model over the processes of a data-parallel run; add --nproc N "
                         "(N >= 2), or run the command under torchrun")
    set_threads(args.threads)
    dp = DataParallel.from_env(shard=args.fsdp)
    try:
        return _train(args, out, parent, dp)
    finally:
        dp.close()


def _train(args, out, parent, dp) -> int:
    import json
    import sys
    import time

    from adaptex.graphs import checkpoint
    from adaptex.graphs.recipes import TrainOptions, train
    from adaptex.graphs.recipes.session import SUMMARY, Session

    opts = TrainOptions(**{f.name: getattr(args, f.name) for f in fields(TrainOptions)})
    quiet = args.quiet or args.json or not dp.main  # progress and notes on rank 0 only
    note = (lambda msg: None) if quiet else say
    options = {**opts.__dict__, **({"fsdp": True} if dp.sharded else {})}  # a sharded run resumes sharded
    session = Session(out=out, save_every=args.save_every, resume=args.resume, quiet=quiet, family=args.family,
                      options=options, save_dtype=args.save_dtype, dp=dp)
    t0 = time.perf_counter()
    result = train(args.family, opts, note, session=session)
    model, extra = result.model, result.extra
    training = extra.get("training") or {}
    data = {k: training[k] for k in ("data", "eval") if k in training} or {"task": training.get("task")}
    if "data_sha256" in training:
        data["sha256"] = training["data_sha256"]
    summary = {"status": "complete", **session.summary_base(), "config": model.cfg.to_dict(), "data": data,
               "metrics": extra.get("evaluation"), "seconds": round(time.perf_counter() - t0, 1),
               "checkpoint": str(out)}
    text = json.dumps(summary, indent=2) + "\n"
    state = dp.gather(model) if dp.sharded else None  # every process takes part; rank 0 holds it
    if not dp.main:  # rank 0 writes the checkpoint and the summary; every rank holds the same weights
        return 0
    parent.mkdir(parents=True, exist_ok=True)  # only now: a failed run leaves nothing behind
    checkpoint.save(out, model, extra, dtype=args.save_dtype, texts={SUMMARY: text}, state=state)
    if args.json:
        sys.stdout.write(text)
    else:
        print(result.table)
    note(f"wrote {out}/ ({checkpoint.CONFIG}, {checkpoint.WEIGHTS}, {SUMMARY})"
         + (f"; {result.note.format(out=out)}" if result.note else ""))
    return 0


def _launch(args) -> int:
    """--nproc N: this command again under torch.distributed.run (torchrun), N processes on this machine."""
    import subprocess
    import sys

    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: give at least 1 process")
    rest, argv = [], list(args.argv)
    while argv:
        a = argv.pop(0)
        if a == "--nproc":
            argv.pop(0)
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "adaptex", *rest]
    return subprocess.call(cmd)
