"""One style for the whole tree, in the default suite: `ruff check` and `ruff format --check` pass,
as configured in pyproject.toml ([tool.ruff]; ruff is pinned in the `test` extra, since another
version may format differently). To fix: `ruff check --fix . && ruff format .`."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    if path := shutil.which("ruff"):
        return [path]
    pytest.fail("ruff is not installed: pip install -e '.[test]' installs the pinned version")


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_passes_on_the_whole_tree(command):
    result = subprocess.run([*ruff(), *command, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"ruff {' '.join(command)} failed:\n{result.stdout}{result.stderr}", pytrace=False)
