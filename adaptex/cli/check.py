"""`adaptex check`: parity of an artifact against the eager model, decisions first."""
from __future__ import annotations

import json

from adaptex.cli._util import EXIT_FAILED, at_least, set_threads


def add_parser(sub) -> None:
    s = sub.add_parser("check", help="parity of an artifact against the eager reference on many inputs")
    s.add_argument("artifact")
    s.add_argument("--model", default=None, help="source checkpoint (default: the one recorded in the artifact)")
    s.add_argument("--samples", type=int, default=200, help="number of sequences to compare")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--compute-units", default=None, choices=["cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"],
                   help="Core ML packages on macOS: which units Core ML may use (default all)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=run)


def run(args) -> int:
    from adaptex.runtimes.open import open_artifact
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.source import load_source_model
    from adaptex.runtimes.torch_ref import TorchRunner

    at_least(args, samples=1, threads=0)
    set_threads(args.threads)
    runner = open_artifact(args.artifact, args.threads, args.compute_units)
    meta = runner.meta
    model, info = load_source_model(meta, args.model)
    report = check(runner, TorchRunner(model), samples=args.samples, precision=meta.get("precision", "fp32"),
                   task=(info.get("training") or {}).get("task"), seed=args.seed, artifact_name=str(args.artifact))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.passed else EXIT_FAILED
