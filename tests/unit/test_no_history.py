"""The project speaks of what it is and does, not of how it got there.

No tracked .py or .md file outside lab/ (the developers' dated log) names a round of development,
a run or a CPU by its place in time, or a sitting of work by its date: such lines mean nothing to a
reader who was not there, and they age with every change. A figure carries its date, its CPU and
the command that made it, and that is enough. The patterns are written with \\s so that this file
does not match them itself.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(
    r"(session|sitting)\s(of|on)\s20"       # a sitting of work by its date
    r"|[a-z]+(st|nd|rd|th)\ssession"        # an ordinal round of work
    r"|twenty[-a-z]*\ssession"
    r"|the\srun\sbefore|earlier\sCPU|earlier\sstop|previous\ssession|this\sstop",
    re.IGNORECASE)


def tracked_sources() -> list[str]:
    """Tracked *.py and *.md files outside lab/, relative to the repository root."""
    try:
        out = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in out if f and not f.startswith("lab/") and (ROOT / f).is_file()]


def test_no_line_speaks_of_the_projects_history():
    files = tracked_sources()
    assert any(f.startswith("docs/") for f in files) and "README.md" in files, files[:10]
    found = [f"{f}:{no}: {line.strip()[:120]}"
             for f in files
             for no, line in enumerate((ROOT / f).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if HISTORY.search(line)]
    assert not found, "lines that speak of the project's history (say what the software is and does; " \
                      "a figure keeps its date, CPU and command):\n" + "\n".join(found)


@pytest.mark.parametrize("line", ["measured in the ninth" + " session", "the run " + "before read 1.2",
                                  "on the earlier " + "CPU", "a session " + "of 2026-12-06"])
def test_the_patterns_catch_what_they_name(line):
    assert HISTORY.search(line)


@pytest.mark.parametrize("line", ["const classifier = await ort.InferenceSession.create(x)",
                                  "each program runs as a session of its own", "2026-12-06, AMD EPYC"])
def test_the_patterns_leave_ordinary_lines_alone(line):
    assert not HISTORY.search(line)
