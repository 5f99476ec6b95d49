"""Every relative link of the README, the docs and the benchmarks' README points at a file that
exists and, with a #fragment, at a heading of that file (docs moved or headings renamed break here)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", REPO / "docker" / "README.md",
         *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens; link text kept."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            where = dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest.name
            broken.append(f"{target} (no heading #{fragment} in {where})")
    return broken


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    problems = {str(p.relative_to(REPO)): broken_links(p) for p in PAGES if p.is_file()}
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, problems


def test_a_missing_heading_is_reported(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Title: one (two)\n\n[ok](#title-one-two) [bad](#nowhere) [file](b.md)\n")
    assert broken_links(page) == ["#nowhere (no heading #nowhere in a.md)", "b.md (no such file)"]
