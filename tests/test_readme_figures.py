"""README.md's "Does it pay?" table against BENCHMARKS.md's headline table: one measurement, one set of figures.

Each README row names one k and links the page under docs/benchmarks/ that measured it. BENCHMARKS.md's
headline quotes some of the same measurements in prose cells. Where both quote the same measurement (the same
page, target, engine, machine, drafter and k), τ, the speed-up and the ceiling must be the same figures: a README
that quotes one run and BENCHMARKS.md another (the bfloat16 head at 1.20× and 1.15×) fails here.

What is read from a headline row (a claim is a quantity, its k, its engine and machine, and a figure):
- its `figure` cell: a τ where the question asks what a drafter keeps, a speed-up where it asks whether it pays;
- in its `figure` and `against` cells, clause by clause (split at ';'): "ceiling X×" (with "at k = N" after each
  figure where it names one), "X× over plain" (the speed-up of the drafter named before it), and
  "on 2 CPU cores: X×" (the same speed-up on the CPU machine).
A clause's k is the one it names ("k = N", "best k (N)"), else the row's; its engine llama.cpp where the clause
or the row's description names it. Figures the rules do not read are not compared; the test asserts that every
README row whose page the headline quotes is compared at least once, so a rule that stops matching fails too.

Links: tests/test_docs.py checks that every link in README.md resolves (file and heading); here each row of the
table must link exactly one page under docs/benchmarks/, with its helpers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import test_docs  # the link helpers (imported as a module so pytest does not collect its tests twice)

ROOT = Path(__file__).resolve().parents[1]
K = re.compile(r"\bk = (\d+)|\bbest k \((\d+)\)")
NUMBER = re.compile(r"\d+\.\d+")
DRAFTERS = {"head": r"\bhead\b", "PARD": r"\bPARD\b", "P-EAGLE": r"\bP-EAGLE\b", "DFlash": r"\bDFlash\b",
            "draft LM": r"draft LM|self-draft", "off-the-shelf": r"off-the-shelf", "n-gram": r"n-?gram"}


@dataclass(frozen=True)
class Key:
    page: str  # docs/benchmarks/<name>.md, without the anchor: one page, one set of runs
    target: str | None  # "toy", "SmolLM2"; None where a headline row does not say
    engine: str  # "llama.cpp", "vLLM" or "loop"
    machine: str  # "H200" or "CPU"
    drafter: str | None
    k: int

    def matches(self, other: Key) -> bool:
        same = lambda a, b: a is None or b is None or a == b  # noqa: E731
        return (self.page == other.page and self.engine == other.engine and self.machine == other.machine
                and self.k == other.k and same(self.target, other.target) and same(self.drafter, other.drafter))


def table(text: str, heading: str) -> list[dict[str, str]]:
    """The first table under `heading`, as dicts from the header's names to the cells."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    split = lambda line: [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # noqa: E731
    header = split(lines[0])
    return [dict(zip(header, split(line))) for line in lines[2:]]


def page_of(cell: str) -> str | None:
    pages = {re.sub(r"^(\.\./)+", "", link.partition("#")[0]) for link in re.findall(r"\]\(([^)\s]+)\)", cell)}
    pages = {p for p in pages if p.startswith("docs/benchmarks/")}
    return pages.pop() if len(pages) == 1 else None


def ks(text: str) -> list[int]:
    return [int(a or b) for a, b in K.findall(text)]


def figure(cell: str) -> float | None:
    m = NUMBER.search(cell)
    return float(m.group()) if m else None


def target_of(text: str) -> str | None:
    if re.search(r"\btoy\b", text, re.I):
        return "toy"
    return "SmolLM2" if "SmolLM2" in text else None


def engine_of(text: str) -> str:
    return "llama.cpp" if "llama.cpp" in text else "vLLM" if "vLLM" in text else "loop"


def drafter_of(text: str, last: bool = False) -> str | None:
    found = [(m.start(), name) for name, pattern in DRAFTERS.items() for m in re.finditer(pattern, text)]
    return (max(found) if last else min(found))[1] if found else None


def readme_rows(text: str) -> list[tuple[dict[str, str], Key]]:
    rows = []
    for row in table(text, "## Does it pay?"):
        where, found = row["where it ran"], ks(" ".join(row.values()))
        k = found[0] if len(set(found)) == 1 else -1  # -1: test_each_readme_row_names_one_k says why
        rows.append((row, Key(page=page_of(row["verdict"]), target=target_of(row["target, machine"]),
                              engine=engine_of(where),
                              machine="H200" if "H200" in row["target, machine"] else "CPU",
                              drafter=drafter_of(row["drafter"]), k=k)))
    return rows


def headline_claims(text: str) -> list[tuple[str, Key, float, str]]:
    """(quantity, key, figure, where it was read) for every figure of BENCHMARKS.md's headline the rules read."""
    claims = []
    for row in table(text, "## Headline"):
        question, what = row["question"], row["what was measured"]
        page = page_of(row["page"])
        if page is None:
            continue
        described = question + " " + what
        row_k = ks(what)
        base = dict(page=page, target=target_of(described),
                    engine=engine_of(what),
                    machine="H200" if row["machine"] == "H200" else "CPU",
                    drafter=drafter_of(what))
        if len(set(row_k)) == 1:
            quantity = ("τ" if "keep" in question and "×" not in row["figure"]
                        else "speed-up" if question.startswith("Does it pay") and "×" in row["figure"] else None)
            if quantity and figure(row["figure"]) is not None:
                claims.append((quantity, Key(**base, k=row_k[0]), figure(row["figure"]), row["figure"]))
        for clause in re.split(r";", row["figure"] + ";" + row["against"]):
            clause_k = ks(clause)
            k = clause_k[0] if clause_k else (row_k[0] if len(set(row_k)) == 1 else None)
            engine = "llama.cpp" if "llama.cpp" in clause else base["engine"]
            if m := re.search(r"ceiling (.*)", clause):
                for value, at in re.findall(r"(\d+\.\d+)×(?: at k = (\d+))?", m.group(1)):
                    if at or k is not None:
                        # In llama.cpp β, and so the ceiling, is measured from each drafter's own rounds: a
                        # clause that names its drafter is that drafter's ceiling, else the engine's.
                        key = Key(**{**base, "engine": engine, "drafter": drafter_of(clause, last=True)},
                                  k=int(at) if at else k)
                        claims.append(("ceiling", key, float(value), clause.strip()))
            for m in re.finditer(r"(\d+\.\d+)× (?:\(\d+\.\d+–\d+\.\d+\) )?over plain", clause):
                if k is not None:
                    key = Key(**{**base, "engine": engine, "drafter": drafter_of(clause[:m.start()], last=True)}, k=k)
                    claims.append(("speed-up", key, float(m.group(1)), clause.strip()))
            for m in re.finditer(r"on 2 CPU cores: (\d+\.\d+)×", clause):
                if k is not None:
                    claims.append(("speed-up", Key(**{**base, "machine": "CPU"}, k=k), float(m.group(1)),
                                   clause.strip()))
    return claims


def disagreements(readme: str, benchmarks: str) -> tuple[list[str], set[int]]:
    """What the two tables quote differently, and the README rows (by index) that some claim was compared with."""
    rows, found, compared = readme_rows(readme), [], set()
    columns = {"τ": "τ", "speed-up": "speed-up (95 %)", "ceiling": "ceiling"}
    for quantity, key, value, source in headline_claims(benchmarks):
        for i, (row, row_key) in enumerate(rows):
            if row_key.matches(key):
                ours = figure(row[columns[quantity]])
                if ours is None:
                    continue  # "–": README does not quote this figure
                compared.add(i)
                if ours != value:
                    found.append(f"{quantity} at k = {key.k} ({key.page}, {key.engine}, {key.machine}): README "
                                 f"{row[columns[quantity]]!r}, BENCHMARKS.md {source!r}")
    return found, compared


def test_each_readme_row_names_one_k_and_one_page():
    for row, key in readme_rows((ROOT / "README.md").read_text()):
        assert len(K.findall(" ".join(row.values()))) == 1, f"name exactly one k in the row: {row}"
        assert key.k > 0 and key.page, row


def test_each_readme_row_links_its_page_and_heading():
    for row, _ in readme_rows((ROOT / "README.md").read_text()):
        links = [next(g for g in m.groups() if g) for m in test_docs.LINK.finditer(" | ".join(row.values()))]
        targets = [t for t in links if t.startswith("docs/benchmarks/")]
        assert len(targets) == 1, row
        path, _, anchor = targets[0].partition("#")
        assert (ROOT / path).exists(), targets[0]
        assert not anchor or anchor in test_docs.anchors(ROOT / path), f"no such heading: {targets[0]}"


def test_readme_and_benchmarks_quote_the_same_figures():
    readme, benchmarks = (ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()
    found, compared = disagreements(readme, benchmarks)
    assert not found, "\n".join(found)
    quoted = {key.page for _, key, _, _ in headline_claims(benchmarks)}
    rows = readme_rows(readme)
    missed = [row["where it ran"] for i, (row, key) in enumerate(rows) if key.page in quoted and i not in compared]
    assert not missed, f"README rows whose page the headline quotes, compared with nothing: {missed}"


@pytest.mark.parametrize("old, new", [
    ("| 1.15× (1.09–1.21) | 2.8× |", "| 1.20× (1.12–1.29) | 2.8× |"),  # the other bfloat16 run's speed-up
    ("| 1.15× (1.09–1.21) | 2.8× |", "| 1.15× (1.09–1.21) | 2.9× |"),  # and its ceiling
    ("| 0.74× (0.71–0.76) | 1.83× |", "| 0.74× (0.71–0.76) | 1.17× |"),  # the CPU's ceiling in the H200 row
    ("| 1.62 | 0.97× (0.92–1.02) |", "| 1.62 | 0.99× (0.92–1.02) |"),
])
def test_a_changed_readme_figure_is_seen(old, new):
    readme, benchmarks = (ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()
    assert readme.count(old) == 1, f"the README no longer holds {old!r}: update this test's examples"
    found, _ = disagreements(readme.replace(old, new), benchmarks)
    assert found


def test_a_row_with_two_ks_is_seen():
    readme = (ROOT / "README.md").read_text()
    broken = readme.replace("| – | 0.52× (0.51–0.54) |", "| 1.88 at k = 4 | 0.52× (0.51–0.54) |")
    assert broken != readme
    assert any(len(K.findall(" ".join(row.values()))) != 1 for row, _ in readme_rows(broken))
