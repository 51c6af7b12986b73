"""The documentation as the tests read it: the README and the guides in docs/ (built into a site by mkdocs.yml).

A measured figure is stated once, in the README or in a guide, and read back by the test that measures it, which
searches them all (`documentation_text`), so a sentence can move between them without its test noticing. The guides'
own markers are parsed here too: the `*Tested by*` line that ends each section (the tests that prove it) and the
`<!-- runnable -->` line before a shell block (a test runs it as written)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

HEADING = re.compile(r"^(#{1,6}) (.+)$")
TESTED_BY = re.compile(r"^\*Tested by\* (.+)$")
NAMED_TEST = re.compile(r"`(tests/[\w/.-]+\.py)`")
RUNNABLE = re.compile(r"^<!-- runnable(?:: (tests/[\w/.-]+\.py))? -->$")
FENCE = re.compile(r"^```(\w*)$")


def documentation_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def documentation_text(root: Path = ROOT) -> str:
    """The README and every guide, whitespace collapsed, for a test that reads back a sentence it measured."""
    return " ".join(" ".join(path.read_text().split()) for path in documentation_files(root))


@dataclass
class Section:
    """The text under one heading, up to the next heading of any level (code blocks are not headings)."""

    heading: str
    line: int
    text: list[str]

    @property
    def tests(self) -> list[str]:
        """The test files its `*Tested by*` lines name."""
        return [name for line in self.text if (m := TESTED_BY.match(line)) for name in NAMED_TEST.findall(m.group(1))]

    @property
    def has_prose(self) -> bool:
        return any(line.strip() for line in self.text)


def sections(text: str) -> list[Section]:
    found, fenced = [Section("(before the first heading)", 0, [])], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        heading = None if fenced else HEADING.match(line)
        if heading:
            found.append(Section(heading.group(2), number, []))
        else:
            found[-1].text.append(line)
    return found


@dataclass
class ShellBlock:
    """A shell block marked runnable: its commands (comments and blank lines dropped, continuations joined) and the
    test that runs it (None: the docs' own test runs it as written)."""

    path: Path
    line: int
    runner: str | None
    source: str

    @property
    def commands(self) -> list[str]:
        joined = re.sub(r"\\\n\s*", "", self.source)
        return [c for line in joined.splitlines() if (c := line.split(" #")[0].strip()) and not c.startswith("#")]


def runnable_blocks(path: Path) -> list[ShellBlock]:
    """The shell blocks of `path` whose line before the opening fence is a runnable marker."""
    lines, blocks = path.read_text().splitlines(), []
    for index, line in enumerate(lines):
        marker = RUNNABLE.match(line.strip())
        if not marker:
            continue
        fence = FENCE.match(lines[index + 1].strip()) if index + 1 < len(lines) else None
        if not fence or fence.group(1) not in ("bash", "sh", "shell"):
            raise ValueError(f"{path.name}:{index + 1}: a runnable marker must stand right before a ```bash block")
        end = next(i for i in range(index + 2, len(lines)) if lines[i].strip() == "```")
        blocks.append(ShellBlock(path, index + 1, marker.group(1), "\n".join(lines[index + 2 : end])))
    return blocks
