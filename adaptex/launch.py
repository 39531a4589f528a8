"""The `adaptex` command's entry point: a signal during start-up exits quietly.

Importing the command line takes seconds (torch, ONNX, coremltools). A Ctrl-C or SIGTERM in that
time, before the command line's own handlers are in place, would print an import traceback; here it
exits at once with 128 + the signal's number (130, 143), having made nothing yet.
"""
from __future__ import annotations

import signal
import sys


def _quiet_exit(signum, frame):
    raise SystemExit(128 + signum)


def run() -> None:
    signal.signal(signal.SIGINT, _quiet_exit)
    signal.signal(signal.SIGTERM, _quiet_exit)
    from adaptex.cli import main

    # from here Ctrl-C raises KeyboardInterrupt, which the command line turns into "interrupted" (130);
    # its main() installs its SIGTERM handling first thing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
