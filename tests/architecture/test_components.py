"""Inside the trainer: its components (the subpackages of trainer/) and the modules of its top level
import one another only as the table below allows, and nothing imports in a circle. Read from the
source (tests/architecture/source_graph.py): imports inside functions and modules named in strings count.

Also: trainer/'s top level stays small, and every subpackage says what lives there in two lines."""

import ast
from pathlib import Path

import pytest

from tests.architecture.source_graph import imports_of, module_name

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "trillion.trainer"
MAX_TOP_LEVEL_MODULES = 9  # trainer/*.py, __init__.py included

# The program: the loop, its set-up and what they are assembled from, trainer/'s top level; each module is a node.
PROGRAM = {"__init__", "train", "set_up", "step", "assemble", "optim", "evaluate", "resilience", "preflight"}
# The components below the program: it may import any of them.
BELOW_PROGRAM = {"config", "launch", "data", "metrics", "checkpoint", "fault_tolerance"}
# node -> what it may import besides itself: a component (trainer/<name>/), a top-level module
# (trainer/<name>.py), or one module of a component ("cli.args"). A new component or top-level
# module must be added here.
MAY_IMPORT = {
    "config": set(),  # every component may import config; it imports no other
    "launch": {"config"},
    "data": {"config"},
    "metrics": {"config"},
    # checkpoint/manager.py records the corpus fingerprint (data); checkpoint/export.py builds the
    # model a checkpoint was saved with from its config (assemble.build_model_args), which the
    # no-cycle test below keeps sound: assemble must never reach checkpoint.
    "checkpoint": {"config", "data", "assemble"},
    # fault-tolerant replica groups: what a restarted group copies live is the checkpoint's training state
    "fault_tolerance": {"config", "checkpoint"},
    **{name: BELOW_PROGRAM | PROGRAM for name in PROGRAM},
    # the tools run the program's code; of the command line only its one argument parser
    "tools": BELOW_PROGRAM | PROGRAM | {"cli.args"},
    "cli": BELOW_PROGRAM | PROGRAM | {"tools"},
}


def node_of(module: str) -> tuple[str, str] | None:
    """(node, the module's path inside the trainer) of a `trillion.trainer...` module, None outside:
    trillion.trainer.data.loader -> ("data", "data.loader"), trillion.trainer -> ("__init__", "__init__")."""
    if module != TRAINER and not module.startswith(TRAINER + "."):
        return None
    inside = module[len(TRAINER) + 1 :] or "__init__"
    return inside.split(".")[0], inside


def allowed(source: str, inside: str) -> bool:
    return any(inside == grant or inside.startswith(grant + ".") for grant in MAY_IMPORT[source])


# Modules granted on their own ("cli.args") are nodes of their own in the search for circles: tools
# imports cli.args, cli.main imports tools, and that is no circle while cli.args imports neither.
SINGLE_MODULES = sorted({grant for grants in MAY_IMPORT.values() for grant in grants if "." in grant})


def circle_node(inside: str) -> str:
    return next((m for m in SINGLE_MODULES if inside == m or inside.startswith(m + ".")), inside.split(".")[0])


def trainer_edges(root: Path) -> list[tuple[str, str, str]]:
    """(where, importer, imported) of every import in the trainer, the two modules as paths inside it."""
    edges = []
    for path in sorted((root / "trainer").rglob("*.py")):
        _, source = node_of(module_name(root, path))
        for found in imports_of(root, path):
            if (target := node_of(found.module)) is not None:
                edges.append((f"{path.relative_to(root)}:{found.line} {found.how} {found.module}", source, target[1]))
    return edges


def forbidden_edges(root: Path) -> list[str]:
    problems = []
    nodes = {node_of(module_name(root, path))[0] for path in (root / "trainer").rglob("*.py")}
    for node in sorted(nodes - set(MAY_IMPORT)):
        problems.append(f"trainer/{node} is not in the layering table (MAY_IMPORT, {Path(__file__).name})")
    for where, source, target in trainer_edges(root):
        node, other = source.split(".")[0], target.split(".")[0]
        if other != node and node in MAY_IMPORT and not allowed(node, target):
            problems.append(f"{where}: {node} may not import {other}")
    return problems


def cycles(root: Path) -> list[list[str]]:
    """The circles in the graph of nodes, each as the path that closes it."""
    graph: dict[str, set[str]] = {}
    for _, source, target in trainer_edges(root):
        if circle_node(source) != circle_node(target):
            graph.setdefault(circle_node(source), set()).add(circle_node(target))
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node) :] + [node])
            return
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_components_import_only_what_the_table_allows():
    assert forbidden_edges(ROOT) == []


def test_no_component_imports_in_a_circle():
    assert cycles(ROOT) == []


def test_the_table_is_the_trainer():
    # Every node of the table exists, so an entry cannot outlive its component.
    nodes = {node_of(module_name(ROOT, path))[0] for path in (ROOT / "trainer").rglob("*.py")}
    assert set(MAY_IMPORT) == nodes


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


LEGAL_TREE = {
    "trainer/__init__.py": '"""The program.\nIts components."""\n',
    "trainer/train.py": "from trillion.trainer.checkpoint import manager\nfrom trillion.trainer.data import loader\n",
    "trainer/assemble.py": "from trillion.trainer.config.schema import Config\n",
    "trainer/config/__init__.py": '"""Config.\nImports nothing."""\n',
    "trainer/config/schema.py": "class Config: ...\n",
    "trainer/data/__init__.py": '"""Data.\nIts loader."""\n',
    "trainer/data/loader.py": "from trillion.trainer.config import schema\n",
    "trainer/checkpoint/__init__.py": '"""Checkpoints.\nTheir manager."""\n',
    "trainer/checkpoint/manager.py": "def f():\n    from trillion.trainer.assemble import Config\n",
    "trainer/cli/__init__.py": '"""The command line.\nIts parser."""\n',
    "trainer/cli/args.py": "",
    "trainer/cli/main.py": "",
    "trainer/tools/__init__.py": '"""Tools.\nThe tune command."""\n',
    "trainer/tools/tune.py": "from trillion.trainer.cli import args\nimport trillion.trainer.train\n",
}


def test_a_legal_tree_passes(tmp_path):
    root = plant(tmp_path, LEGAL_TREE)
    assert forbidden_edges(root) == [] and cycles(root) == [] and top_level_problems(root) == []


def test_the_check_sees_a_forbidden_import(tmp_path):
    # The walk must notice a planted forbidden edge, or the test above proves nothing: an import
    # inside a function, a module named in a string (one from a variable, one patched), not a docstring.
    root = plant(
        tmp_path,
        {
            **LEGAL_TREE,
            "trainer/data/x.py": (
                '"""Read by trillion.trainer.checkpoint.manager: prose, not an import."""\n'
                "import importlib\n"
                "def f():\n"
                "    from trillion.trainer.metrics import meters\n"
                '    return importlib.import_module("trillion.trainer.checkpoint")\n'
                'TARGET = "trillion.trainer.checkpoint.manager.f"\n'
            ),
            "trainer/tools/plan.py": "from trillion.trainer.cli.main import main\n",
        },
    )
    assert forbidden_edges(root) == [
        "trainer/data/x.py:4 imports trillion.trainer.metrics: data may not import metrics",
        "trainer/data/x.py:5 names 'trillion.trainer.checkpoint', so imports trillion.trainer.checkpoint: "
        "data may not import checkpoint",
        "trainer/data/x.py:6 names 'trillion.trainer.checkpoint.manager.f', so imports "
        "trillion.trainer.checkpoint.manager: data may not import checkpoint",
        "trainer/tools/plan.py:1 imports trillion.trainer.cli.main: tools may not import cli",
    ]


def test_the_check_sees_a_circle(tmp_path):
    # assemble may import checkpoint and checkpoint may import assemble, but not both ways round;
    # nor may cli.args, which tools imports, import cli.main, which imports tools.
    root = plant(
        tmp_path,
        {
            **LEGAL_TREE,
            "trainer/assemble.py": "import trillion.trainer.checkpoint.manager\n",
            "trainer/cli/main.py": "def main():\n    from trillion.trainer.tools import tune\n",
        },
    )
    assert forbidden_edges(root) == [] and cycles(root) == [["assemble", "checkpoint", "assemble"]]
    plant(tmp_path, {"trainer/cli/args.py": "from trillion.trainer.cli import main\n"})
    assert cycles(root) == [["assemble", "checkpoint", "assemble"], ["cli", "tools", "cli.args", "cli"]]


def test_the_check_sees_a_component_missing_from_the_table(tmp_path):
    root = plant(tmp_path, {**LEGAL_TREE, "trainer/serving/__init__.py": '"""Serving.\nA new component."""\n'})
    assert forbidden_edges(root) == [
        f"trainer/serving is not in the layering table (MAY_IMPORT, {Path(__file__).name})"
    ]


def top_level_problems(root: Path) -> list[str]:
    problems = []
    modules = sorted(path.name for path in (root / "trainer").glob("*.py"))
    if len(modules) > MAX_TOP_LEVEL_MODULES:
        problems.append(f"trainer/ holds {len(modules)} modules (at most {MAX_TOP_LEVEL_MODULES}): {modules}")
    for folder in sorted({path.parent for path in (root / "trainer").rglob("*.py")}):
        init = folder / "__init__.py"
        where = init.relative_to(root)
        if not init.is_file():
            problems.append(f"{where} is missing: every folder of trainer/ is a package")
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        lines = doc.splitlines() if doc else []
        if len(lines) != 2 or not all(line.strip() for line in lines):
            problems.append(f"{where}: its docstring says what lives there in 2 lines, not {len(lines)}")
    return problems


def test_the_top_level_is_small_and_every_package_says_what_it_holds():
    assert top_level_problems(ROOT) == []


def test_the_top_level_check_sees_its_faults(tmp_path):
    extra = {f"trainer/m{i}.py": "" for i in range(7)}  # 3 in LEGAL_TREE, 10 in all
    root = plant(
        tmp_path,
        {
            **LEGAL_TREE,
            **extra,
            "trainer/data/__init__.py": '"""Data, in one line."""\n',
            "trainer/cli/__init__.py": "",
            "trainer/tools/estimate/cli.py": "",
        },
    )
    modules = sorted(["__init__.py", "assemble.py", "train.py", *(f"m{i}.py" for i in range(7))])
    assert top_level_problems(root) == [
        f"trainer/ holds 10 modules (at most {MAX_TOP_LEVEL_MODULES}): {modules}",
        "trainer/cli/__init__.py: its docstring says what lives there in 2 lines, not 0",
        "trainer/data/__init__.py: its docstring says what lives there in 2 lines, not 1",
        "trainer/tools/estimate/__init__.py is missing: every folder of trainer/ is a package",
    ]


def test_every_package_of_the_trainer_is_installed():
    # A subpackage missing from [tool.setuptools] packages would be left out of the wheel.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {module_name(ROOT, path.parent / "__init__.py") for path in (ROOT / "trainer").rglob("*.py")}
    assert folders <= packages, sorted(folders - packages)
