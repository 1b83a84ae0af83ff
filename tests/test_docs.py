"""The user documentation holds together: README.md and docs/*.md link only to files and headings that
exist, and the README stays short and reaches every docs/ page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOC_PAGES = PAGES[1:]
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return CODE.sub("", FENCE.sub("", text))


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, code marks and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", page.read_text()), re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links and images of a page that do not resolve to a file (and heading, if named)."""
    broken = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    return broken


@pytest.mark.parametrize("page", [*PAGES, ROOT / "benchmarks" / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_resolve(page):
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} has broken links"


def test_link_check_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#real-heading) [gone](missing.md) [bad](b.md#nope) ![img](x.png)\n"
        "`[not a link](nowhere.md)` [web](https://example.com/x.md)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "b.md#nope: no heading with that anchor in b.md",
        "x.png: no such file",
    ]


def test_slug_matches_githubs_anchors():
    assert slug("`make train` on fresh clones") == "make-train-on-fresh-clones"
    assert slug("Results from benchmarks/results") == "results-from-benchmarksresults"
    assert slug("torch.compile") == "torchcompile"
    assert slug("Memory layout (channels_last)") == "memory-layout-channels_last"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        for target in links(page):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.exists() and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    unreached = [p.name for p in DOC_PAGES if p.resolve() not in seen]
    assert unreached == [], "docs pages no link path from README.md reaches"
