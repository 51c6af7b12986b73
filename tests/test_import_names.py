"""This repository's packages are importable as `trillion.*` only, whatever sys.path holds: the repository root on
it (as `python -m pytest` and pytest's rootdir insertion put it) does not make kernels/, models/, parallel/ or
trainer/ importable by their folder names, so a third-party package of such a name (Hugging Face's `kernels`, which
transformers 5.25 and later import) is the one found; `tests.*` and `trillion.*` stay importable (tests/conftest.py)."""

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "models", "parallel", "trainer")


def _origin(name: str) -> Path | None:
    """Where an import of top-level `name` would find it now (sys.path searched afresh, whatever is imported)."""
    spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
    return None if spec is None or spec.origin is None else Path(spec.origin).resolve()


def _module_origin(name: str) -> Path:
    return Path(importlib.util.find_spec(name).origin).resolve()


@pytest.fixture
def root_first():
    """sys.path with the repository root first, as `python -m pytest` starts; restored after."""
    saved = list(sys.path)
    sys.path.insert(0, str(REPOSITORY))
    importlib.invalidate_caches()
    yield
    sys.path[:] = saved
    importlib.invalidate_caches()


@pytest.mark.parametrize("name", FOLDERS)
def test_the_folders_are_not_importable_by_their_own_names(name, root_first):
    origin = _origin(name)
    assert origin is None or REPOSITORY not in origin.parents, origin  # absent, or another distribution's
    assert (REPOSITORY / name / "__init__.py").is_file()  # the folder is there: the finder, not its absence, decides
    assert _module_origin(f"trillion.{name}") == (REPOSITORY / name / "__init__.py").resolve()


def test_a_third_party_package_of_a_folder_s_name_wins_over_the_root(root_first, tmp_path):
    """A `kernels` package on sys.path right after the root (where site-packages comes) is the one `import kernels`
    finds, and the one imported."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text('WHOSE = "a third party"\n')
    sys.path.insert(sys.path.index(str(REPOSITORY)) + 1, str(tmp_path))
    importlib.invalidate_caches()
    saved = sys.modules.pop("kernels", None)
    try:
        assert _origin("kernels") == (tmp_path / "kernels" / "__init__.py").resolve()
        assert importlib.import_module("kernels").WHOSE == "a third party"
    finally:
        sys.modules.pop("kernels", None)
        if saved is not None:
            sys.modules["kernels"] = saved


def test_the_tests_package_stays_importable_from_the_root(root_first):
    assert _origin("tests") == (REPOSITORY / "tests" / "__init__.py").resolve()
    assert _module_origin("tests.helpers.flags") == (REPOSITORY / "tests" / "helpers" / "flags.py").resolve()
    assert importlib.import_module("tests.helpers.flags").TINY


def test_without_the_root_s_finder_the_folders_would_shadow_others(root_first, monkeypatch):
    """The check above can fail: with the ordinary finder for the root, `import kernels` finds kernels/."""
    from tests import conftest

    monkeypatch.setattr(sys, "path_hooks", [hook for hook in sys.path_hooks if hook is not conftest._repository_entry])
    monkeypatch.setattr(sys, "path_importer_cache", {})
    assert _origin("kernels") == (REPOSITORY / "kernels" / "__init__.py").resolve()
