"""adaptex deletes only what it provably made: in the system temp directory, a process directory with
its owner record, of this host, whose process is gone, older than the grace period. A user's folder
named like adaptex's, or another host's running job in a shared temp directory, survives every sweep."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from adaptex.graphs import files
from tests.support import zoo


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def _plant(tmp, name, owner=None, age_s=3600.0):
    d = tmp / name
    d.mkdir()
    (d / "important.txt").write_text("precious")
    if owner is not None:
        (d / files.OWNER).write_text(json.dumps({"tool": "adaptex", "start": "", "made": 0, **owner}))
    old = os.stat(d).st_mtime - age_s
    for p in (d, *d.iterdir()):
        os.utime(p, (old, old))
    return d


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A temp directory holding a user's `adaptex-2024-results`, a foreign host's live job, a dead
    process's fresh directory (within the grace period) and a dead process's old one (abandoned)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("ADAPTEX_TEMP_GRACE_S", raising=False)
    dead = _dead_pid()
    keep = [_plant(tmp, "adaptex-2024-results"),
            _plant(tmp, "adaptex-1-foreign", {"host": "another-host|boot|ns", "pid": dead}),
            _plant(tmp, f"adaptex-{dead}-young", {"host": files.HOST, "pid": dead}, age_s=0),
            _plant(tmp, f"adaptex-{os.getppid()}-live", {"host": files.HOST, "pid": os.getppid()}),
            _plant(tmp, "adaptex-7-forged", {"host": files.HOST, "pid": "7"})]
    gone = _plant(tmp, f"adaptex-{dead}-abandoned", {"host": files.HOST, "pid": dead})
    return tmp, keep, gone


def _survived(keep):
    return all((d / "important.txt").read_text() == "precious" for d in keep)


@pytest.mark.parametrize("kind", ["bench", "lib"])
def test_every_temp_directory_sweeps_only_what_adaptex_abandoned(planted, kind):
    """bench's work directory and the libraries' (coremltools' packages): what every Core ML export and
    bench makes first."""
    tmp, keep, gone = planted
    block = files.temp_dir(kind) if kind == "bench" else files.tempdir_for_libraries()
    with block as d:
        assert d.is_dir() and (d.parent / files.OWNER).is_file()
        record = json.loads((d.parent / files.OWNER).read_text())
        assert (record["host"], record["pid"]) == (files.HOST, os.getpid())
    assert _survived(keep) and not gone.exists()
    assert sorted(p.name for p in tmp.glob("adaptex-*")) == sorted(d.name for d in keep)


@pytest.mark.slow
def test_a_core_ml_export_sweeps_only_what_adaptex_abandoned(planted, tmp_path):
    tmp, keep, gone = planted
    zoo.export(zoo.tiny_model(), None, tmp_path / "m.mlpackage", "coreml", variant="dense")
    assert _survived(keep) and not gone.exists()
    assert sorted(p.name for p in tmp.glob("adaptex-*")) == sorted(d.name for d in keep)  # its own work dir gone too


@pytest.mark.slow
def test_a_bench_sweeps_only_what_adaptex_abandoned(planted, tiny_onnx, capsys):
    from adaptex.cli import main

    tmp, keep, gone = planted
    assert main(["bench", str(tiny_onnx["sparse"]), "--seq", "8", "--runs", "3", "--warmup", "1", "--json"]) == 0
    assert _survived(keep) and not gone.exists()
    assert sorted(p.name for p in tmp.glob("adaptex-*")) == sorted(d.name for d in keep)


def test_the_grace_period_is_a_setting(planted, monkeypatch):
    tmp, keep, gone = planted
    monkeypatch.setenv("ADAPTEX_TEMP_GRACE_S", "0")
    files.sweep_temp()
    assert not keep[2].exists() and not gone.exists()  # the young dead one too
    assert _survived([keep[i] for i in (0, 1, 3, 4)])


def test_a_recycled_process_id_is_no_alibi(planted, monkeypatch):
    """The record's start time differs from the running process that now has the id: dead."""
    tmp, keep, gone = planted
    d = _plant(tmp, f"adaptex-{os.getpid()}-recycled", {"host": files.HOST, "pid": os.getppid(), "start": "1"})
    files.sweep_temp()
    assert not d.exists() if files._start_time(os.getppid()) else d.exists()


def test_beside_an_artifact_only_the_exact_form_of_this_host_is_swept(tmp_path):
    dead = _dead_pid()
    ours = tmp_path / f".m.onnx.adaptex-{dead}-h{files.HOST_TAG}-0123abcd.tmp"
    theirs = [tmp_path / f".m.onnx.adaptex-{dead}-hffffff-0123abcd.tmp" if files.HOST_TAG != "ffffff" else
              tmp_path / f".m.onnx.adaptex-{dead}-h000000-0123abcd.tmp",
              tmp_path / f".m.onnx.adaptex-{dead}-notes.txt", tmp_path / ".m.onnx.adaptex-2024-results"]
    for p in (ours, *theirs):
        p.write_text("x")
    files.sweep(tmp_path, ".m.onnx.adaptex-*")
    assert not ours.exists() and all(p.exists() for p in theirs)
