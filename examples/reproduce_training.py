"""Retrain each shipped model's headline over several seeds; report the mean and the spread.

    python examples/reproduce_training.py                        # short schedules, seeds 0 1 2, 1 thread
    python examples/reproduce_training.py --schedule full        # the documented commands (hours: see below)
    python examples/reproduce_training.py --models budgetformer-graded --seeds 0 1 2 3 4

Each model is retrained with `adaptex train` (in this process: one start-up), `--seed S --threads T`,
into OUT/MODEL/seedS/, and its headline figures are read back from the summary.json beside each
checkpoint. The table gives every seed's value, the mean ± the sample standard deviation, and the
range; --json FILE writes the same as JSON (docs/results/training_seeds.json is this script's output
for the short schedules, and `make test-slow` checks a fresh run against it;
docs/results/training_seeds_full.json merges its runs of the full schedules, one per model:
elastic-charlm, charlm-dense, elastic-minilm, budgetformer-graded and tsa-charlm).

`full` is the command each shipped model came from (one seed, on 2 cores: budgetformer-graded about 20
minutes for the model and its baseline, tsa-charlm about 100 minutes, charlm-dense 13, elastic-charlm 7,
elastic-minilm 22). `short` cuts every schedule (steps, and evaluation sizes where they dominate) so
that three seeds of every model fit in well under an hour of one core: its figures describe the short
schedules, not the shipped models. The exception is tsa-warm, the warm start from charlm-dense: its
documented command is already short (300 steps, 5-9 minutes a seed here), and both schedules run it
as documented.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# model -> (headline figures: name -> path into summary.json's metrics, full command, short command's extra flags)
MODELS = {
    "budgetformer-graded": {
        "full": ["budgetformer", "--task", "graded"],
        "short": ["budgetformer", "--task", "graded", "--steps", "300", "--eval-size", "1000"],
        "figures": {"accuracy (hard)": ("budgetformer", "accuracy"),
                    "heads used": ("budgetformer", "heads_fraction"),
                    "baseline accuracy": ("baseline", "accuracy")},
    },
    "tsa-charlm": {
        "full": ["tsa", "--task", "charlm"],
        "short": ["tsa", "--task", "charlm", "--steps", "100", "--eval-size", "200"],
        "figures": {"ops saved": ("tsa_hard", "ops_saved"),
                    "loss (hard)": ("tsa_hard", "loss"),
                    "dense loss": ("baseline", "loss"),
                    "loss increase": None},
    },
    "tsa-warm": {  # the warm start (docs/training.md): its documented command is already short (300 steps)
        "full": ["tsa", "--init", "charlm-dense"],
        "short": ["tsa", "--init", "charlm-dense"],
        "figures": {"ops saved": ("tsa_hard", "ops_saved"),
                    "loss (hard)": ("tsa_hard", "loss"),
                    "dense loss": ("init", "loss"),
                    "loss increase": None},
    },
    "charlm-dense": {
        "full": ["tsa", "--task", "charlm", "--dense", "--init", "tsa-charlm", "--steps", "700", "--lr", "1e-3"],
        "short": ["tsa", "--task", "charlm", "--dense", "--init", "tsa-charlm", "--steps", "40", "--lr", "1e-3",
                  "--eval-size", "40"],
        "figures": {"held-out loss": ("dense", "loss")},
    },
    "elastic-charlm": {
        "full": ["elastic", "--backbone", "charlm-dense", "--target-sparsity", "0.85", "--steps", "200"],
        "short": ["elastic", "--backbone", "charlm-dense", "--target-sparsity", "0.85", "--steps", "20",
                  "--eval-size", "16"],
        "figures": {"SA heads": ("held_out", "sa_fraction"), "loss increase": ("held_out", "loss_increase")},
    },
    "elastic-minilm": {
        "full": ["elastic", "--backbone", "minilm", "--steps", "300", "--batch-size", "8", "--target-sparsity", "0.55"],
        "short": ["elastic", "--backbone", "minilm", "--steps", "20", "--batch-size", "8", "--target-sparsity", "0.55",
                  "--eval-size", "32", "--max-tokens", "128"],
        "figures": {"SA heads": ("held_out", "sa_fraction"), "mean cosine": ("held_out", "mean_cosine")},
    },
}


def figures(model: str, metrics: dict) -> dict:
    out = {}
    for name, path in MODELS[model]["figures"].items():
        if path is None:  # derived: the TSA decoder's loss over the dense decoder's (the warm start's: its start's)
            dense = metrics["baseline"] or metrics["init"]
            out[name] = metrics["tsa_hard"]["loss"] / dense["loss"] - 1
        else:
            out[name] = float(metrics[path[0]][path[1]])
    return out


def spread(values: list[float]) -> dict:
    return {"values": values, "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--schedule", choices=["short", "full"], default="short")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/reproduce")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON (updated after every run)")
    args = ap.parse_args(argv)
    from adaptex.cli import main as adaptex

    results = {"schedule": args.schedule, "threads": args.threads, "seeds": args.seeds, "models": {}}
    for model in args.models:
        cmd = MODELS[model][args.schedule]
        runs = []
        for seed in args.seeds:
            out = Path(args.out, args.schedule, model, f"seed{seed}")
            argv_ = ["train", *cmd, "--seed", str(seed), "--threads", str(args.threads), "--quiet", "-o", str(out)]
            print(f"adaptex {' '.join(argv_)}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            with open(os.devnull, "w") as null:  # the summary table goes to stdout; we read summary.json
                old, sys.stdout = sys.stdout, null
                try:
                    code = adaptex(argv_)
                finally:
                    sys.stdout = old
            if code != 0:
                print(f"{model} seed {seed}: adaptex train exited {code}", file=sys.stderr)
                return code
            summary = json.loads((out / "summary.json").read_text())
            runs.append({"seed": seed, "seconds": round(time.perf_counter() - t0, 1), **figures(model, summary["metrics"])})
            print(f"  {model} seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in runs[-1].items()
                                                       if k not in ("seed", "seconds")) +
                  f" ({runs[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
            results["models"][model] = {"command": "adaptex train " + " ".join(cmd), "runs": runs,
                                        "figures": {name: spread([r[name] for r in runs])
                                                    for name in MODELS[model]["figures"]}}
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{args.schedule} schedules, seeds {' '.join(map(str, args.seeds))}, {args.threads} thread(s)")
    print(f"{'model':<20} {'figure':<18} {'mean ± std':>18} {'min':>8} {'max':>8}   per seed")
    for model, r in results["models"].items():
        for name, f in r["figures"].items():
            print(f"{model:<20} {name:<18} {f['mean']:>9.4f} ± {f['std']:.4f} {f['min']:>8.4f} {f['max']:>8.4f}   "
                  + " ".join(f"{v:.4f}" for v in f["values"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
