"""The documentation stays true to itself: the README is a short front door whose first two commands
are the ones CI runs, every figure in its results table is one BENCHMARKS.md states, and every
relative link in the README, BENCHMARKS.md and docs/ reaches a file and, where it names one, a heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
LINKED_DOCS = [README, BENCHMARKS, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
"""`[text](target)`, text possibly holding one level of brackets; images (`![...]`) are not links."""
CODE_SPAN = re.compile(r"`[^`]*`")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or a heading inside one is an example)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lower case, punctuation dropped
    (letters, digits, `_` and `-` stay), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(c for c in text if c.isalnum() or c in " _-")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`; a repeated heading gets `-1`, `-2`, ... as on GitHub."""
    counts: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6} (.+?)#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = counts.get(base, 0)
            out.add(f"{base}-{n}" if n else base)
            counts[base] = n + 1
    return out


def broken_links(path: Path) -> list[str]:
    """`path`'s relative links whose file, or whose heading in that file, does not exist."""
    broken = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def results_rows(readme: str) -> list[str]:
    """The data rows of the README's results table (between its `<!-- results -->` markers)."""
    body = readme[readme.index("<!-- results -->") : readme.index("<!-- /results -->")]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return rows[2:]  # header and separator


def unsupported(row: str, benchmarks: str) -> list[str]:
    """What a results row states that BENCHMARKS.md does not: a code span (commit, command) not found
    verbatim, or a number (outside code spans) that appears nowhere there as a number."""
    missing = [span for span in CODE_SPAN.findall(row) if span not in benchmarks]
    for number in NUMBER.findall(CODE_SPAN.sub(" ", row)):
        if not re.search(rf"(?<![\d.,]){re.escape(number)}(?!\d|[.,]\d)", benchmarks):
            missing.append(number)
    return missing


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) < 250
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if FENCE.match(line.strip()))
    end = next(i for i in range(start + 1, len(lines)) if FENCE.match(lines[i].strip()))
    commands = [c for c in (line.split("#")[0].strip() for line in lines[start + 1 : end]) if c]
    assert commands[:2] == ["make serve", "make test"], commands


def test_every_figure_of_the_results_table_is_in_benchmarks():
    benchmarks = BENCHMARKS.read_text()
    rows = results_rows(README.read_text())
    assert len(rows) >= 5, rows
    missing = {row.split("|")[1].strip(): unsupported(row, benchmarks) for row in rows}
    assert not any(missing.values()), {k: v for k, v in missing.items() if v}


def test_the_figure_check_catches_an_invented_figure():
    benchmarks = "| fp32 | **1.18** | `c0e2657` | 0.3.13 | 2026-11-27 |"
    assert unsupported("| x | 1.18 | `c0e2657` | 0.3.13 | 2026-11-27 |", benchmarks) == []
    assert unsupported("| x | 1.19 |", benchmarks) == ["1.19"]
    assert unsupported("| x | 1.1 |", benchmarks) == ["1.1"]  # a prefix of 1.18 is no figure of it
    assert unsupported("| x | 3.13 |", benchmarks) == ["3.13"]  # nor a tail of 0.3.13
    assert unsupported("| x | `c0e2658` |", benchmarks) == ["`c0e2658`"]


@pytest.mark.parametrize("path", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(path: Path):
    assert not broken_links(path)


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# A `code` heading (x, y)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#a-code-heading-x-y) [ok](b.md#twice-1) [gone](c.md) [bad](b.md#nope) [web](https://x.org/#y)\n"
        "```\n[in a fence](d.md)\n```\n"
    )
    assert broken_links(page) == ["a.md: c.md (no such file)", "a.md: b.md#nope (no such heading)"]


def repeated_paragraphs(path: Path) -> list[str]:
    """The start of each long paragraph (200 characters or more, outside code blocks) that `path`
    holds more than once: a section pasted twice, one copy of which goes stale."""
    paragraphs = "\n".join(prose_lines(path.read_text())).split("\n\n")
    seen: set[str] = set()
    repeated = []
    for p in (p.strip() for p in paragraphs):
        if len(p) >= 200:
            if p in seen:
                repeated.append(f"{path.relative_to(ROOT)}: {p[:80]!r}")
            seen.add(p)
    return repeated


@pytest.mark.parametrize("path", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_section_is_there_twice(path: Path):
    assert not repeated_paragraphs(path)


def test_the_repeat_check_catches_a_pasted_section(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    section = "## A\n\n" + "A long paragraph of figures. " * 10 + "\n\nshort\n"
    page = tmp_path / "a.md"
    page.write_text(section + "\n" + section)
    assert repeated_paragraphs(page) == [f"a.md: {section[6:86]!r}"]
    page.write_text(section)
    assert repeated_paragraphs(page) == []
