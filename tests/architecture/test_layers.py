"""The package's layers point one way: trillion.errors / trillion.devices <- kernels <- models <-
parallel <- trainer. Read from the source (AST), so a lazy import inside a function counts too, and
so does a module named in a string (`importlib.import_module("trillion.trainer...")`, see source_graph.py).

Inside parallel/ the analytic planner (parallel/planner/) sits beside the runtime, not under it: no runtime
module of parallel/ or trainer/, nor models/, imports it, but the few PLANNER_USERS lists with their reasons."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.architecture.source_graph import imports_of

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


def upward_edges(root: Path) -> list[str]:
    edges = []
    for folder, layer in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root)
            if str(where) in ENTRY_POINTS:
                continue
            for found in imports_of(root, path):
                if found.module.split(".")[0] in LAYER_OF_PACKAGE:
                    edges.append(f"{where}:{found.line} imports {found.module} outside the trillion namespace")
                target = layer_of_module(found.module)
                if target is not None and target > layer:
                    edges.append(f"{where}:{found.line} {found.how} {found.module} (layer {target} > {layer})")
    return edges


def test_no_module_imports_a_higher_layer():
    assert upward_edges(ROOT) == []


PLANNER = "trillion.parallel.planner"
# The modules (or folders) outside the planner that may import it, each with its reason; the list only shrinks.
PLANNER_USERS = {
    "trainer/tools/": "the planner's commands (`trillion plan`, `trillion tune`) and the dry run that checks its "
    "figures (`trillion estimate`)",
    "trainer/preflight.py": "the memory pre-flight refuses a layout by the planner's byte counts of its states, the "
    "counts `trillion estimate` checks against real shards, and a number format job.hardware's profile lacks",
    "trainer/resilience.py": "the checkpoint-interval advice is the planner's Young/Daly optimum (planner/goodput.py)",
    "trainer/config/run_sections.py": "the default of checkpoint.mtbf_hours_per_gpu is the planner's published MTBF "
    "(planner/goodput.py)",
}


def planner_imports(root: Path) -> list[str]:
    """Imports of the planner from models/, parallel/ and trainer/ outside the planner and PLANNER_USERS."""
    edges = []
    for folder in ("models", "parallel", "trainer"):
        for path in sorted((root / folder).rglob("*.py")):
            where = str(path.relative_to(root))
            if where.startswith(("parallel/planner/", *PLANNER_USERS)):
                continue
            for found in imports_of(root, path):
                if found.module == PLANNER or found.module.startswith(PLANNER + "."):
                    edges.append(f"{where}:{found.line} {found.how} {found.module}, the planner")
    return edges


def test_the_runtime_does_not_import_the_planner():
    assert planner_imports(ROOT) == []


def test_the_planner_check_sees_a_runtime_import(tmp_path):
    root = plant(
        tmp_path,
        {
            "parallel/layout.py": "from trillion.parallel.planner.moe import MOE_LOAD_IMBALANCE\n",
            "trainer/assemble.py": "def node(job):\n    from trillion.parallel.planner.hardware import load_profile\n",
            "models/parts/moe.py": 'COST = "trillion.parallel.planner.moe:expert_rows"\n',
            "parallel/planner/cost.py": "from trillion.parallel.planner.moe import expert_rows\n",
            "trainer/tools/plan_cli.py": "from trillion.parallel.planner.search import search\n",
            "trainer/preflight.py": "from trillion.parallel.planner.memory import states_bytes\n",
        },
    )
    assert planner_imports(root) == [
        "models/parts/moe.py:1 names 'trillion.parallel.planner.moe', so imports trillion.parallel.planner.moe, "
        "the planner",
        "parallel/layout.py:1 imports trillion.parallel.planner.moe, the planner",
        "trainer/assemble.py:2 imports trillion.parallel.planner.hardware, the planner",
    ]


def plant(root: Path, files: dict[str, str]) -> Path:
    for folder in FOLDERS:
        (root / folder).mkdir(exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_check_sees_an_upward_import(tmp_path):
    # The walk must notice a planted upward edge, or the test above proves nothing.
    root = plant(tmp_path, {"models/bad.py": "def f():\n    from trillion.trainer.config.schema import Config\n"})
    assert upward_edges(root) == ["models/bad.py:2 imports trillion.trainer.config.schema (layer 4 > 2)"]


def test_the_check_sees_a_module_named_in_a_string(tmp_path):
    # import_module, a "module:NAME" entry and a patched "module.attribute" all name a module (the
    # longest prefix with a file: models/hf.py is absent here); a docstring that mentions one does not.
    root = plant(
        tmp_path,
        {
            "trainer/__init__.py": "",
            "trainer/train.py": "def train(): ...\n",
            "models/__init__.py": "",
            "parallel/__init__.py": "",
            "parallel/mesh.py": "def build_mesh(): ...\n",
            "kernels/bad.py": (
                '"""Called by trillion.trainer.train, the layer above."""\n'
                "import importlib\n"
                "def f():\n"
                '    """Not trillion.models either."""\n'
                '    return importlib.import_module("trillion.trainer.train")\n'
                'ENTRY = "trillion.models.hf:to_hf_state_dict"\n'
                'PATCHED = ("trillion.parallel.mesh.build_mesh", "trillion.errors.ConfigError")\n'
            ),
        },
    )
    assert upward_edges(root) == [
        "kernels/bad.py:5 names 'trillion.trainer.train', so imports trillion.trainer.train (layer 4 > 1)",
        "kernels/bad.py:6 names 'trillion.models.hf', so imports trillion.models (layer 2 > 1)",
        "kernels/bad.py:7 names 'trillion.parallel.mesh.build_mesh', so imports trillion.parallel.mesh (layer 3 > 1)",
    ]


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
