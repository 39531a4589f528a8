"""The quantization tables in docs/quantization.md, regenerated: each shipped model exported to ONNX
(or Core ML) unquantized and with each `--quantize` scheme, its size against the unquantized artifact
and its `adaptex check` against the eager fp32 model (decision agreement, flip rate, the largest output error as a fraction of the
output's largest value). Size and agreement do not depend on the machine's load.

    python lab/quantization_table.py                          # every shipped model, int8 and int4
    python lab/quantization_table.py --models budgetformer-graded --samples 16   # a smoke run
    python lab/quantization_table.py --target coreml   # int8, palettize6 and palettize4 packages

Writes docs/results/quantization.md (quantization-coreml.md for Core ML): the table, with its date,
CPU and command. Core ML packages are checked by the MIL evaluator (Core ML cannot run on Linux).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("budgetformer-graded", "tsa-charlm", "elastic-minilm", "elastic-charlm")
SCHEMES = {"onnx": ("int8", "int4"), "coreml": ("int8", "palettize6", "palettize4")}
SUFFIX = {"onnx": ".onnx", "coreml": ".mlpackage"}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else os.path.getsize(path)


def row(name: str, scheme: str, work: Path, samples: int, target: str = "onnx") -> dict:
    """One model and scheme: sizes and the check's figures. The full-precision twin is the target's
    default precision (Core ML: fp16 for the elastic encoders)."""
    import adaptex

    model = adaptex.load(name)
    full = work / f"{name}{SUFFIX[target]}"
    if not full.exists():
        adaptex.export(model, None, full, target)
    path = work / f"{name}.{scheme}{SUFFIX[target]}"
    meta = adaptex.export(model, None, path, target, quantize=scheme, validate=False)
    report = adaptex.check(path, model, samples=samples)
    worst = max((o.needed_atol for o in report.outputs.values()), default=0.0)
    return {"model": name, "scheme": scheme, "size_mb": _size(path) / 1e6,
            "size_ratio": _size(path) / _size(full), "agreement": report.decision_agreement,
            "flip_rate": report.flip_rate, "error_frac": worst, "passed": report.passed,
            "routers_fp32": len(meta["quantize"]["fp32_routers"])}


def table(rows: list[dict], command: str) -> str:
    from adaptex.runtimes.cpu import describe

    cpu = describe()
    lines = [f"Generated {datetime.date.today().isoformat()} on {cpu} by `{command}`.", "",
             "| model | scheme | size (MB) | of unquantized | decision agreement | flip rate | largest error (of max) | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['scheme']} | {r['size_mb']:.2f} | {r['size_ratio']:.3f} | "
                     f"{r['agreement']:.4f} | {r['flip_rate']:.4f} | {r['error_frac']:.3f} | "
                     f"{'passed' if r['passed'] else 'FAILED'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--target", default="onnx", choices=tuple(SCHEMES))
    ap.add_argument("--schemes", default=None, help="default: the target's (onnx: int8,int4; coreml: "
                                                    "int8,palettize6,palettize4)")
    ap.add_argument("--samples", type=int, default=200, help="parity sequences per check")
    ap.add_argument("--out", default=None, help="default docs/results/quantization.md (onnx), "
                                                "quantization-coreml.md (coreml)")
    args = ap.parse_args(argv)
    schemes = args.schemes.split(",") if args.schemes else SCHEMES[args.target]
    out = args.out or ROOT / "docs" / "results" / ("quantization.md" if args.target == "onnx" else
                                                   "quantization-coreml.md")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            for scheme in schemes:
                r = row(name, scheme, Path(d), args.samples, args.target)
                print(r, flush=True)
                rows.append(r)
    text = table(rows, "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv or sys.argv[1:])))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
