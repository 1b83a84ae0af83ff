"""The user documentation holds together: README.md and docs/*.md link only to files and headings that
exist, the README stays short and reaches every docs/ page, and every figure in the README's results table
and in docs/benchmarks.md is one its linked result file holds."""

from __future__ import annotations

import json
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


# ---------------------------------------------------------------- figures against their result files
RESULTS = ROOT / "benchmarks" / "results"
FIGURE_COLUMNS = ("value", "figure")  # the README's results table, docs/benchmarks.md's table
# A number as a page shows it, with the unit that says how its file may store it (ms as s, min as s, % as a fraction).
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e-?\d+)?)(?:\s*(ms|min|s|%|x|×)(?![\w]))?(?![\w.])")
SCALES = {"ms": (1, 1e-3), "min": (1, 60), "%": (1, 0.01)}


def table_rows(page: Path) -> list[dict[str, str]]:
    """Each row of the page's Markdown tables (outside code blocks) as {header: cell}, "_row" the whole line."""
    rows, header = [], None
    for line in FENCE.sub("", page.read_text()).splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
        elif not all(set(c) <= set(":-") for c in cells):
            rows.append({**dict(zip(header, cells)), "_row": line})
    return rows


def json_numbers(path: Path) -> list[float]:
    """Every number a JSON file holds, at any depth (not the ones inside its strings)."""

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, list):
            for v in x:
                yield from walk(v)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            yield float(x)

    return list(walk(json.loads(path.read_text())))


def held(shown: str, unit: str | None, values: list[float]) -> bool:
    """Whether a number shown with its digits is one of `values` rounded to those digits (in the unit's scales)."""
    mantissa = shown.split("e")[0]
    decimals = len(mantissa.partition(".")[2])
    half = 0.5 * 10.0 ** (-decimals) * (10.0 ** int(shown.split("e")[1]) if "e" in shown else 1.0)
    for scale in SCALES.get(unit, (1,)):
        target = float(shown) * scale
        if any(abs(v - target) <= half * scale * (1 + 1e-9) + 1e-12 for v in values):
            return True
    return False


def unheld_figures(page: Path) -> list[str]:
    """The figures of the page's results tables that no result file linked from their row holds."""
    problems = []
    for row in table_rows(page):
        column = next((c for c in FIGURE_COLUMNS if c in row), None)
        if column is None:
            continue
        files = [(page.parent / t).resolve() for t in LINK.findall(row["_row"]) if t.endswith(".json")]
        files = [f for f in files if f.exists()]
        if not files:
            problems.append(f"{row[column][:60]}: the row links no result file (benchmarks/results/*.json)")
            continue
        values = [v for f in files for v in json_numbers(f)]
        for shown, unit in NUMBER.findall(CODE.sub("", row[column])):
            if not held(shown, unit or None, values):
                problems.append(f"{shown}{unit} ({row[column][:50]}...): not in {', '.join(f.name for f in files)}")
    return problems


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md"])
def test_every_figure_of_the_results_tables_is_in_its_result_file(page):
    assert unheld_figures(ROOT / page) == []


def test_figure_check_finds_a_figure_its_file_does_not_hold(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"a": {"iou": 0.4177, "time_s": 650, "ok": True}, "b": [2.344]}))
    page = tmp_path / "p.md"
    page.write_text(
        "| what | figure | file |\n|---|---|---|\n"
        "| ok | IoU 0.418, 10.8 min, 2.34x, `--flag 7` | [j](r.json) |\n"
        "| drift | IoU 0.420 in 650 s | [j](r.json) |\n"
        "| none | 13.2x | [page](p.md) |\n"
    )
    assert unheld_figures(page) == [
        "0.420 (IoU 0.420 in 650 s...): not in r.json",
        "13.2x: the row links no result file (benchmarks/results/*.json)",
    ]


COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def test_benchmarks_page_is_one_short_table_of_current_figures():
    page = ROOT / "docs" / "benchmarks.md"
    rows = table_rows(page)
    assert len(rows) <= 20, f"{len(rows)} table rows: one row per benchmark, at most 20"
    assert max(len(r["_row"]) for r in rows) <= 400, "a row longer than 400 characters: details go in its result file"
    text = page.read_text()
    assert "removed script" not in text and COMMIT_ID.findall(text) == [], "the result file names the commit"


# ---------------------------------------------------------------- what the pages cite exists
# A script or result file named in a page's text (inline code included), not a path inside another project's tree.
CITED = re.compile(r"(?<![\w/.-])((?:scripts|benchmarks/results)/[\w.-]+\.[a-z]+)")
CITE_CHECKED = [*PAGES, ROOT / "benchmarks" / "README.md"]


def missing_cited_files(page: Path, root: Path = ROOT) -> list[str]:
    return [p for p in sorted(set(CITED.findall(page.read_text()))) if not (root / p).exists()]


@pytest.mark.parametrize("page", CITE_CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_scripts_and_result_files_exist(page):
    assert missing_cited_files(page) == [], f"{page.relative_to(ROOT)} cites files that do not exist"


def test_cite_check_finds_a_missing_script_and_skips_other_projects_paths(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "here.py").write_text("")
    page = tmp_path / "p.md"
    page.write_text("`python scripts/here.py` (`benchmarks/results/gone.json`), `projects/configs/x/scripts/y.py`\n")
    assert missing_cited_files(page, tmp_path) == ["benchmarks/results/gone.json"]


@pytest.mark.parametrize("page", ["docs/occupancy.md", "docs/inference.md"])
def test_occupancy_pages_name_every_key_a_prediction_file_holds(page):
    from bev.tasks.occupancy.io import PREDICTION_KEYS

    text = (ROOT / page).read_text()
    assert [k for k in PREDICTION_KEYS if f"`{k}`" not in text and f'"{k}"' not in text] == []


# ---------------------------------------------------------------- docs/detection.md: figures only from result files
PLAIN_NUMBER = re.compile(r"\**(\d+(?:\.\d+)?)\**")


def tables_with_captions(page: Path) -> list[tuple[str, list[list[str]]]]:
    """Each Markdown table of the page (outside code blocks) with its caption, the paragraph just above it."""
    out, paragraph, last, table = [], [], [], None
    for line in FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("|"):
            if table is None:
                table = (" ".join(paragraph or last), [])
                out.append(table)
                paragraph = last = []
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set(":-") for c in cells):
                table[1].append(cells)
        elif line.strip():
            table, paragraph = None, [*paragraph, line]
        else:
            table, last, paragraph = None, paragraph or last, []
    return out


def unheld_table_figures(page: Path) -> list[str]:
    """The figures (cells that are a number) of the page's tables that no result file their caption links holds."""
    problems = []
    for caption, rows in tables_with_captions(page):
        figures = [m.group(1) for row in rows for cell in row if (m := PLAIN_NUMBER.fullmatch(cell))]
        files = [(page.parent / t).resolve() for t in LINK.findall(prose(caption)) if t.endswith(".json")]
        files = [f for f in files if f.exists()]
        if figures and not files:
            problems.append(f"a table of {len(figures)} figures whose caption links no result file: {caption[:60]}")
            continue
        values = [v for f in files for v in json_numbers(f)]
        problems += [f"{x}: not in {', '.join(f.name for f in files)}" for x in figures if not held(x, None, values)]
    return problems


def test_detection_page_shows_only_figures_its_tables_captions_link():
    assert unheld_table_figures(ROOT / "docs" / "detection.md") == []


def test_table_figure_check_finds_an_unheld_figure_and_an_uncaptioned_table(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"mAP": 0.2413, "steps": 1920}))
    page = tmp_path / "p.md"
    page.write_text(
        "Scored ([r](r.json)):\n\n| run | mAP | steps |\n|---|---:|---:|\n| a | **0.241** | 1920 |\n| b | 0.250 | x 3 |\n"
        "\nNo file here.\n\n| run | NDS |\n|---|---:|\n| a | 0.3 |\n\n| option | default |\n|---|---|\n| `nms` | circle |\n"
    )
    assert unheld_table_figures(page) == [
        "0.250: not in r.json",
        "a table of 1 figures whose caption links no result file: No file here.",
    ]


def test_detection_ablations_name_their_command_decision_and_existing_result_files():
    ablations = json.loads((RESULTS / "detection_ablations.json").read_text())
    for c in ablations["comparisons"]:
        assert all(c.get(k) for k in ("name", "question", "command", "decision", "result_files")), c.get("name")
        assert [f for f in c["result_files"] if not (RESULTS / f).exists()] == [], c["name"]
