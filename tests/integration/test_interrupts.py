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
from tests.support import zoo


def _debris(d, name, tmpdir):
    near = [p.name for p in d.iterdir() if p.name.startswith(f".{name}.")]
    far = [p.name for p in tmpdir.iterdir() if p.name.startswith("adaptex-")]
    return near + far


def _export(ckpt, out, target, variant, tmpdir):
    env = {**os.environ, "TMPDIR": str(tmpdir), "ADAPTEX_TEMP_GRACE_S": "0"}  # what a SIGKILL left: swept at once
    return subprocess.Popen([sys.executable, "-m", "adaptex", "export", str(ckpt), "--target", target,
                             "--variant", variant, "-o", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _readable(out, target):
    if target == "onnx":
        return read_onnx_metadata(out)
    from adaptex.exporter.targets.coreml.package import read_package_meta

    return read_package_meta(out)


@pytest.mark.parametrize("target, suffix, kills", [
    ("onnx", ".onnx", [(signal.SIGTERM, 2.5), (signal.SIGKILL, 3.0)]),
    pytest.param("onnx", ".onnx", [(signal.SIGTERM, 4.0), (signal.SIGKILL, 4.5)], marks=pytest.mark.slow),
    pytest.param("coreml", ".mlpackage", [(signal.SIGTERM, 5.0), (signal.SIGKILL, 6.5)], marks=pytest.mark.slow),
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
    work = tmp_path / f".m.mlpackage.adaptex-{dead}-h{files.HOST_TAG}-0123abcd"
    work.mkdir()
    os.replace(out, work / "old")
    files.recover(out)
    assert (out / "v").read_text() == "old" and not work.exists()


# --- a write that fails half way, for every writer ------------------------------------------------------

def _tree(path):
    """Every file under `path` (or the file itself) with its bytes: what 'untouched' means."""
    from pathlib import Path

    path = Path(path)
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_failed_core_ml_write_keeps_the_old_package(artifacts, tmp_path, monkeypatch):
    import shutil

    import coremltools as ct

    from adaptex.exporter.errors import ExportError
    from adaptex.graphs import files

    out = tmp_path / "m.mlpackage"
    shutil.copytree(artifacts("bf", "coreml", "dense"), out)
    before = _tree(out)
    real = ct.models.MLModel.save

    def half(self, path):
        real(self, path)  # the whole package written, then its weights cut short by a full disk
        weights = next(p for p in __import__("pathlib").Path(path).rglob("weight.bin"))
        weights.write_bytes(weights.read_bytes()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ct.models.MLModel, "save", half)
    monkeypatch.setattr(files.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(ExportError, match="writing failed .No space left on device.*previous artifact, if any, is untouched"):
        zoo.export(artifacts.model("bf"), None, out, "coreml", variant="sparse")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.mlpackage", "tmp"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_failed_tensorrt_onnx_write_keeps_the_old_file(artifacts, tmp_path, monkeypatch, capsys):
    import shutil
    from pathlib import Path

    from adaptex.cli import main

    out = tmp_path / "m.onnx"
    shutil.copy(artifacts("bf", "tensorrt", "dense"), out)
    before = out.read_bytes()
    real = Path.write_bytes

    def half(self, data):
        if self.name.startswith(".m.onnx."):  # the temporary file beside the artifact
            real(self, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", half)
    ckpt = artifacts.checkpoints / "bf"
    assert main(["export", str(ckpt), "--target", "tensorrt", "--onnx-only", "-o", str(out)]) == 2
    assert "writing failed (No space left on device); nothing was written" in capsys.readouterr().err
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


class _FakeTensorRT:
    """Just enough of TensorRT 10's builder API for build_engine to reach its writes (TensorRT cannot
    run here; what is tested is adaptex's writing of the plan and its metadata)."""
    __version__ = "10.0-fake"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class _Object:
        num_errors = 0

        def __getattr__(self, name):
            return lambda *a, **k: _FakeTensorRT._Object()

        def parse(self, data):
            return True

        def add_optimization_profile(self, p):
            return 0

        def build_serialized_network(self, network, config):
            return b"an engine of " + str(id(network)).encode()

    Builder = OnnxParser = staticmethod(lambda *a: _FakeTensorRT._Object())


def test_a_failed_engine_write_keeps_the_old_plan_and_its_metadata(artifacts, tmp_path, monkeypatch):
    from pathlib import Path

    from adaptex.exporter.errors import ExportError
    from adaptex.exporter.targets import tensorrt
    from adaptex.exporter.targets.tensorrt import engine

    monkeypatch.setattr(engine, "require_tensorrt", lambda: _FakeTensorRT)
    monkeypatch.setattr(tensorrt, "require_tensorrt", lambda: _FakeTensorRT)
    bound = artifacts("bf", "tensorrt")
    plan = tmp_path / "m.plan"
    tensorrt.export_from_onnx(bound, plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.plan", "m.plan.json"]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = Path.write_text

    def half(self, text, *a, **k):  # the plan's bytes are down, its metadata hits a full disk
        if self.name.startswith(".m.plan.json."):
            real(self, text[: len(text) // 2])
            raise OSError(28, "No space left on device")
        return real(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(ExportError, match="writing failed .No space left on device"):
        tensorrt.export_from_onnx(bound, plan)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_check_refuses_a_reference_that_is_not_the_artifacts_source(tiny_onnx, tmp_path, capsys):
    """The sha256 the artifact records of its source's weights and config is compared with the
    checkpoint `check` would use: another model's, or its own with a changed config, is refused (exit
    2, the hashes and the fix named) rather than reported as a parity failure."""
    import json
    import shutil

    from adaptex.cli import main
    from adaptex.exporter.metadata import read_onnx_metadata

    src = read_onnx_metadata(tiny_onnx["sparse"])["source"]
    other = tmp_path / "other"
    zoo.save_tiny(other, seed=1)
    assert main(["check", str(tiny_onnx["sparse"]), "--model", str(other), "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert f"is not the one this artifact was exported from (sha256 {src['sha256'][:12]})" in err
    assert "re-export the artifact" in err
    edited = tmp_path / "edited"
    shutil.copytree(src["checkpoint"], edited)
    cfg = json.loads((edited / "config.json").read_text())
    cfg["description"] = "the same weights, another config"
    (edited / "config.json").write_text(json.dumps(cfg))
    assert main(["check", str(tiny_onnx["sparse"]), "--model", str(edited), "--samples", "2"]) == 2
    assert "its config.json changed since the export" in capsys.readouterr().err
    assert main(["check", str(tiny_onnx["sparse"]), "--model", src["checkpoint"], "--samples", "2"]) == 0


def test_sigterm_that_a_library_wraps_in_its_own_error_still_exits_as_terminated(monkeypatch, capsys):
    """torch's tracing and exporters catch what the code they run raises and raise their own error:
    a SIGTERM arriving there must still end the command as terminated (143), not as a failed export."""
    import signal as sig

    from adaptex import cli
    from adaptex.graphs import files

    def wrapped(args):
        try:
            sig.getsignal(sig.SIGTERM)(sig.SIGTERM, None)  # the handler main() installed
        except BaseException as e:
            raise RuntimeError("torch.onnx.export failed") from e

    class Cmd:
        def add_parser(self, sub):
            sub.add_parser("boom").set_defaults(run=wrapped)
    monkeypatch.setattr(cli, "COMMANDS", [Cmd()])
    monkeypatch.setattr(files, "_TERMINATED", [])
    previous = sig.getsignal(sig.SIGTERM)
    try:
        assert cli.main(["boom"]) == 143
    finally:
        sig.signal(sig.SIGTERM, previous)
    assert "terminated" in capsys.readouterr().err
