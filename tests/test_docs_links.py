"""Every relative link in README.md and docs/*.md reaches a file, and a ``#heading`` in it where it names one
(the slug GitHub makes of the heading). Figures move between sections as runs are re-measured; a link that still
points at the old section is the usual way such a page rots."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"```.*?```", flags=re.S)  # code blocks: their '#' lines and brackets are not markdown


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but ``-`` and ``_``), spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", FENCED.sub("", page.read_text()), flags=re.M)}


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    """``page: target (why)`` for every relative link of ``pages`` (named relative to ``root``) that reaches no
    file or no heading."""
    bad = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here (no network)
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    assert len(PAGES) > 10
    assert broken_links(PAGES) == []


def test_a_link_to_a_missing_heading_or_file_is_caught(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Figures: one H100, at b13d967 (2026-11-26, evening)\n\n```\n# not a heading\n```\n"
                    "[ok](#figures-one-h100-at-b13d967-2026-11-26-evening) [gone](#not-a-heading) "
                    "[file](b.md) [web](https://example.com/x)\n")
    assert broken_links([page], tmp_path) == ["a.md: #not-a-heading (no such heading)", "a.md: b.md (no such file)"]
