"""Temporary files and directories that an interruption cannot leave behind for good.

Every temporary path adaptex makes carries its process id (`.model.onnx.adaptex-1234-x1y2.tmp`
beside an artifact, `adaptex-1234-...` in the system temp directory). SIGTERM and Ctrl-C unwind
through the `finally` blocks that delete them; a SIGKILL cannot, so the next adaptex run sweeps the
paths whose process no longer exists (never a running process's).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterator

TAG = "adaptex"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _owner(name: str) -> int | None:
    """The process id a temporary name carries (`...adaptex-<pid>-...`), or None."""
    _, sep, rest = name.partition(f"{TAG}-")
    pid = rest.split("-", 1)[0] if sep else ""
    return int(pid) if pid.isdigit() else None


def _remove(p: Path) -> None:
    try:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    except OSError:
        pass


def sweep(directory: str | os.PathLike, pattern: str) -> None:
    """Delete the entries of `directory` matching `pattern` whose owning process is gone."""
    try:
        entries = list(Path(directory).glob(pattern))
    except OSError:
        return
    for p in entries:
        pid = _owner(p.name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            _remove(p)


def sweep_temp() -> None:
    """Sweep adaptex's leftovers in the system temp directory (bench work dirs, conversion dirs)."""
    sweep(tempfile.gettempdir(), f"{TAG}-*")


def sibling_prefix(path: Path) -> str:
    """The prefix of a temporary path beside `path` (hidden, owned by this process)."""
    return f".{path.name}.{TAG}-{os.getpid()}-"


@contextlib.contextmanager
def temp_dir(kind: str, parent: str | os.PathLike | None = None) -> Iterator[Path]:
    """A private directory (in the system temp directory unless `parent`), deleted on exit."""
    if parent is None:
        sweep_temp()
    path = None
    try:
        path = Path(tempfile.mkdtemp(prefix=f"{TAG}-{os.getpid()}-{kind}-", dir=parent))
        yield path
    finally:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def tempdir_for_libraries() -> Iterator[Path]:
    """Point `tempfile` at a private directory for the block: what a library writes to the system
    temp directory (coremltools' intermediate packages) is then deleted with it."""
    with temp_dir("lib") as d:
        old = tempfile.tempdir
        tempfile.tempdir = str(d)
        try:
            yield d
        finally:
            tempfile.tempdir = old


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that `finally` blocks clean up."""


def terminate_cleanly() -> None:
    """Turn SIGTERM into an exception (the CLI installs this; an interrupted write then unwinds)."""
    def handler(signum, frame):
        raise Terminated()
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def recover(out: Path) -> None:
    """Finish what a killed directory swap left: if `out` is gone and a dead process's work directory
    beside it holds the old version, put that back; then delete the work directories."""
    out = Path(out).absolute()
    for work in out.parent.glob(f".{out.name}.{TAG}-*"):
        pid = _owner(work.name)
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        old = work / "old"
        if work.is_dir() and old.exists() and not out.exists():
            try:
                os.replace(old, out)
            except OSError:
                pass
        _remove(work)


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a path to write a directory at (beside `out`); when the block succeeds, the old `out`
    moves aside, the new one takes its place, and only then is the old one deleted. At every instant
    `out` is the old or the new version, or (between two renames) the old one waits in a work
    directory that `recover` puts back."""
    out = Path(out).absolute()
    recover(out)
    work = None
    try:
        work = Path(tempfile.mkdtemp(prefix=sibling_prefix(out), dir=out.parent))
        new = work / out.name
        yield new
        os.chmod(new, 0o755)  # mkdtemp-style privacy is not wanted for an artifact or a checkpoint
        if out.exists():
            os.replace(out, work / "old")  # within one directory: atomic renames
        try:
            os.replace(new, out)
        except BaseException:
            if (work / "old").exists() and not out.exists():
                os.replace(work / "old", out)
            raise
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
