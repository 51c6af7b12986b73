import os
import re
import sys
from pathlib import Path

# Triton decides between compiling and interpreting when a kernel is defined, and any test module
# that imports the trainer defines them: so the switch is set here, before the first import. On CPU
# every Triton kernel runs under the interpreter; tests of the fallback set it to 0 themselves.
# `pytest -m gpu` (tests/gpu/) runs the kernels natively instead, so there the switch stays off.
_INTERPRET_SET_HERE = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

# No test may reach the network: W&B writes offline runs, the hub is never asked.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# This repository's packages are imported as `trillion.*` only (pyproject.toml's package-dir); their folders sit at
# its root, which `python -m pytest` and pytest's rootdir insertion put on sys.path, where `import kernels` would find
# kernels/ instead of Hugging Face's `kernels` distribution (which transformers 5.25 and later import). The root's
# path-entry finder below finds what lives there (tests, experiments) but not those folders, so a third-party package
# of the same name wins and none shadows it, whatever sys.path holds (tests/test_import_names.py proves it).
REPOSITORY = Path(__file__).resolve().parents[1]
OWN_FOLDERS = frozenset({"kernels", "models", "parallel", "trainer"})


class _RootEntryFinder:
    """The repository root's path-entry finder, blind to OWN_FOLDERS."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, fullname, target=None):
        if fullname.partition(".")[0] in OWN_FOLDERS:
            return None
        return self.inner.find_spec(fullname, target)

    def invalidate_caches(self):
        self.inner.invalidate_caches()

    def iter_modules(self, prefix=""):  # pkgutil's listing of the root, without OWN_FOLDERS
        import pkgutil

        yield from (m for m in pkgutil.iter_importer_modules(self.inner, prefix) if m[0] not in OWN_FOLDERS)


def _is_repository(entry) -> bool:
    try:
        return isinstance(entry, str) and Path(entry or ".").resolve() == REPOSITORY
    except OSError:
        return False


def _repository_entry(entry):
    """A path hook: the repository root's finder, built by the next hook and wrapped; ImportError for other entries."""
    if not _is_repository(entry):
        raise ImportError(f"not the repository root: {entry!r}")
    for hook in sys.path_hooks:
        if hook is not _repository_entry:
            try:
                return _RootEntryFinder(hook(entry))
            except ImportError:
                continue
    raise ImportError(f"no finder for {entry!r}")


if _repository_entry not in sys.path_hooks:
    sys.path_hooks.insert(0, _repository_entry)
    for _entry in [e for e in sys.path_importer_cache if _is_repository(e)]:
        del sys.path_importer_cache[_entry]  # rebuilt through the hook above on the next import


def pytest_configure(config):
    # Runs before any test module is imported, hence before any kernel is defined.
    if _INTERPRET_SET_HERE and re.search(r"(?<!not )\bgpu\b", config.getoption("markexpr") or ""):
        del os.environ["TRITON_INTERPRET"]
