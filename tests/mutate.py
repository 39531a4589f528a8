"""Mutation testing by planted mutations: `make mutate` (not part of `make test`).

Each mutant is one edit a plausible bug would make in a lowering body, the parity checker, the bench
accounting or the MIL evaluator. The script applies it to the working tree, runs the tests that
should catch it (stopping at the first failure), restores the file, and reports which mutants
survived. A surviving mutant is a bug the test suite would ship.

    python tests/mutate.py                  # every mutant
    python tests/mutate.py --only k_ceil    # one, by name
    python tests/mutate.py --list

Files are restored in a `finally`, on Ctrl-C and on SIGTERM; a run that was killed outright leaves
`FILE.mutate-orig` beside the mutated file, which the next run puts back before it starts.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKUP = ".mutate-orig"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    what: str
    tests: tuple[str, ...]


FN = "exporter/targets/onnx/bodies/"
MUTANTS = [
    Mutant("topk_smallest", FN + "budgeted.py",
           'topv, order = b("TopK", p, K, axis=-1, largest=1, sorted=1, outputs=2)',
           'topv, order = b("TopK", p, K, axis=-1, largest=0, sorted=1, outputs=2)',
           "BudgetedAttention (ONNX) attends with the lowest-scored heads",
           ("tests/integration/test_planted_bugs.py", "tests/integration/test_parity.py")),
    Mutant("k_ceil", FN + "budgeted.py",
           'kf = b("Clip", b("Floor", sH), b.const(1.0, np.float32), Hf)',
           'kf = b("Clip", b("Ceil", sH), b.const(1.0, np.float32), Hf)',
           "BudgetedAttention (ONNX): k = ceil(s*H) instead of floor",
           ("tests/integration/test_parity.py", "tests/integration/test_planted_bugs.py")),
    Mutant("grouped_heads_not_summed", FN + "budgeted.py",
           'y = b("ScatterND", y, b("Unsqueeze", rows, b.const([1])), u, reduction="add")',
           'y = b("ScatterND", y, b("Unsqueeze", rows, b.const([1])), u, reduction="max")',
           "BudgetedAttention (ONNX, a mixed-k batch grouped by head): head updates not summed",
           ("tests/integration/test_parity.py", "tests/integration/test_planted_bugs.py")),
    Mutant("active_heads_unweighted", FN + "budgeted.py",
           'o = b("Transpose", b("Mul", b("MatMul", attn, v), w), perm=[1, 2, 0, 3])  # (B, T, A, dh)',
           'o = b("Transpose", b("MatMul", attn, v), perm=[1, 2, 0, 3])  # (B, T, A, dh)',
           "BudgetedAttention (ONNX, every sample on the active heads): pairs no sample selected not zeroed",
           ("tests/integration/test_parity.py", "tests/integration/test_planted_bugs.py")),
    Mutant("ffn_skipped_rows", FN + "conditional_ffn.py",
           'idx = b("NonZero", kflat)  # (1, K) int64: kept token rows',
           'idx = b("NonZero", b("Not", kflat))  # (1, K) int64: kept token rows',
           "ConditionalFFN (ONNX sparse) updates the skipped tokens instead of the kept ones",
           ("tests/models/test_tsa.py", "tests/integration/test_planted_bugs.py")),
    Mutant("partition_swapped", FN + "conditional_attention.py",
           'slot = b("Where", keep, slot_kept, slot_skip)',
           'slot = b("Where", keep, slot_skip, slot_kept)',
           "ConditionalAttention (TensorRT-bound): the CumSum partition puts skipped tokens first",
           ("tests/integration/test_planted_bugs.py", "tests/models/test_tsa.py")),
    Mutant("elastic_modes_swapped", FN + "elastic.py",
           'for pick, fn in ((b("Not", modes), fa_pairs), (modes, block_local)):',
           'for pick, fn in ((b("Not", modes), fa_pairs), (modes, fa_pairs)):',
           "ElasticAttention (ONNX sparse): SA pairs also attend fully",
           ("tests/models/test_elastic.py", "tests/targets/test_skipped_work.py")),
    Mutant("encoder_band_widened", FN + "elastic.py",
           'lambda: b("LessOrEqual", b("Abs", d), half))',
           'lambda: b("LessOrEqual", b("Abs", d), b("Add", half, c1)))',
           "ElasticAttention (ONNX, an encoder's SA pairs block-local): a query sees one key more each side",
           ("tests/models/test_elastic.py",)),
    Mutant("coreml_argsort_ascending", "exporter/targets/coreml/mil_ops.py",
           'order = mb.argsort(x=p, axis=-1, ascending=False, name=r + "order")',
           'order = mb.argsort(x=p, axis=-1, ascending=True, name=r + "order")',
           "BudgetedAttention (Core ML) ranks the heads lowest first",
           ("tests/targets/test_coreml.py",)),
    Mutant("margin_excuses_all", "runtimes/parity.py",
           "ok = margin < limit",
           "ok = margin < limit * 1e9",
           "parity: every decision flip is excused",
           ("tests/unit/test_margins.py", "tests/integration/test_planted_bugs.py")),
    Mutant("atol_loosened", "runtimes/parity.py",
           'if need > tol["atol"]:',
           'if need > 10 * tol["atol"]:',
           "parity: the value tolerance silently loosened tenfold",
           ("tests/integration/test_planted_bugs.py", "tests/integration/test_parity.py")),
    Mutant("caller_batches_uncut", "runtimes/parity.py",
           "    if rows <= per:\n        return [item]",
           "    if True:\n        return [item]",
           "parity: a caller's long batch checked whole, past the score budget (a check's memory unbounded)",
           ("tests/integration/test_parity.py",)),
    Mutant("cut_drops_rows", "runtimes/parity.py",
           "a[i:i + per] if n in split else a",
           "a[i:i + per - 1] if n in split else a",
           "parity: cutting a caller's batch loses a row of each piece (those rows never compared)",
           ("tests/integration/test_parity.py",)),
    Mutant("realisation_inverted", "runtimes/bench_accounting.py",
           "realisations = [(1 - r) / (1 - flop_ratio) for r in ratios]",
           "realisations = [(1 - flop_ratio) / (1 - r) for r in ratios]",
           "bench: the realisation formula inverted",
           ("tests/unit/test_bench_accounting.py", "tests/integration/test_bench.py")),
    Mutant("tsa_executed_is_dense", "graphs/tsa.py",
           "executed = flops_per_token(cfg, ctx, rates, shares)",
           "executed = flops_per_token(cfg, ctx, [1.0] * len(rates))",
           "bench: TSA's sparse graph accounted as executing every token",
           ("tests/unit/test_bench_accounting.py",)),
    Mutant("excess_per_sample", "exporter/targets/onnx/__init__.py",
           "few = guards.AnyOf((few, guards.excess_at_most(keys_input, **excess, batch=batch)))",
           "few = guards.AnyOf((few, guards.excess_at_most(keys_input, **excess, batch=False)))",
           "a decoder's batched prefill counts a sample's excess scores, not the batch's (the masked program "
           "taken where it costs more)",
           ("tests/targets/test_decode_graph.py",)),
    Mutant("guard_answers_apart_from_the_graph", "exporter/targets/onnx/guards.py",
           "return max(0, n - self.minus) if self.minus else n",
           "return n",
           "a guard answers in Python apart from the If it builds (the excess's keys past a row read as every "
           "key): the runner and bench name and run another program than the file's If takes",
           ("tests/targets/test_decode_graph.py", "tests/targets/test_programs.py")),
    Mutant("k_margin_loosened", "graphs/ops/budgeted_attention.py",
           'margins={"budget": Margin(1e-4, 1e-2,',
           'margins={"budget": Margin(1e-2, 1e-2,',
           "parity: the fp32 budget (k) margin loosened from 1e-4 to 1e-2 (docs/parity.md publishes 1e-4)",
           ("tests/unit/test_margins.py",)),
    Mutant("budget_margin_floor", "graphs/nn/budgeted.py",
           'margins={"k": (sH - sH.round()).abs()}',
           'margins={"k": (sH - sH.floor()).abs()}',
           "the budget margin measured to floor(s*H), not to the nearest integer: a flip just below one "
           "reads as far from its boundary",
           ("tests/unit/test_margins.py",)),
    Mutant("hf_layernorm_bias_dropped", "graphs/hf/common.py",
           "        mapped[name] = src.float()\n",
           "        if not (\"ln_\" in name and name.endswith(\".bias\")):\n            mapped[name] = src.float()\n",
           "the Hugging Face decoder loader never copies the LayerNorm biases (they keep their initial zeros)",
           ("tests/models/test_hf.py",)),
    Mutant("lm_targets_unshifted", "graphs/data/corpus.py",
           "inp, tgt = ids[:, :-1], ids[:, 1:]",
           "inp, tgt = ids[:, :-1], ids[:, :-1]",
           "a text file's language-model targets are the inputs, not the next tokens (a model learns the identity)",
           ("tests/unit/test_data_feeds.py",)),
    Mutant("head_mode_gap_signed", "graphs/nn/elastic.py",
           "gap = (logits[..., 1] - logits[..., 0]).abs().double()",
           "gap = (logits[..., 1] - logits[..., 0]).double()",
           "the head-mode margin signed: every flip of an FA head (SA - FA logit below zero) is excused",
           ("tests/unit/test_margins.py",)),
    Mutant("encoder_norm_bias_zeroed", "graphs/minilm.py",
           "            mapped[name] = src.float()\n",
           "            mapped[name] = src.float() if not name.endswith(\"norm.bias\") else torch.zeros_like(param)\n",
           "the BERT, RoBERTa and DistilBERT loader leaves every LayerNorm bias at zero",
           ("tests/models/test_hf.py",)),
    Mutant("copy_loss_on_prompt", "graphs/lm_tasks.py",
           "loss_mask[:, self.length:] = True",
           "loss_mask[:, :self.length] = True",
           "copy and sort train on the prompt half (random symbols), never on the answer",
           ("tests/unit/test_data_feeds.py",)),
    Mutant("text_mask_shifted", "graphs/data/corpus.py",
           "torch.from_numpy(real[:, :-1].astype(np.int64))",
           "torch.from_numpy(real[:, 1:].astype(np.int64))",
           "a text file's attention mask one position off its padding (a left-padded row attends to one pad)",
           ("tests/unit/test_data_feeds.py",)),
    Mutant("jsonl_labels_reversed", "graphs/data/classification.py",
           "self.label_index = {lab: i for i, lab in enumerate(self.labels)}",
           "self.label_index = {lab: i for i, lab in enumerate(reversed(self.labels))}",
           "a JSONL file's labels numbered in the reverse of the order the checkpoint records (rows get "
           "another row's class)",
           ("tests/unit/test_data_feeds.py",)),
    Mutant("eval_drops_partial_batch", "graphs/recipes/budgetformer.py",
           "    for start in range(0, n, 256):\n",
           "    for start in range(0, n - n % 256 or n, 256):\n",
           "BudgetFormer's evaluation drops its last partial batch (260 requested, 256 evaluated)",
           ("tests/unit/test_data_feeds.py",)),
    Mutant("mil_gather_nd_transposed", "runtimes/coreml_mil.py",
           "return x[tuple(np.moveaxis(indices.astype(np.int64), -1, 0))]",
           "return x[tuple(np.moveaxis(indices.astype(np.int64)[..., ::-1], -1, 0))]",
           "MIL evaluator: gather_nd reads the index tuple backwards",
           ("tests/unit/test_mil_eval.py",)),
]


def _restore_leftovers() -> None:
    for p in ROOT.rglob(f"*{BACKUP}"):
        if ".venv" in p.parts:
            continue
        os.replace(p, p.with_name(p.name[: -len(BACKUP)]))
        print(f"restored {p.relative_to(ROOT)} from an interrupted run", file=sys.stderr)


def _terminate(signum, frame):
    raise KeyboardInterrupt


def run_mutant(m: Mutant, timeout: int) -> dict:
    path = ROOT / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        return {"name": m.name, "status": "stale", "what": m.what,
                "detail": f"{m.path}: the text to mutate occurs {text.count(m.old)} times (want once)"}
    backup = path.with_name(path.name + BACKUP)
    os.replace(path, backup)
    t0 = time.time()
    try:
        path.write_text(text.replace(m.old, m.new))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            lines = proc.stdout.strip().splitlines() or [""]
            failed = [x for x in lines if x.startswith(("FAILED ", "ERROR "))]
            rc, tail = proc.returncode, "; ".join(failed[:1] + lines[-1:])
        except subprocess.TimeoutExpired:
            rc, tail = None, f"no verdict within {timeout} s"
    finally:
        os.replace(backup, path)
    status = "killed" if rc not in (0, None, 5) else "survived" if rc == 0 else "timeout" if rc is None else "no tests"
    return {"name": m.name, "status": status, "what": m.what, "tests": list(m.tests), "detail": tail,
            "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="mutant names (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:<28} {m.what}")
        return 0
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        print(f"mutate.py: unknown mutant(s) {sorted(unknown)}; see --list", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    _restore_leftovers()
    results = []
    for i, m in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {m.name}: {m.what} ...", file=sys.stderr, flush=True)
        r = run_mutant(m, args.timeout)
        print(f"    {r['status']} ({r.get('seconds', 0)} s): {r['detail']}", file=sys.stderr, flush=True)
        results.append(r)
    killed = sum(r["status"] == "killed" for r in results)
    print(f"\nmutation score: {killed}/{len(results)} killed")
    for r in results:
        if r["status"] != "killed":
            print(f"  {r['status']}: {r['name']}: {r['what']} ({r['detail']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"killed": killed, "total": len(results), "mutants": results}, indent=1))
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
