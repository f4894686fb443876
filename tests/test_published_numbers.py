"""Every published number cites a record in the repository, and says no more than it.

The README and docs/results.md publish measured numbers in tables. A table that has a
``record`` column is checked here, row by row:

* the record cell links (markdown ``[text](target)``) to at least one record: a file under
  ``bench/results/`` (one compact record a published table: its rows, the command that
  reproduces them, the date, machine and vLLM version), which must exist. A row whose
  number has no record in the repository says so in that cell (``no record in the
  repository``) and then may not bold a number;
* the row's headline numbers are its **bold** numbers (every row with a record bolds at
  least one), and each must be found in the records it cites: the same digits, or a more
  precise figure there that rounds to it (252.6 is found in 252.62 or 252.6195...);
  thousands separators are ignored;
* a ``reproduce`` column, where the table has one, names a command in backticks.

Beyond the tables, every ``bench/results/...`` path that the README, the docs, the tests
or the bench scripts name must exist, so that no citation outlives its record; and every
markdown record says when, where and on which vLLM it was measured, and how to reproduce
it. Tables this file requires to carry records are listed in ``REQUIRED``, so a record
column cannot be dropped unnoticed.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
NO_RECORD = "no record in the repository"

# (document, heading the table sits under): tables that must have a record column
REQUIRED = [
    ("README.md", "## Measured numbers"),
    ("README.md", "## The plugin at startup"),  # the weight formats table
    ("docs/results.md", "# Measured numbers"),
]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BOLD = re.compile(r"\*\*(.+?)\*\*")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def split_row(line: str) -> list[str]:
    """A table line's cells; ``\\|`` inside a cell is not a separator."""
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") and not body.endswith("\\|") else body
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def tables(text: str) -> list[dict]:
    """Every markdown table: its heading, header cells and data rows (with line numbers)."""
    out, heading, lines, i = [], "", unfenced(text), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.strip()
        if (line.lstrip().startswith("|") and i + 1 < len(lines)
                and re.fullmatch(r"\s*\|?(\s*:?-{3,}:?\s*\|)+\s*:?-*:?\s*\|?\s*", lines[i + 1])):
            header = [c.lower() for c in split_row(line)]
            rows, j = [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append((j + 1, split_row(lines[j])))
                j += 1
            out.append({"heading": heading, "header": header, "rows": rows})
            i = j
            continue
        i += 1
    return out


def unfenced(text: str) -> list[str]:
    """The text's lines with those inside code fences blanked (a ``# comment`` in a shell
    block is not a heading), so line numbers still match the file."""
    lines, inside = text.splitlines(), False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            inside = not inside
            lines[i] = ""
        elif inside:
            lines[i] = ""
    return lines


def record_text(doc: Path, target: str) -> str:
    """The text of one cited record; AssertionError when it is not a record or is missing."""
    path = (doc.parent / target.partition("#")[0]).resolve()
    assert path.is_relative_to(RESULTS), f"{target}: a record is a file under bench/results/"
    assert path.is_file(), f"{target}: no such record"
    return path.read_text(errors="replace")


def numbers_in(text: str) -> set[str]:
    return set(NUMBER.findall(THOUSANDS.sub("", text)))


def found(claim: str, pool: set[str]) -> bool:
    """``claim`` is in ``pool`` as written, or as a more precise figure rounding to it."""
    if claim in pool:
        return True
    want = Decimal(claim)
    places = -want.as_tuple().exponent
    quantum = Decimal(1).scaleb(-places)
    for text in pool:
        have = Decimal(text)
        if -have.as_tuple().exponent <= places:
            continue
        if want in (have.quantize(quantum, ROUND_HALF_UP), have.quantize(quantum, ROUND_HALF_EVEN)):
            return True
    return False


def published(doc_name: str) -> list[dict]:
    doc = ROOT / doc_name
    return [t | {"doc": doc} for t in tables(doc.read_text()) if "record" in t["header"]]


def check_table(table: dict) -> list[str]:
    """Every fault of one table, as ``doc:line: what``."""
    faults, header, doc = [], table["header"], table["doc"]
    rec_col = header.index("record")
    cmd_col = header.index("reproduce") if "reproduce" in header else None
    for line_no, cells in table["rows"]:
        where = f"{doc.relative_to(ROOT)}:{line_no}"
        if len(cells) != len(header):
            faults.append(f"{where}: {len(cells)} cells under {len(header)} headers")
            continue
        record = cells[rec_col]
        others = " ".join(c for k, c in enumerate(cells) if k != rec_col)
        claims = [THOUSANDS.sub("", n) for span in BOLD.findall(others)
                  for n in NUMBER.findall(THOUSANDS.sub("", span))]
        if cmd_col is not None and "`" not in cells[cmd_col]:
            faults.append(f"{where}: the reproduce cell names no command")
        targets = LINK.findall(record)
        if not targets:
            if NO_RECORD not in record:
                faults.append(f"{where}: no record linked, and the cell does not say "
                              f"'{NO_RECORD}'")
            elif claims:
                faults.append(f"{where}: bolds {claims} with no record to find them in")
            continue
        texts = []
        for target in targets:
            try:
                texts.append(record_text(doc, target))
            except AssertionError as exc:
                faults.append(f"{where}: {exc}")
        if not claims:
            faults.append(f"{where}: no bold headline number to check against its record")
        pool = numbers_in("\n".join(texts))
        missing = [c for c in claims if not found(c, pool)]
        if texts and missing:
            faults.append(f"{where}: {missing} not found in {', '.join(targets)}")
    return faults


@pytest.mark.parametrize("doc_name,heading", REQUIRED)
def test_required_tables_cite_records(doc_name, heading):
    found_here = [t for t in published(doc_name) if t["heading"] == heading]
    assert found_here, f"{doc_name}: no table with a record column under {heading!r}"


@pytest.mark.parametrize("doc_name", sorted({d for d, _ in REQUIRED}))
def test_numbers_match_their_records(doc_name):
    faults = [f for t in published(doc_name) for f in check_table(t)]
    assert not faults, "\n".join(faults)


def test_the_checker_catches_faults():
    """The mechanism itself: a wrong number, a missing record, a row without one."""
    fake = ROOT / "docs" / "_fake.md"  # never written: check_table only needs its location
    rec = "[r](../bench/results/small-card.md)"
    sec = "[r](../bench/results/replay-speed.md)"
    text = "\n".join([
        "| what | result | reproduce | record |",
        "| --- | --- | --- | --- |",
        f"| ok | **252.6** tok/s | `cmd` | {rec} |",
        f"| wrong | **253.1** tok/s | `cmd` | {rec} |",
        "| gone | **1.0** | `cmd` | [r](../bench/results/no-such-run.md) |",
        "| none | **7.0** | `cmd` | - |",
        "| said | 7.0 | `cmd` | no record in the repository |",
        f"| section | **5.84** s | `cmd` | {sec} |",
        f"| no command | **5.84** s | python x | {sec} |",
        "| folder | **5.84** s | `cmd` | [r](../bench/results/) |",
        "| journal | **5.84** s | `cmd` | [r](../bench/RESULTS.md#replay) |",
    ])
    (table,) = [t | {"doc": fake} for t in tables(text)]
    faults = check_table(table)
    lines = sorted(int(f.split(":")[1]) for f in faults)
    assert lines == [4, 5, 6, 9, 10, 11], faults
    assert found("252.6", {"252.62"}) and found("279.9", {"279.87"})
    assert not found("252.7", {"252.62"}) and not found("252.62", {"252.6"})
    assert found("43431", numbers_in("43,431 MiB"))


def test_readme_probe_link_example_is_its_record():
    """The README's probe-link excerpt prints the figures of the record it names."""
    import json

    text = (ROOT / "README.md").read_text()
    start = text.index("$ expertcache probe-link ")
    block = text[start:text.index("```", start)]
    match = re.search(r"saved as (bench/results/\S+\.json)", block)
    assert match, "the probe-link example names no saved record"
    rec = json.loads((ROOT / match.group(1).rstrip(")")).read_text())
    rates = {r["path"]: r for r in rec["rates"] + rec["gather"]}
    zero, gather8 = rates["zero_copy_read"], rates["gather_8"]
    decode = rec["decode"]
    for figure in (f"{zero['gbps']:.1f}", f"{zero['seconds'] * 1e6:.0f} us",
                   f"{zero['spread']:.1%}", f"{gather8['gbps']:.1f}",
                   f"{gather8['seconds'] * 1e6:.0f} us", f"{gather8['spread']:.1%}",
                   f"fully resident {decode['resident_tok_s']:.0f} tok/s",
                   f"no cache {decode['offload_tok_s']:.1f} tok/s",
                   f"at {decode['gather_gbps']:.1f} GB/s"):
        assert figure in block, f"README's probe-link example lacks {figure!r} from its record"


CITED = re.compile(r"bench/results/[\w./-]*[\w/]")
CITERS = ["README.md", "docs/*.md", "tests/*.py", "tests/device/*", "bench/*.py", "bench/*.sh",
          "bench/*/*.py", "bench/results/*.md", "expertcache_cli/**/*.py", "traces/README.md"]


def test_every_cited_record_exists():
    """A path under bench/results/ named anywhere a reader or a test would follow it (the
    README, the docs, the records, the tests, the bench scripts, the code's comments)
    exists, so deleting a record cannot leave a citation behind. Paths with a shell
    variable or a placeholder in them are a runner's output folder, not a citation, and
    are left alone."""
    missing = []
    for pattern in CITERS:
        for path in sorted(ROOT.glob(pattern)):
            if path.name == Path(__file__).name or not path.is_file():
                continue
            for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for match in CITED.finditer(line):
                    cited, after = match.group(), line[match.end():match.end() + 1]
                    if cited.rstrip("/") == "bench/results" or after in ("$", "{", "<", "*"):
                        continue
                    if not (ROOT / cited).exists():
                        missing.append(f"{path.relative_to(ROOT)}:{line_no}: {cited}")
    assert not missing, "cited records that do not exist:\n" + "\n".join(missing)


def test_every_markdown_record_says_when_where_and_how():
    """Each compact record names its date (in its name or opening lines), its machine's
    vLLM (or says it ran without one) in its opening lines, and carries the command that
    reproduces it."""
    faults = []
    for record in sorted(RESULTS.glob("*.md")):
        text = record.read_text()
        head = "\n".join(text.splitlines()[:6])
        if not re.search(r"20\d\d-\d\d-\d\d", record.name + head):
            faults.append(f"{record.name}: no date in its name or opening lines")
        if not re.search(r"vLLM|CPU only", head):
            faults.append(f"{record.name}: no vLLM version (or 'no vLLM') in its opening lines")
        if not re.search(r"bash bench/|python3? bench/|python3? -m |expertcache ", text):
            faults.append(f"{record.name}: no command that reproduces it")
    assert not faults, "\n".join(faults)


def test_every_results_row_says_what_routing_produced_it():
    """docs/results.md's record table has a ``routing`` column, filled on every row (a
    real model's trace, a synthetic trace, random-weight routers, or none): the cache's
    speed is the routing's as much as its own, so no number may leave it unsaid."""
    (table,) = [t for t in published("docs/results.md") if t["heading"] == "# Measured numbers"]
    assert "routing" in table["header"], "docs/results.md's record table has no routing column"
    col = table["header"].index("routing")
    empty = [line for line, cells in table["rows"]
             if len(cells) <= col or cells[col].strip() in ("", "-")]
    assert not empty, f"docs/results.md: rows that do not say their routing, lines {empty}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def test_every_section_link_in_the_docs_lands_on_a_heading():
    """A link to a section (``page.md#anchor``) in the README or the docs names a heading
    that exists, so renaming a section of docs/results.md or the design cannot strand a
    reference to it."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line_no, line in enumerate(unfenced(doc.read_text()), 1):
            for target in LINK.findall(line):
                page, _, anchor = target.partition("#")
                if not anchor or "://" in page or not (page == "" or page.endswith(".md")):
                    continue
                path = doc if page == "" else (doc.parent / page).resolve()
                if not path.is_file():
                    broken.append(f"{doc.relative_to(ROOT)}:{line_no}: {target} (no such page)")
                    continue
                heads = {_slug(h) for h in unfenced(path.read_text()) if h.startswith("#")}
                if anchor not in heads:
                    broken.append(f"{doc.relative_to(ROOT)}:{line_no}: {target}")
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


def test_readme_opening_numbers_are_in_the_records():
    """The README's opening (its title and first section, "What it is") quotes the headline
    runs in prose, where no table's record column checks them: every figure with a decimal
    point there must be in some record under bench/results/ (as written, or a more precise
    figure rounding to it), so the first numbers a user reads say no more than a record."""
    text = (ROOT / "README.md").read_text()
    lines = unfenced(text)
    sections = [i for i, line in enumerate(lines) if line.startswith("## ")]
    opening = THOUSANDS.sub("", "\n".join(lines[:sections[1]]))
    claims = [n for n in NUMBER.findall(opening) if "." in n]
    assert claims, "the README's opening quotes no measured figure"
    pool = numbers_in("\n".join(p.read_text(errors="replace")
                                for p in sorted(RESULTS.glob("*.md"))))
    missing = [c for c in claims if not found(c, pool)]
    assert not missing, f"README opening: {missing} in no record under bench/results/"
