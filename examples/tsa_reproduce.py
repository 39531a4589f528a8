"""Reproduce the TSA paper's table on our own runs: token-layer ops saved at (near) full quality.

    python examples/tsa_reproduce.py                      # copy, sort, charlm (about 1 h on 2 cores)
    python examples/tsa_reproduce.py --tasks copy sort    # the generated tasks only (~15 min)

Each task trains a TSA decoder and the dense decoder of the same size with the presets in
graphs/train_tsa.py (PRESETS), evaluates both on held-out data in hard (deployed) mode, and prints
our figures next to the paper's. The figures kept in README.md come from this script.
"""
from __future__ import annotations

import argparse
import sys
import time

from graphs.lm_tasks import LM_TASKS, get_lm_task
from graphs.train_tsa import PAPER, PRESETS, TSATrainConfig, evaluate_tsa, train_tsa
from graphs.tsa import TSAConfig


def run(task_name: str, steps: int | None, baseline: bool, save: str | None) -> dict:
    p = dict(PRESETS[task_name])
    task = get_lm_task(task_name)
    cfg = TSAConfig(vocab_size=task.vocab_size, d_model=p["d_model"], num_heads=p["num_heads"],
                    num_layers=p["num_layers"], d_ff=p["d_ff"], max_len=p["max_len"],
                    positions=p["positions"])
    tc = TSATrainConfig(steps=steps or p["steps"], batch_size=p["batch_size"], lr=p["lr"],
                        lambda_depth=p["lambda_depth"], lambda_delay=p["lambda_delay"])
    n = 400 if task_name == "charlm" else 2000
    t0 = time.perf_counter()
    model = train_tsa(cfg, task, tc, desc=f"{task_name:<6} tsa ")
    row = {"task": task_name, "tsa": evaluate_tsa(model, task, n, mode="hard"), "steps": tc.steps,
           "lambda": tc.lambda_depth}
    if baseline:
        base = train_tsa(TSAConfig.from_dict({**cfg.to_dict(), "adaptive": False}), task, tc, desc=f"{task_name:<6} base")
        row["dense"] = evaluate_tsa(base, task, n, mode="hard")
    row["seconds"] = time.perf_counter() - t0
    if save:
        from pathlib import Path

        from graphs import checkpoint

        Path(save).mkdir(parents=True, exist_ok=True)
        checkpoint.save(f"{save}/tsa-{task_name}", model, {
            "description": f"TSA decoder trained on {task_name} by examples/tsa_reproduce.py",
            "training": {"task": task_name, "train_config": tc.__dict__},
            "evaluation": {"tsa_hard": row["tsa"], "baseline": row.get("dense")},
            "tokenizer": task.tokenizer()})
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'task':<7} {'ops saved':>9} {'quality (TSA, hard)':>28} {'dense decoder':>22} "
            f"{'steps':>6}  paper")
    out = [head, "-" * len(head)]
    for r in rows:
        t, d = r["tsa"], r.get("dense")
        if r["task"] == "charlm":
            q = f"val loss {t['loss']:.4f}"
            dq = f"val loss {d['loss']:.4f}" if d else "-"
            if d:
                q += f" ({100 * (t['loss'] / d['loss'] - 1):+.2f}%)"
        else:
            q = f"token acc {100 * t['token_accuracy']:.2f}%"
            dq = f"token acc {100 * d['token_accuracy']:.2f}%" if d else "-"
        out.append(f"{r['task']:<7} {100 * t['ops_saved']:8.1f}% {q:>28} {dq:>22} {r['steps']:>6}  {PAPER[r['task']]}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=list(LM_TASKS), choices=LM_TASKS)
    ap.add_argument("--steps", type=int, default=None, help="override every task's preset step count")
    ap.add_argument("--no-baseline", action="store_true", help="skip the dense decoders")
    ap.add_argument("--save", default=None, help="directory to write the trained TSA checkpoints to")
    args = ap.parse_args(argv)
    rows = []
    for t in args.tasks:
        rows.append(run(t, args.steps, not args.no_baseline, args.save))
        print(table(rows[-1:]).splitlines()[-1], flush=True)  # each task's row as soon as it is done
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
