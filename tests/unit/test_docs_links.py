"""Every relative link in the tracked Markdown files leads somewhere: the file exists, and a
#fragment into a Markdown file names one of its headings (GitHub's anchors: lower case, spaces to
hyphens, punctuation dropped). Links inside fenced code and links with a scheme (https:, mailto:)
are not followed."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose_lines(path: Path):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield no, line


def anchors(path: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for _, line in prose_lines(path) if line.startswith("#")}


def markdown_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [f for f in out.split("\n") if f and (ROOT / f).is_file() and "node_modules/" not in f]


def test_every_relative_link_leads_somewhere():
    files = markdown_files()
    assert "README.md" in files and "docs/benchmarking.md" in files
    broken = []
    for f in files:
        page = ROOT / f
        for no, line in prose_lines(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue
                path, _, fragment = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    broken.append(f"{f}:{no}: {target} (no such file)")
                elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                    broken.append(f"{f}:{no}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_anchors_follow_githubs_rule():
    assert anchor(" The yardstick: the fastest dense graph, not one dense export") == \
        "the-yardstick-the-fastest-dense-graph-not-one-dense-export"
    assert anchor("Never slower than dense") == "never-slower-than-dense"
