"""`adaptex check`: parity of an artifact against the eager model, decisions first."""
from __future__ import annotations

import json

from adaptex.cli._util import (EXIT_FAILED, add_memory_flag, at_least, count, load_model, progress_bar, read_inputs,
                               set_threads)


def add_parser(sub) -> None:
    s = sub.add_parser("check", help="parity of an artifact against the eager reference on many inputs")
    s.add_argument("artifact")
    s.add_argument("--model", default=None,
                   help="the source: a checkpoint or shipped name, or MODULE:FUNCTION for a model of your own "
                        "(default: the checkpoint the artifact records)")
    s.add_argument("--inputs", default=None, help="an .npz of inputs by name (first axis: the batch) instead of the "
                                                  "model's generated ones")
    s.add_argument("--samples", type=count, default=200, help="number of sequences to compare (generated inputs)")
    s.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: by precision, printed)")
    s.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: by precision, printed)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=None)
    s.add_argument("--compute-units", default=None, choices=["cpu_only", "cpu_and_gpu", "cpu_and_ne", "all"],
                   help="Core ML packages on macOS: which units Core ML may use (default all)")
    s.add_argument("--fp16-accumulation", default=None, choices=["fp32", "fp16"],
                   help="Core ML packages: evaluate fp16 ops accumulating in fp32 (Core ML's CPU and GPU; the "
                        "default) or in fp16 throughout (the worst case, as the Neural Engine may)")
    s.add_argument("--ranges", action="store_true",
                   help="Core ML packages: report every fp16 op's largest |x| and partial sums against 65504")
    s.add_argument("--one-session", action="store_true",
                   help="ONNX artifacts: run the file in one ONNX Runtime session, its top-level Ifs choosing the "
                        "graph, as an app that loads it itself does (default: a session per graph, as adaptex runs it)")
    s.add_argument("--runtime", default=None, choices=["onnxruntime", "openvino"],
                   help="the runtime that runs an .onnx artifact (default onnxruntime); openvino inlines its "
                        "functions on load. An OpenVINO .xml runs in OpenVINO")
    s.add_argument("--against", default=None, metavar="ARTIFACT",
                   help="compare with another artifact of the same checkpoint (e.g. the .mlpackage of an .onnx) "
                        "instead of the eager model, decisions first")
    s.add_argument("--save-results", default=None, metavar="JSON", help="write the full report as JSON")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--json", action="store_true")
    add_memory_flag(s)
    s.set_defaults(run=run)


def run(args) -> int:
    from adaptex.api import _feeds, check
    from adaptex.runtimes.open import open_artifact, read_metadata
    from adaptex.runtimes.parity import bound_samples

    at_least(args, samples=1, threads=0, atol=0, rtol=0, seed=0)
    if args.inputs is None:  # before any work: the metadata names the outputs and decisions
        meta = read_metadata(args.artifact)
        bound_samples(args.samples, len(meta.get("outputs") or []) + len(meta.get("decisions") or []) + 1)
    set_threads(args.threads)
    options = dict(compute_units=args.compute_units, accumulate=args.fp16_accumulation, ranges=args.ranges,
                   one_session=args.one_session, runtime=args.runtime)
    runner = open_artifact(args.artifact, args.threads, **options)  # refuses a flag it would ignore
    model = load_model(args.model)[0] if args.model else None
    inputs = read_inputs(args.inputs, list(runner.meta["inputs"]), specs=runner.meta["inputs"])
    with progress_bar("check", total=None if inputs else args.samples, unit="seq",
                      enabled=not (args.json or args.quiet)) as bar:
        report = check(args.artifact, model, _feeds(inputs, list(runner.meta["inputs"])) if inputs else None,
                       samples=args.samples, seed=args.seed, atol=args.atol, rtol=args.rtol, threads=args.threads,
                       compute_units=args.compute_units, fp16_accumulation=args.fp16_accumulation,
                       ranges=args.ranges, against=args.against, one_session=args.one_session, runtime=args.runtime,
                       progress=bar.to(lambda r: r.samples))
    if args.save_results:
        from pathlib import Path

        from adaptex.exporter.metadata import atomic_path

        with atomic_path(Path(args.save_results)) as tmp:
            Path(tmp).write_text(json.dumps(report.to_dict(), indent=2))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    if args.save_results and not args.json:
        print(f"wrote {args.save_results}")
    return 0 if report.passed else EXIT_FAILED
