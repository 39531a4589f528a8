"""The `adaptex` command line: models, train, export, inspect, lint, check, bench, triton, serve.

One module per command, each with `add_parser(subparsers)` and `run(args) -> exit code`; argument
parsing and printing only, the work is done by the rooms below. Every error reaches the user as
one line on stderr ("adaptex: error: ...") with a non-zero exit: 2 for errors, 1 for a check that
fails, 130 for an interrupt.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from adaptex.cli import bench, check, export, inspect, lint, models, serve, train, triton
from adaptex.cli._util import EXIT_ERROR, UsageError, err

COMMANDS = (models, train, export, inspect, lint, check, bench, triton, serve)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line naming the fix, not the whole usage block."""

    def error(self, message: str):
        raise UsageError(f"{message}; see '{self.prog} --help'")


def build_parser() -> argparse.ArgumentParser:
    from adaptex import __version__

    p = _Parser(prog="adaptex", description="Export adaptive Transformers with their savings intact.")
    p.add_argument("--version", action="version", version=f"adaptex {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS:
        cmd.add_parser(sub)
    return p


EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process SIGTERM ended


def _terminated() -> int:
    err("terminated")
    return EXIT_TERMINATED


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    from adaptex.graphs import files
    from adaptex.graphs.errors import AdaptexError

    files.terminate_cleanly()  # SIGTERM unwinds like Ctrl-C: temporary files go, artifacts stay whole
    try:
        args, extra = build_parser().parse_known_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: a command may run itself again
        if extra:  # named with the command's own help, not the top-level one
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}; see 'adaptex {args.command} --help'")
        return args.run(args)
    except AdaptexError as e:  # UsageError included
        if files.terminated():  # SIGTERM that a library turned into an error (torch.onnx.export's)
            return _terminated()
        err(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except files.Terminated:
        return _terminated()
    except BrokenPipeError:  # output piped into `head` and the like: the reader left, not an error
        sys.stderr.close()
        return 0
    except Exception as e:  # a bug or an environment failure: still one line, never a traceback
        if files.terminated():  # SIGTERM that a library caught and raised again as its own error
            return _terminated()
        first = (str(e).strip().splitlines() or [""])[0]
        err(f"unexpected {type(e).__name__}: {first} (set ADAPTEX_DEBUG=1 for the traceback)")
        if os.environ.get("ADAPTEX_DEBUG"):
            raise
        return EXIT_ERROR
