"""`python tests/support/stop_after_save.py ARGS...`: `adaptex ARGS...` that stops right after its first
periodic save, as a Ctrl-C there would; for runs under torchrun, whose processes a test cannot patch."""
import sys

from adaptex.cli import main
from adaptex.graphs.recipes.session import Session

_save = Session.save_state


def _save_then_stop(self, *args, **kwargs):
    _save(self, *args, **kwargs)
    raise KeyboardInterrupt


Session.save_state = _save_then_stop
sys.exit(main(sys.argv[1:]))
