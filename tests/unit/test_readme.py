"""The README's code blocks run as written.

Every block fenced ```bash, ```sh or ```python is run in order, in one fresh temporary directory
(the README's relative paths, such as build/bf.onnx, land there), with this environment's `adaptex`
and `python` first on PATH. Set-up lines (`make ...`, `pip install ...`, `source ...`) are skipped:
the test already runs inside an installed environment. Blocks that need a runtime these machines
lack are fenced with another language (```swift) and are not run. A command that fails fails the
test, with the block, the line and its output.

Not marked slow, so `make test` runs it (about a minute: one export, a check and a bench of the
shipped default model, and a tiny model of your own).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = {"bash", "sh", "python"}
SETUP = re.compile(r"^\s*(make\b|pip\s+install\b|python3?\s+-m\s+pip\s+install\b|source\b|\.\s)")
FENCE = re.compile(r"^```([\w+-]*)\s*$")


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number, code) of every fenced block, in order."""
    blocks, lang, start, lines = [], None, 0, []
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, lines = m.group(1).lower(), no + 1, []
        elif lang is not None and line.rstrip() == "```":
            blocks.append((lang, start, "\n".join(lines) + "\n"))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, f"README.md: the block opened at line {start - 1} is never closed"
    return blocks


def shell_script(code: str) -> str:
    """The block with its set-up lines dropped, every command checked (set -e, pipefail)."""
    kept = [ln for ln in code.splitlines() if not SETUP.match(ln)]
    return "set -euo pipefail\n" + "\n".join(kept) + "\n"


def test_code_blocks_are_found():
    blocks = code_blocks((ROOT / "README.md").read_text())
    langs = [lang for lang, *_ in blocks]
    assert "python" in langs and ("bash" in langs or "sh" in langs), langs
    assert all(lang in RUN | {"swift"} for lang in langs), (
        f"README.md has blocks in {sorted(set(langs) - RUN - {'swift'})}: run them here or fence them ```swift")


def test_setup_lines_are_the_only_ones_skipped():
    script = shell_script("make demo\nsource .venv/bin/activate\npip install .\nadaptex models\n")
    assert script.splitlines()[1:] == ["adaptex models"], script


def test_readme_code_blocks_run(tmp_path):
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    for lang, line, code in code_blocks((ROOT / "README.md").read_text()):
        if lang not in RUN:
            continue
        if lang == "python":
            cmd = [sys.executable, "-c", code]
        else:
            cmd = ["bash", "-c", shell_script(code)]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.fail(f"README.md, the ```{lang} block at line {line} failed (exit {r.returncode}):\n{code}\n"
                        f"--- stdout ---\n{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-4000:]}")
