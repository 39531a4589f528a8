"""Reproduce the table of the TSA paper (Mohammed, "Adaptive Computation Depth via Learned Token Routing
in Transformers", arXiv:2605.05222, 2026) on our own runs: token-layer ops saved at (near) full quality.

    python examples/tsa_reproduce.py                      # copy, sort, charlm (about 2.5 h on 2 cores)
    python examples/tsa_reproduce.py --tasks copy sort    # the generated tasks only (~25 min)
    python examples/tsa_reproduce.py --tasks charlm --steps 1000 --no-baseline   # ~15 min

Each task trains a TSA decoder and the dense decoder of the same size with the presets in
graphs/recipes/tsa.py (PRESETS), evaluates both on held-out data in hard (deployed) mode, and prints
our figures next to that paper's. It also trains the comparison it makes, an early-exit decoder of the
same size (graphs/early_exit.py), calibrates its exit threshold to TSA's ops saved, and reports its
quality at that matched compute (--no-early-exit skips it). The figures in docs/models/tsa.md come
from this script.
"""
from __future__ import annotations

import argparse
import sys
import time

from adaptex.graphs.lm_tasks import LM_TASKS, get_lm_task
from adaptex.graphs.recipes.tsa import PAPER, PRESETS, TSATrainConfig, evaluate_tsa, train_tsa
from adaptex.graphs.tsa import TSAConfig


def run(task_name: str, steps: int | None, baseline: bool, save: str | None, early: bool = True) -> dict:
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
    if early:
        from adaptex.graphs.early_exit import calibrate_threshold, evaluate_early_exit, train_early_exit

        ee = train_early_exit(cfg, task, tc, desc=f"{task_name:<6} exit")
        thr = calibrate_threshold(ee, task, row["tsa"]["ops_saved"])
        row["early_exit"] = evaluate_early_exit(ee, task, thr, n)
    row["seconds"] = time.perf_counter() - t0
    if save:
        from pathlib import Path

        from adaptex.graphs import checkpoint

        Path(save).mkdir(parents=True, exist_ok=True)
        checkpoint.save(f"{save}/tsa-{task_name}", model, {
            "description": f"TSA decoder trained on {task_name} by examples/tsa_reproduce.py",
            "training": {"task": task_name, "train_config": tc.__dict__},
            "evaluation": {"tsa_hard": row["tsa"], "baseline": row.get("dense")},
            "tokenizer": task.tokenizer()})
    return row


def _quality(r: dict | None, lm: bool, ref: dict | None = None) -> str:
    if r is None:
        return "-"
    if not lm:
        return f"token acc {100 * r['token_accuracy']:.2f}%"
    q = f"val loss {r['loss']:.4f}"
    return q + (f" ({100 * (r['loss'] / ref['loss'] - 1):+.2f}%)" if ref else "")


def table(rows: list[dict]) -> str:
    head = (f"{'task':<7} {'ops saved':>9} {'quality (TSA, hard)':>28} {'dense decoder':>22} "
            f"{'early exit, same ops saved':>38} {'steps':>6}  paper")
    out = [head, "-" * len(head)]
    for r in rows:
        lm = r["task"] == "charlm"
        t, d, e = r["tsa"], r.get("dense"), r.get("early_exit")
        ee = f"{_quality(e, lm, d)} at {100 * e['ops_saved']:.1f}%" if e else "-"
        out.append(f"{r['task']:<7} {100 * t['ops_saved']:8.1f}% {_quality(t, lm, d):>28} {_quality(d, lm):>22} "
                   f"{ee:>38} {r['steps']:>6}  {PAPER[r['task']]}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", default=list(LM_TASKS), choices=LM_TASKS)
    ap.add_argument("--steps", type=int, default=None, help="override every task's preset step count")
    ap.add_argument("--no-baseline", action="store_true", help="skip the dense decoders")
    ap.add_argument("--no-early-exit", action="store_true", help="skip the early-exit decoders")
    ap.add_argument("--save", default=None, help="directory to write the trained TSA checkpoints to")
    args = ap.parse_args(argv)
    rows = []
    for t in args.tasks:
        rows.append(run(t, args.steps, not args.no_baseline, args.save, not args.no_early_exit))
        print(table(rows[-1:]).splitlines()[-1], flush=True)  # each task's row as soon as it is done
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
