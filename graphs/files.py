"""Temporary files and directories that an interruption cannot leave behind for good.

Every temporary path adaptex makes carries its process id (`.model.onnx.adaptex-1234-x1y2.tmp`
beside an artifact, `adaptex-1234-...` in the system temp directory). SIGTERM and Ctrl-C unwind
through the `finally` blocks that delete them; a SIGKILL cannot, so the next adaptex run sweeps the
paths whose process no longer exists (never a running process's).
"""
from __future__ import annotations

import contextlib
import os
import secrets
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
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
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


def fresh_name(directory: str | os.PathLike, prefix: str, suffix: str = "") -> Path:
    """A path in `directory` that does not exist yet. Callers hold the name *before* they create it
    (os.mkdir, os.open with O_EXCL), so that an interruption right after the creation still finds the
    name in their `finally` (mkdtemp and mkstemp return it only after creating it: a Ctrl-C between
    the two left an empty directory behind)."""
    return Path(directory) / f"{prefix}{secrets.token_hex(4)}{suffix}"


def make_dir(path: Path) -> None:
    os.mkdir(path, 0o700)


def make_file(path: Path) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


@contextlib.contextmanager
def owned(path: Path, create) -> Iterator[Path]:
    """create(path) (make_dir or make_file), yield it, and remove it on exit, however the block ends:
    also when an interruption lands right after the creation. A name somebody else took meanwhile
    (FileExistsError) is left alone."""
    ours = True
    try:
        try:
            create(path)
        except FileExistsError:
            ours = False
            raise
        yield path
    finally:
        if ours:
            _remove(path)


@contextlib.contextmanager
def temp_dir(kind: str, parent: str | os.PathLike | None = None) -> Iterator[Path]:
    """A private directory (in the system temp directory unless `parent`), deleted on exit."""
    if parent is None:
        sweep_temp()
    with owned(fresh_name(parent if parent is not None else tempfile.gettempdir(),
                          f"{TAG}-{os.getpid()}-{kind}-"), make_dir) as path:
        yield path


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


_TERMINATED = []  # set once SIGTERM arrived: a library that catches every exception (torch's tracing
# wraps one raised in the code it traces) may turn Terminated into an error of its own


def terminated() -> bool:
    """Whether this process received SIGTERM (after terminate_cleanly)."""
    return bool(_TERMINATED)


def terminate_cleanly() -> None:
    """Turn SIGTERM into an exception (the CLI installs this; an interrupted write then unwinds)."""
    def handler(signum, frame):
        _TERMINATED.append(signum)
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
    with owned(fresh_name(out.parent, sibling_prefix(out)), make_dir) as work:
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


@contextlib.contextmanager
def exclusive(lock: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` (made if missing) for the block: one process at a
    time builds what the lock guards (two `adaptex bench` runs filling one cache entry). Where the
    platform has no fcntl, the block runs unlocked (what it guards is written atomically anyway)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    Path(lock).parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
