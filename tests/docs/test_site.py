"""The documentation site: `mkdocs build --strict` over docs/ (no broken link or anchor, no page left out of the
navigation), its navigation the guide list, and the README's links, which GitHub shows as plain Markdown, resolving
to files and headings that exist."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers.documentation import DOCS, README, ROOT, sections

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed: pip install -e '.[docs]' (the test extra has them)",
)
# The guides a user looks for, in the site's order: (title in the navigation, file in docs/).
GUIDES = [
    ("Home", "index.md"),
    ("Getting started", "getting-started.md"),
    ("Configuration", "configuration.md"),
    ("Data", "data.md"),
    ("Models", "models.md"),
    ("Parallelism", "parallelism.md"),
    ("Low precision", "low-precision.md"),
    ("Optimizers", "optimizers.md"),
    ("Checkpoints and fault tolerance", "checkpoints.md"),
    ("Evaluation and generation", "evaluation.md"),
    ("Planning and dry runs", "planning.md"),
    ("Kernels", "kernels.md"),
    ("Benchmarks and results", "benchmarks.md"),
    ("Troubleshooting", "troubleshooting.md"),
    ("Working on Trillion", "contributing.md"),
    ("Architecture", "ARCHITECTURE.md"),
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def build(config, site):
    """`mkdocs build --strict` of `config` into `site`: (exit status, its output)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, printed every build
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    return result.returncode, result.stdout + result.stderr


@needs_mkdocs
def test_the_site_builds_strict(tmp_path):
    status, output = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert status == 0, output
    assert all(
        (tmp_path / "site" / (name.removesuffix(".md").replace("index", "") + "/")).is_dir() for _, name in GUIDES
    )


@needs_mkdocs
def test_the_strict_build_refuses_a_broken_link_and_a_page_out_of_the_navigation(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "docs" / "orphan.md").write_text("# Nobody links here\n")
    guide = tmp_path / "docs" / "getting-started.md"
    guide.write_text(guide.read_text() + "\nSee [the missing guide](missing.md).\n")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    status, output = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert status != 0
    assert "orphan.md" in output and "missing.md" in output, output


def navigation():
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may carry !!python tags in other projects; this one has none
        pass

    def flatten(entries):
        for entry in entries:
            ((title, target),) = entry.items()
            yield from flatten(target) if isinstance(target, list) else [(title, target)]

    return list(flatten(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]))


@needs_mkdocs
def test_the_navigation_is_the_guide_list_and_every_guide_exists():
    assert navigation() == GUIDES
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(name for _, name in GUIDES)


def anchor(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(path) -> list[str]:
    problems = []
    for target in LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            problems.append(f"{path.name} links {target}: no such file")
        elif fragment and linked.suffix == ".md":
            if fragment not in {anchor(s.heading) for s in sections(linked.read_text())}:
                problems.append(f"{path.name} links {target}: no such heading")
    return problems


def test_every_readme_link_resolves():
    assert broken_links(README) == []
    assert any("docs/getting-started.md" in target for target in LINK.findall(README.read_text()))


def test_the_link_check_sees_a_missing_file_and_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Plan your own cluster\n")
    page = tmp_path / "README.md"
    page.write_text("[a](docs/guide.md#plan-your-own-cluster) [b](docs/guide.md#nothing) [c](docs/gone.md)\n")
    assert broken_links(page) == [
        "README.md links docs/guide.md#nothing: no such heading",
        "README.md links docs/gone.md: no such file",
    ]
