"""The user documentation holds together: README.md and docs/*.md link only to files and headings that
exist, the README stays short and reaches every docs/ page, and docs/benchmarks.md's generated tables
are what scripts/benchmarks_table.py makes of the committed results."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
benchmarks_table = importlib.import_module("benchmarks_table")

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


# ---------------------------------------------------------------- docs/benchmarks.md and its script


def git_history(root: Path) -> bool:
    """Whether root is a git checkout with its full history (the tables name commits from it)."""
    run = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--is-shallow-repository"], check=False, capture_output=True, text=True
    )
    return run.returncode == 0 and run.stdout.strip() == "false"


@pytest.mark.skipif(not git_history(ROOT), reason="needs a git checkout with history")
def test_benchmarks_doc_is_what_the_script_makes_of_the_committed_results():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    start, end = benchmarks_table.generated_part(text)
    generated = benchmarks_table.render(benchmarks_table.committed_results(ROOT))
    assert text[start:end] == generated, "docs/benchmarks.md is out of date: python scripts/benchmarks_table.py --write"


def commit_all(repo: Path, message: str) -> str:
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message], check=True
    )
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_script_tables_committed_results_with_their_commit(tmp_path):
    """A made-up repository: the tables carry the committing commit and the JSON's figures; a file not yet
    committed and one of no known kind are named, not dropped."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    infer = {
        "model": {"cameras": 3, "image_size": [64, 96], "batch": 1, "grid_xy": [50, 50], "params_M": 0.5},
        "results": {"eager": {"median_ms": 12.345, "min_ms": 11.0, "max_ms": 13.0, "max_abs_logit_diff_vs_eager": 0.0}},
        "rounds": 7,
        "host": {"cpus": 4, "load_average_1m_at_start": 0.5, "load_average_1m_at_end": 0.75},
    }
    (results / "bench_infer_cpu.json").write_text(json.dumps(infer))
    (results / "mystery.json").write_text("{}")
    first = commit_all(tmp_path, "results")
    (results / "bench_infer_cpu.json").write_text(json.dumps({**infer, "date": "2031-02-03T04:05:06Z"}))
    second = commit_all(tmp_path, "a re-measurement")
    (results / "later.json").write_text("{}")

    committed = benchmarks_table.committed_results(tmp_path)
    assert [(r["name"], r["commit"]) for r in committed] == [("bench_infer_cpu.json", second), ("mystery.json", first)]
    assert benchmarks_table.uncommitted(tmp_path, committed) == ["later.json"]
    out = benchmarks_table.render(committed)
    assert f"2031-02-03 · recorded in commit `{second}` · 4-core x86_64 CPU, load 0.5-0.8" in out
    assert "| eager | 12.3 | 11.0 | 13.0 | 0.0e+00 |" in out
    assert "Without a table here: [mystery.json](../benchmarks/results/mystery.json)." in out
    assert "later.json" not in out


def test_write_replaces_only_the_generated_part():
    doc = f"intro\n{benchmarks_table.BEGIN}\nold tables\n{benchmarks_table.END}\noutro\n"
    new = f"{benchmarks_table.BEGIN}\nnew\n{benchmarks_table.END}\n"
    assert benchmarks_table.replaced(doc, new) == f"intro\n{new}outro\n"
    with pytest.raises(SystemExit, match="lacks the markers"):
        benchmarks_table.replaced("no markers here\n", new)
