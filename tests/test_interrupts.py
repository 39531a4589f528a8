"""Interrupted writes: an export or a checkpoint killed at any point never loses the previous
artifact, and leaves nothing behind (SIGTERM unwinds at once; what a SIGKILL leaves, the next run
sweeps)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from adaptex.exporter.metadata import read_onnx_metadata
from adaptex.graphs import checkpoint
from adaptex.graphs.errors import CheckpointError
from tests import zoo


def _debris(d, name, tmpdir):
    near = [p.name for p in d.iterdir() if p.name.startswith(f".{name}.")]
    far = [p.name for p in tmpdir.iterdir() if p.name.startswith("adaptex-")]
    return near + far


def _export(ckpt, out, target, variant, tmpdir):
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    return subprocess.Popen([sys.executable, "-m", "adaptex", "export", str(ckpt), "--target", target,
                             "--variant", variant, "-o", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _readable(out, target):
    if target == "onnx":
        return read_onnx_metadata(out)
    from adaptex.exporter.targets.coreml.package import read_package_meta

    return read_package_meta(out)


@pytest.mark.parametrize("target, suffix, kills", [
    ("onnx", ".onnx", [(signal.SIGTERM, 2.5), (signal.SIGTERM, 4.0), (signal.SIGKILL, 3.0), (signal.SIGKILL, 4.5)]),
    ("coreml", ".mlpackage", [(signal.SIGTERM, 5.0), (signal.SIGKILL, 6.5)]),
])
def test_a_killed_export_keeps_the_old_artifact_and_leaves_nothing(tiny_checkpoint, tmp_path, target, suffix, kills):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / f"m{suffix}"
    assert _export(tiny_checkpoint, out, target, "dense", tmpdir).wait(timeout=300) == 0
    for sig, delay in kills:
        p = _export(tiny_checkpoint, out, target, "sparse", tmpdir)
        time.sleep(delay)
        p.send_signal(sig)
        code = p.wait(timeout=120)
        meta = _readable(out, target)  # the old artifact, or a complete new one: never neither
        assert meta["variant"] in ("dense", "sparse")
        if code == 0:
            continue  # it finished before the signal
        if sig == signal.SIGTERM:  # -15: it came before adaptex started (and so before any write)
            assert code == -15 or (code == 143 and "terminated" in p.stderr.read().decode()), code
            assert _debris(tmp_path, out.name, tmpdir) == []
    # whatever a SIGKILL left, the next export sweeps
    assert _export(tiny_checkpoint, out, target, "dense", tmpdir).wait(timeout=300) == 0
    assert _debris(tmp_path, out.name, tmpdir) == []
    assert _readable(out, target)["variant"] == "dense"


def test_a_failed_checkpoint_write_keeps_the_old_one(tmp_path, monkeypatch):
    """A full disk while the weights are written: one line, the previous checkpoint untouched."""
    path = tmp_path / "ckpt"
    zoo.save_tiny(path)
    before = {f.name: f.read_bytes() for f in path.iterdir()}

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint, if any, is untouched"):
        checkpoint.save(path, zoo.tiny_model(seed=1))
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_killed_swap_is_recovered(tmp_path):
    """Killed between moving the old directory aside and moving the new one in: the next write puts
    the old one back before anything else."""
    from adaptex.graphs import files

    out = tmp_path / "m.mlpackage"
    out.mkdir()
    (out / "v").write_text("old")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a process id that no longer runs
    work = tmp_path / f".m.mlpackage.adaptex-{dead}-xyz"
    work.mkdir()
    os.replace(out, work / "old")
    files.recover(out)
    assert (out / "v").read_text() == "old" and not work.exists()
