"""The documentation a user reads: its size, its links, and code that points into it by name.

README.md is a guide (at most 12 KB) and BENCHMARKS.md an overview (at most 25 KB); the detail lives under docs/.
Every relative link in them resolves to a file, and a `#fragment` to a heading of that file, so a page that moves
or a heading that is renamed fails here instead of in a reader's browser.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)|^\[[^\]]+\]: (\S+)", re.M)
CODE_FILES = [p for pattern in ("*.py", "*.yaml", "*.sh", "*.patch", "Makefile", "*.toml")
              for p in ROOT.rglob(pattern) if ".venv" not in p.parts and "runs" not in p.parts]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            found.add(slug(m.group(1)))
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [next(g for g in m.groups() if g) for m in LINK.finditer(text)]


def test_readme_and_benchmarks_stay_short():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024, "README.md is a guide: move detail to docs/"
    assert len((ROOT / "BENCHMARKS.md").read_bytes()) <= 25 * 1024, "BENCHMARKS.md: detail to docs/benchmarks/"


def test_the_headline_table_has_at_most_twelve_rows_with_a_commit_each():
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    rows = table[2:]  # below the header and its rule
    assert 0 < len(rows) <= 12
    header = [c.strip() for c in table[0].strip("|").split("|")]
    commit = header.index("commit")
    for row in rows:
        assert re.fullmatch(r"[0-9a-f]{7}", row.strip("|").split("|")[commit].strip()), row


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title here\n")
    page.write_text("[ok](b.md#title-here) ![fig](b.md) [bad](b.md#nothing)\n```\n[not a link](x.md)\n```\n")
    assert links(page) == ["b.md#title-here", "b.md", "b.md#nothing"]
    assert "nothing" not in anchors(tmp_path / "b.md")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no such heading in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_code_points_to_the_docs_by_name_not_by_section_number():
    """Section numbers move when a page is reorganised; a page's name and a heading's words do not."""
    numbered = re.compile(r"§ ?\d|BENCHMARKS(\.md)?,? sections? \d|BENCHMARKS \d|figures in[ ]BENCHMARKS")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in CODE_FILES
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if numbered.search(line)]
    assert not found, found
