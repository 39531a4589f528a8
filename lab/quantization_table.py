"""The quantization table in docs/quantization.md, regenerated: each shipped model exported to ONNX in
fp32 and with each `--quantize` scheme, its size against fp32 and its `adaptex check` against the
eager fp32 model (decision agreement, flip rate, the largest output error as a fraction of the
output's largest value). Size and agreement do not depend on the machine's load.

    python lab/quantization_table.py                          # every shipped model, int8 and int4
    python lab/quantization_table.py --models budgetformer-graded --samples 16   # a smoke run

Writes docs/results/quantization.md (the table, with its date, CPU and command).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("budgetformer-graded", "tsa-charlm", "elastic-minilm", "elastic-charlm")
SCHEMES = ("int8", "int4")


def row(name: str, scheme: str, work: Path, samples: int) -> dict:
    """One model and scheme: sizes and the check's figures."""
    import adaptex

    model = adaptex.load(name)
    fp32 = work / f"{name}.onnx"
    if not fp32.exists():
        adaptex.export(model, None, fp32)
    path = work / f"{name}.{scheme}.onnx"
    meta = adaptex.export(model, None, path, quantize=scheme)
    report = adaptex.check(path, model, samples=samples)
    worst = max((o.needed_atol for o in report.outputs.values()), default=0.0)
    return {"model": name, "scheme": scheme, "size_mb": os.path.getsize(path) / 1e6,
            "size_ratio": os.path.getsize(path) / os.path.getsize(fp32), "agreement": report.decision_agreement,
            "flip_rate": report.flip_rate, "error_frac": worst, "passed": report.passed,
            "routers_fp32": len(meta["quantize"]["fp32_routers"])}


def table(rows: list[dict], command: str) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [f"Generated {datetime.date.today().isoformat()} on {cpu} by `{command}`.", "",
             "| model | scheme | size (MB) | of fp32 | decision agreement | flip rate | largest error (of max) | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['scheme']} | {r['size_mb']:.2f} | {r['size_ratio']:.3f} | "
                     f"{r['agreement']:.4f} | {r['flip_rate']:.4f} | {r['error_frac']:.3f} | "
                     f"{'passed' if r['passed'] else 'FAILED'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--samples", type=int, default=200, help="parity sequences per check")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "quantization.md"))
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.models.split(","):
            for scheme in args.schemes.split(","):
                r = row(name, scheme, Path(d), args.samples)
                print(r, flush=True)
                rows.append(r)
    text = table(rows, "python " + " ".join([Path(sys.argv[0]).as_posix()] + (argv or sys.argv[1:])))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
