"""experiments/bench/RESULTS.md is written by the scripts that measure it: each replaces its own section (from its
heading to the next `## `), or appends it the first time, and leaves the others as they are."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(heading: str, section: str, path: Path = RESULTS) -> None:
    """`section` (starting with `heading`) in place of the section under `heading`, else at the end."""
    text = path.read_text()
    if heading in text:
        start = text.index(heading)
        end = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + text[end + 1 :] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
