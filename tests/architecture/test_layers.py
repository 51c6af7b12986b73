"""The package's layers point one way: trillion.errors / trillion.devices <- kernels <- models <-
parallel <- trainer. Read from the source (AST), so a lazy import inside a function counts too."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"trillion": 0, "kernels": 1, "models": 2, "parallel": 3, "trainer": 4}  # folder -> layer
LAYER_OF_PACKAGE = {"kernels": 1, "models": 2, "parallel": 3, "trainer": 4}
ENTRY_POINTS = {"trillion/__main__.py"}  # `python -m trillion` sits above every layer


def layer_of_module(name: str) -> int | None:
    """The layer of an imported `trillion...` module, None for anything outside the package."""
    parts = name.split(".")
    if parts[0] != "trillion":
        return None
    return LAYER_OF_PACKAGE.get(parts[1], 0) if len(parts) > 1 else 0


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def upward_edges() -> list[str]:
    edges = []
    for folder, layer in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if str(path.relative_to(ROOT)) in ENTRY_POINTS:
                continue
            for line, module in imported_modules(path):
                if module.split(".")[0] in LAYER_OF_PACKAGE:
                    edges.append(f"{path.relative_to(ROOT)}:{line} imports {module} outside the trillion namespace")
                target = layer_of_module(module)
                if target is not None and target > layer:
                    edges.append(f"{path.relative_to(ROOT)}:{line} imports {module} (layer {target} > {layer})")
    return edges


def test_no_module_imports_a_higher_layer():
    assert upward_edges() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The walk must notice a planted upward edge, or the test above proves nothing.
    fake_root = tmp_path
    for folder in FOLDERS:
        (fake_root / folder).mkdir()
    (fake_root / "models" / "bad.py").write_text("def f():\n    from trillion.trainer.config.schema import Config\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake_root)
    assert upward_edges() == ["models/bad.py:2 imports trillion.trainer.config.schema (layer 4 > 2)"]


def test_trillion_is_the_only_installed_top_level_name(tmp_path):
    # Build the wheel a user installs and read its file list (RECORD): every file sits under
    # trillion/ or the distribution's metadata, so no `trainer` or `kernels` lands in site-packages.
    # Built from a copy, so setuptools' build/ folder never lands in the checkout.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", "outputs", "wandb", "tests", "experiments"
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("trillion-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist()}
        top_level_txt = [n for n in archive.namelist() if n.endswith("top_level.txt")]
        assert not top_level_txt or archive.read(top_level_txt[0]).decode().split() == ["trillion"]
        installed = archive.namelist()
    assert {t for t in top if not t.endswith(".dist-info")} == {"trillion"}, top
    for module in (
        "trillion/__main__.py",
        "trillion/kernels/flash_attention_op.py",
        "trillion/trainer/tools/estimate/dry_run.py",
        "trillion/parallel/planner/hardware_profiles/frontier.toml",
        "trillion/devices.toml",
    ):
        assert module in installed
