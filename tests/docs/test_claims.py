"""Claims stay tested: every section of every guide ends by naming the tests that prove it (`*Tested by*` and test
files in backquotes); each named file exists and at least one of them runs in the default suite (not marked slow or
gpu). index.md (the map of the guides), contributing.md (working habits) and ARCHITECTURE.md (kept true by
tests/architecture/) make no claims of their own; a page's introduction, under its title, says what the page covers."""

import ast
from pathlib import Path

from tests.helpers.documentation import DOCS, ROOT, sections

WITHOUT_CLAIMS = {"index.md", "contributing.md", "ARCHITECTURE.md"}
NOT_DEFAULT = ("slow", "gpu")  # pytest marks the default command leaves out (-m 'not slow'; gpu skips without one)


def _marked(decorators) -> bool:
    return any(mark in ast.unparse(d) for d in decorators for mark in (f"mark.{m}" for m in NOT_DEFAULT))


def runs_by_default(path: Path) -> bool:
    """Whether the test file has a test the default command runs: a test function not marked slow or gpu, in a
    module not marked so as a whole."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if any(f"mark.{m}" in ast.unparse(node.value) for m in NOT_DEFAULT):
                return False
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test")
        and not _marked(node.decorator_list)
        for node in ast.walk(tree)
    )


def claim_problems(root: Path, guide: Path) -> list[str]:
    problems = []
    for section in sections(guide.read_text())[2:]:  # after the text before the title and the title's introduction
        where = f"{guide.name}:{section.line} ({section.heading})"
        if not section.has_prose:
            continue
        named = section.tests
        if not named:
            problems.append(f"{where} names no test (end it with a line '*Tested by* `tests/...py`')")
        missing = [name for name in named if not (root / name).is_file()]
        problems += [f"{where} names {name}, which does not exist" for name in missing]
        present = [name for name in named if name not in missing]
        if present and not any(runs_by_default(root / name) for name in present):
            problems.append(f"{where}: none of {', '.join(present)} runs in the default suite")
    return problems


def test_every_guide_section_names_tests_that_run_by_default():
    guides = [path for path in sorted(DOCS.glob("*.md")) if path.name not in WITHOUT_CLAIMS]
    assert len(guides) >= 13
    assert [problem for guide in guides for problem in claim_problems(ROOT, guide)] == []


def test_the_claims_check_sees_an_unnamed_a_missing_and_a_slow_only_test(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_fast.py").write_text("def test_fast():\n    assert True\n")
    (tmp_path / "tests/test_slow.py").write_text(
        "import pytest\n\n\n@pytest.mark.slow\ndef test_slow():\n    assert True\n"
    )
    (tmp_path / "tests/test_module_slow.py").write_text(
        "import pytest\n\npytestmark = pytest.mark.slow\n\n\ndef test_a():\n    assert True\n"
    )
    guide = tmp_path / "guide.md"
    guide.write_text(
        "# Guide\n\nWhat it covers.\n\n"
        "## Proven\n\nA claim.\n\n*Tested by* `tests/test_slow.py`, `tests/test_fast.py`\n\n"
        "## Unproven\n\nA claim.\n\n"
        "## Misnamed\n\nA claim.\n\n*Tested by* `tests/test_gone.py`\n\n"
        "## Slow only\n\nA claim.\n\n*Tested by* `tests/test_slow.py`, `tests/test_module_slow.py`\n\n"
        "## Code is not a heading\n\n```bash\n# a comment\n```\n\n*Tested by* `tests/test_fast.py`\n"
    )
    assert claim_problems(tmp_path, guide) == [
        "guide.md:11 (Unproven) names no test (end it with a line '*Tested by* `tests/...py`')",
        "guide.md:15 (Misnamed) names tests/test_gone.py, which does not exist",
        "guide.md:21 (Slow only): none of tests/test_slow.py, tests/test_module_slow.py runs in the default suite",
    ]
