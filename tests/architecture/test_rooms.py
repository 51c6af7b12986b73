"""Every concern has one room: no source file over the house's 400 lines, no two files importing each other
(directly or round a longer circle, lazy imports and modules named in strings included: source_graph.py), and
the model families' names branched on only where those parts live (models/, and the modules that implement a
part for another layer, listed in PART_MODULES with the part they implement).

Each check is run once on a planted tree that breaks it, so a walk that sees nothing cannot pass."""

import ast
import re
from pathlib import Path

from tests.architecture.source_graph import imports_of, module_file

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
PACKAGE_FOLDERS = ("trillion", "kernels", "models", "parallel", "trainer")
SOURCE_FOLDERS = (*PACKAGE_FOLDERS, "experiments")
SKIPPED_FOLDERS = {"__pycache__", "build", "outputs", "wandb", "results"}

# A family or part name in a branch: `if args.moe`, `x if cfg.mla else y`, `isinstance(f, MoE)`. Expert
# parallelism is a layout (its mesh, `ep`), not a family: "expert" alone is no family name.
FAMILY_NAME = re.compile(r"moe|mla|mtp|deepseek", re.IGNORECASE)
# The layers that must read parts through their declarations (models/ declares them).
DECLARATION_READERS = ("parallel", "trainer")
# file -> the part it implements for its layer, where naming the part is its business.
PART_MODULES = {
    "parallel/expert_parallel.py": "routed experts: their all-to-all dispatch over the ep mesh",
    "parallel/planner/moe.py": "routed experts: their routing, dispatch and imbalance costs",
}


def source_files(root: Path, folders=SOURCE_FOLDERS) -> list[Path]:
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            inside = path.relative_to(root).parts[:-1]
            if not any(part in SKIPPED_FOLDERS or part.startswith(".") for part in inside):
                found.append(path)
    return found


def oversize_files(root: Path) -> list[str]:
    sizes = ((path, len(path.read_text().splitlines())) for path in source_files(root))
    return [f"{path.relative_to(root)}: {n} lines" for path, n in sizes if n > MAX_FILE_LINES]


def file_circles(root: Path) -> list[list[str]]:
    """Circles in the graph of the package's files, each as the path of files that closes it. An import of a
    package counts as an import of its __init__.py; importing a module does not count as importing its
    package's __init__ (Python runs it first, but that is no edge a file chose)."""
    graph: dict[str, set[str]] = {}
    for path in source_files(root, PACKAGE_FOLDERS):
        source = str(path.relative_to(root))
        for found in imports_of(root, path):
            target = module_file(root, found.module)
            if target is not None and target != path:
                graph.setdefault(source, set()).add(str(target.relative_to(root)))
    found, done = [], set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            circle = trail[trail.index(node) :] + [node]
            found.append(circle)
            return
        if node in done:
            return
        for target in sorted(graph.get(node, ())):
            visit(target, trail + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def part_classes(root: Path) -> set[str]:
    """The classes models/ defines (the parts and their modules): what an isinstance elsewhere would branch on."""
    names = set()
    for path in source_files(root, ("models",)):
        names |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    return names


def _names(node: ast.AST) -> list[str]:
    return [
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute | ast.Name)
    ]


def _root(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _class_refs(node: ast.AST) -> list[str]:
    """The classes an isinstance's second argument names; torch's own (nn.Linear, torch.nn.Module) are not the
    models' classes, whatever a part's declaration calls itself."""
    return [
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(node)
        if isinstance(n, ast.Name) or (isinstance(n, ast.Attribute) and _root(n) not in ("nn", "torch"))
    ]


def _tests(tree: ast.AST):
    """Every expression a branch decides on, with its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs
        elif isinstance(node, ast.match_case) and node.guard is not None:
            yield node.guard


def family_branches(root: Path) -> list[str]:
    classes = part_classes(root)
    problems = []
    for path in source_files(root, DECLARATION_READERS):
        where = str(path.relative_to(root))
        if where in PART_MODULES:
            continue
        if FAMILY_NAME.search(path.stem):
            problems.append(f"{where}: a file named after a model family or part outside models/")
        tree = ast.parse(path.read_text())
        for test in _tests(tree):
            hits = sorted({name for name in _names(test) if FAMILY_NAME.search(name)})
            if hits:
                problems.append(f"{where}:{test.lineno} branches on {', '.join(hits)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                hits = sorted(set(_class_refs(node.args[1])) & classes) if len(node.args) == 2 else []
                if hits:
                    problems.append(f"{where}:{node.lineno} isinstance of the part class {', '.join(hits)}")
    return problems


def test_no_source_file_is_over_400_lines():
    assert oversize_files(ROOT) == []


def test_no_files_import_each_other_in_a_circle():
    assert file_circles(ROOT) == []


def test_family_names_are_branched_on_only_where_the_parts_live():
    assert family_branches(ROOT) == []


def test_every_part_module_exists():
    # An entry cannot outlive its file (it would exempt a file that comes back under that name).
    assert [name for name in PART_MODULES if not (ROOT / name).is_file()] == []


def plant(root: Path, files: dict[str, str]) -> Path:
    for folder in PACKAGE_FOLDERS:
        (root / folder).mkdir(exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checks_see_what_they_forbid(tmp_path):
    root = plant(
        tmp_path,
        {
            "models/__init__.py": "",
            "models/moe.py": "class MoE: ...\n",
            "models/spec.py": "class Linear: ...\n",
            "models/a.py": "def f():\n    from trillion.models import b\n",  # a lazy import closes the circle
            "models/b.py": "import trillion.models.a\n",
            "parallel/__init__.py": "",
            "parallel/deepseek.py": "",
            "parallel/tp.py": (
                "def plan(block, args):\n"
                "    if args.moe is not None:\n"
                "        return 1\n"
                "    return [isinstance(m, (int, MoE)) for m in block]\n"
                "\n"
                "def torch_linears(model):\n"
                "    return [m for m in model.modules() if isinstance(m, nn.Linear | torch.nn.Linear)]\n"
            ),
            "parallel/expert_parallel.py": "def f(args):\n    return args.moe if args.moe else None\n",
            "experiments/long.py": "x = 1\n" * (MAX_FILE_LINES + 1),
        },
    )
    assert oversize_files(root) == [f"experiments/long.py: {MAX_FILE_LINES + 1} lines"]
    assert file_circles(root) == [["models/a.py", "models/b.py", "models/a.py"]]
    assert family_branches(root) == [
        "parallel/deepseek.py: a file named after a model family or part outside models/",
        "parallel/tp.py:2 branches on moe",
        "parallel/tp.py:4 isinstance of the part class MoE",
    ]
