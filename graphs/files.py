"""Temporary files and directories that an interruption cannot leave behind for good, and that never
touch what adaptex did not make.

Beside an artifact, a temporary path carries the writer's host and process id
(`.model.onnx.adaptex-1234-h3a9f01-x1y2z3w4.tmp`); only that exact form is ever swept, and only a dead
process's of this host. In the system temp directory, adaptex works under one directory per process
whose `owner.json` records the host, the process id and its start time: a sweep removes a directory
only when that record is there, names this host, its process is gone, and it is older than a grace
period (ADAPTEX_TEMP_GRACE_S, default 900). A user's `adaptex-2024-results` has no record and is never
touched, nor is another host's work in a shared temp directory. SIGTERM and Ctrl-C unwind through the
`finally` blocks that delete what a process made, with signals held back while it deletes; what a
SIGKILL leaves, a later run sweeps.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

TAG = "adaptex"
OWNER = "owner.json"  # the record inside a process directory in the system temp directory
GRACE_S = 900.0  # a dead process's temp directory younger than this is left alone (clocks, slow mounts)
_SIBLING = re.compile(rf"^\.(?P<name>.+)\.{TAG}-(?P<pid>\d+)-h(?P<host>[0-9a-f]{{6}})-[0-9a-f]{{8}}(\.tmp)?$")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _host() -> str:
    """This machine and pid namespace: process ids mean something only within both (containers that
    share a temp directory have their own)."""
    ns = ""
    with contextlib.suppress(OSError):
        ns = os.readlink("/proc/self/ns/pid")
    return f"{socket.gethostname()}|{_read('/proc/sys/kernel/random/boot_id').strip()}|{ns}"


HOST = _host()
HOST_TAG = hashlib.sha256(HOST.encode()).hexdigest()[:6]


def _start_time(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, Linux), or "" where that cannot be read: a
    recycled process id then does not pass for the process that recorded it."""
    text = _read(f"/proc/{pid}/stat")
    fields = text[text.rfind(")") + 2:].split() if ")" in text else []
    return fields[19] if len(fields) > 19 else ""


def _alive(pid: int, start: str = "") -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    now = _start_time(pid)
    return not (start and now and now != start)  # the id was given to another process since


def _owner(name: str) -> int | None:
    """The process id a temporary name beside an artifact carries, if it is exactly adaptex's form
    and was made on this host; else None."""
    m = _SIBLING.match(name)
    return int(m["pid"]) if m and m["host"] == HOST_TAG else None


class _Held:
    """SIGINT and SIGTERM held back for a block (a cleanup, a swap of two renames): a second signal
    cannot cut it short; a signal that came meanwhile is delivered when the block ends."""

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask"):
            self.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old)


held_signals = _Held


def _remove(p: Path) -> None:
    with held_signals():
        try:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            pass


def sweep(directory: str | os.PathLike, pattern: str) -> None:
    """Delete the entries of `directory` matching `pattern` that are adaptex's temporary paths (exactly
    its form, this host's) whose process is gone."""
    try:
        entries = list(Path(directory).glob(pattern))
    except OSError:
        return
    for p in entries:
        pid = _owner(p.name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            _remove(p)


def grace_s() -> float:
    try:
        return max(0.0, float(os.environ.get("ADAPTEX_TEMP_GRACE_S", GRACE_S)))
    except ValueError:
        return GRACE_S


def _abandoned(d: Path, now: float, grace: float) -> bool:
    """Whether `d` is a process directory adaptex provably made (its record inside, this host, this
    user), whose process is gone, untouched for `grace` seconds."""
    try:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return False
        rec = d / OWNER
        rst = os.lstat(rec)
        if not stat.S_ISREG(rst.st_mode) or rst.st_size > 4096:
            return False
        owner = json.loads(rec.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(owner, dict) or owner.get("tool") != TAG or owner.get("host") != HOST:
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or _alive(pid, str(owner.get("start", ""))):
        return False
    return now - max(st.st_mtime, rst.st_mtime) >= grace


def sweep_temp() -> None:
    """Remove the process directories that dead adaptex processes of this host left in the system temp
    directory (bench work dirs, conversion dirs), once older than the grace period."""
    root, now, grace = Path(tempfile.gettempdir()), time.time(), grace_s()
    try:
        entries = [p for p in root.iterdir() if p.name.startswith(f"{TAG}-")]
    except OSError:
        return
    for d in entries:
        if _abandoned(d, now, grace):
            _remove(d)


class _ProcessDir:
    """This process's directory in the system temp directory: made with its record on first use,
    removed when the last temp_dir in it closes (and at exit)."""

    def __init__(self):
        self.lock, self.path, self.users = threading.RLock(), None, 0

    def enter(self) -> Path:
        with self.lock:
            if self.path is None or not self.path.is_dir():
                sweep_temp()
                path = fresh_name(tempfile.gettempdir(), f"{TAG}-{os.getpid()}-")
                with held_signals():
                    make_dir(path)
                    self.path = path
                record = {"tool": TAG, "host": HOST, "pid": os.getpid(), "start": _start_time(os.getpid()),
                          "made": time.time()}
                tmp = path / f".{OWNER}.tmp"
                tmp.write_text(json.dumps(record))
                os.replace(tmp, path / OWNER)  # whole or absent: a half record is no record
            self.users += 1
            return self.path

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users <= 0:
                self.close()

    def close(self) -> None:
        with self.lock:
            path, self.path, self.users = self.path, None, 0
            if path is not None:
                _remove(path)


_PROCESS_DIR = _ProcessDir()
atexit.register(_PROCESS_DIR.close)


def sibling_prefix(path: Path) -> str:
    """The prefix of a temporary path beside `path` (hidden, owned by this process)."""
    return f".{path.name}.{TAG}-{os.getpid()}-h{HOST_TAG}-"


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
    """A private directory (inside this process's directory in the system temp directory unless
    `parent`), deleted on exit."""
    if parent is not None:
        with owned(fresh_name(parent, f"{TAG}-{os.getpid()}-{kind}-"), make_dir) as path:
            yield path
        return
    base = _PROCESS_DIR.enter()
    try:
        with owned(fresh_name(base, f"{kind}-"), make_dir) as path:
            yield path
    finally:
        _PROCESS_DIR.leave()


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
    """Turn SIGTERM into an exception (the CLI installs this; an interrupted write then unwinds). Only
    the first one raises: a second SIGTERM while the first unwinds must not cut its cleanup short."""
    def handler(signum, frame):
        _TERMINATED.append(signum)
        if len(_TERMINATED) == 1:
            raise Terminated()
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def exit_on_terminate(code: int = 143) -> None:
    """After the work is done (the CLI's last step): a SIGTERM from here to the process's end deletes
    this process's temp directory and exits with `code` at once, instead of raising inside the
    interpreter's shutdown (a traceback, and exit status 0)."""
    def handler(signum, frame):
        _TERMINATED.append(signum)
        _PROCESS_DIR.close()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, handler)


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
        with held_signals():  # the two renames happen both or neither
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
