"""The docs are a reference that stays inside the repository: every relative link in
README.md and docs/*.md resolves, and no tracked file points at notes kept outside it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    links = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same page
        links.append(target.split("#", 1)[0])
    return links


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    missing = [t for t in _relative_links(doc) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)}: links to missing files: {missing}"


def test_no_tracked_file_points_outside_the_repository() -> None:
    try:
        out = subprocess.run(["git", "grep", "-n", "-I", "-e", "DESIGN.md", "-e", "../shared", "--", ".",
                              ":(exclude)tests/test_docs.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("git is not available")
    if out.returncode not in (0, 1):  # 1: no match; anything else: not a git checkout
        pytest.skip(f"git grep failed: {out.stderr.strip()}")
    assert out.stdout == "", "references to files outside the repository:\n" + out.stdout


def test_the_architecture_names_real_files_and_walks_in_eight() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\b((?:server|models|protos|clients|training|loadtest|tests)/[\w/]+\.(?:py|proto))\b", text))
    assert named and not [f for f in sorted(named) if not (ROOT / f).is_file()]
    walk = text.split("## The path, in eight files", 1)[1].split("\n## ", 1)[0]
    walked = set(re.findall(r"\*\*`([\w/.]+)`\*\*", walk))
    assert 0 < len(walked) <= 8 and walked <= named, walked
    # the diagram above it names no other file
    diagram = text.split("```", 2)[1]
    assert set(re.findall(r"\b(?:server|models|protos)/[\w/]+\.py\b", diagram)) <= walked
