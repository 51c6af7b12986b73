"""The README is the front door, short: at most 200 lines, the two commands as CI runs them, no dated figure (those
live in the guides, beside the script or test that measured them), a capability table whose rows each link a guide,
and a newcomer's path from its first screen to a launched two-process run and a plan of their own cluster in at most
three links, each step a block the docs' tests run."""

import re
from pathlib import Path

from tests.docs.test_site import GUIDES, LINK, anchor
from tests.helpers.documentation import README, runnable_blocks, sections

MAX_LINES = 200
FIRST_SCREEN = 40  # lines a terminal or GitHub shows before the reader scrolls
TRAIN = "pip install -e . && trillion train"
TEST = "pip install -e '.[test]' && python -m pytest -q"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
WITHOUT_ROW = {"index.md", "contributing.md", "ARCHITECTURE.md"}  # the map and the pages for contributors


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", text, flags=re.M | re.S)


def test_the_readme_is_short_and_keeps_the_two_commands():  # CI runs the second: tests/architecture/test_docs.py
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert [TRAIN + "\n", TEST + "\n"] == bash_blocks(text)[:2]
    assert DATE.findall(text) == [], "a dated figure belongs in the guide beside what measured it"


def test_every_row_of_the_capability_table_links_a_guide_and_every_guide_has_a_row():
    rows = [line for line in README.read_text().splitlines() if line.startswith("| ") and "](docs/" in line]
    linked = {target.partition("#")[0] for row in rows for target in LINK.findall(row)}
    assert all(LINK.search(row) for row in rows) and len(rows) >= 10
    assert {f"docs/{name}" for _, name in GUIDES if name not in WITHOUT_ROW} <= linked


def linked_pages(page: Path, fragment: str, text: str | None = None) -> list[tuple[Path, str]]:
    """The (page, heading anchor) pairs that the section `fragment` of `page` links (the whole page without one;
    `text` in place of the page's own)."""
    text = page.read_text() if text is None else text
    if fragment:
        text = "\n".join(line for s in sections(text) if anchor(s.heading) == fragment for line in s.text)
    found = []
    for target in LINK.findall(text):
        file, _, linked_fragment = target.partition("#")
        if file.endswith(".md") and not target.startswith(("http://", "https://")):
            found.append(((page.parent / file).resolve(), linked_fragment))
    return found


def runnable_commands(page: Path) -> list[str]:
    return [command for block in runnable_blocks(page) for command in block.commands]


def links_to(goal, readme: Path, max_links: int = 3) -> int | None:
    """The fewest links from the README's first screen to a page whose runnable blocks hold a command `goal` accepts
    (None: not within `max_links`)."""
    first_screen = "\n".join(readme.read_text().splitlines()[:FIRST_SCREEN])
    frontier, seen = linked_pages(readme, "", first_screen), set()
    for depth in range(1, max_links + 1):
        if any(goal(command) for page, _ in frontier for command in runnable_commands(page)):
            return depth
        seen |= {page for page, _ in frontier}
        frontier = [link for page, f in frontier for link in linked_pages(page, f) if link[0] not in seen]
    return None


def test_a_newcomer_reaches_two_processes_and_a_plan_of_their_cluster_within_three_links():
    two_processes = links_to(lambda c: c.startswith("torchrun --nproc-per-node 2 "), README)
    plan = links_to(lambda c: c.startswith("trillion plan ") and "--config-out" in c, README)
    assert two_processes is not None and two_processes <= 3
    assert plan is not None and plan <= 3


def test_the_path_check_counts_links_and_misses_a_page_too_far(tmp_path):
    (tmp_path / "docs").mkdir()
    run = "<!-- runnable -->\n```bash\ntorchrun --nproc-per-node 2 -m trillion train\n```\n"
    (tmp_path / "docs/a.md").write_text("# A\n\n[next](b.md#go)\n")
    (tmp_path / "docs/b.md").write_text("# B\n\n## Elsewhere\n\n[far](d.md)\n\n## Go\n\n[on](c.md)\n")
    (tmp_path / "docs/c.md").write_text("# C\n\n[end](d.md)\n")
    (tmp_path / "docs/d.md").write_text("# D\n\n" + run)
    (tmp_path / "README.md").write_text("# R\n\n[a](docs/a.md)\n")
    starts_torchrun = lambda c: c.startswith("torchrun")  # noqa: E731
    assert links_to(starts_torchrun, tmp_path / "README.md", max_links=4) == 4
    assert links_to(starts_torchrun, tmp_path / "README.md", max_links=3) is None
