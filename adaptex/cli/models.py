"""`adaptex models`: the shipped models."""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    s = sub.add_parser("models", help="list the shipped models")
    s.add_argument("--json", action="store_true", help="one JSON object per model")
    s.set_defaults(run=run)


def run(args) -> int:
    from adaptex.graphs import checkpoint

    rows = checkpoint.describe_shipped()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no shipped models")
        return 0
    print(f"{'name':<28} {'family':<16} {'task':<13} {'layers x heads':<15} {'d_model':<8} description")
    for r in rows:
        default = " (default)" if r["default"] else ""
        print(f"{r['name']:<28} {r['family']:<16} {r['task']:<13} {r['num_layers']} x {r['num_heads']:<11} "
              f"{r['d_model']:<8} {r['description']}{default}")
    return 0
