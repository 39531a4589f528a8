"""`adaptex inspect`: an artifact's metadata."""
from __future__ import annotations

import json


def add_parser(sub) -> None:
    s = sub.add_parser("inspect", help="print an artifact's metadata")
    s.add_argument("artifact")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=run)


def run(args) -> int:
    from adaptex.exporter.metadata import format_metadata
    from adaptex.runtimes.open import read_metadata

    meta = read_metadata(args.artifact)
    print(json.dumps(meta, indent=2) if args.json else f"{args.artifact}\n{format_metadata(meta)}")
    return 0
