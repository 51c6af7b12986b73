"""The repository explains itself and stays true: every path the README, CONTRIBUTING.md and the guides in docs/ name
exists, no source file cites a design document outside the repository, and the pre-commit hook runs the
ruff version the test extra pins (another version formats differently, and tests/test_style.py would fail)."""

import ast
import re
from pathlib import Path

import tomllib

from tests.architecture.test_rooms import SOURCE_FOLDERS, source_files

ROOT = Path(__file__).resolve().parents[2]
# the README, CONTRIBUTING.md and every guide in docs/ (ARCHITECTURE.md among them)
DOCS = ("README.md", "CONTRIBUTING.md", *sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")))
TOP_FOLDERS = ("trillion", "kernels", "models", "parallel", "trainer", "experiments", "tests", "docs", ".ci")
# `models/parts.py`, `parallel/planner/`, `tests/architecture/test_rooms.py`: a path inside the repository,
# written in backquotes; a bare file name (`train.py`) is prose, resolved against the folder the text names.
NAMED_PATH = re.compile(r"`((?:" + "|".join(re.escape(f) for f in TOP_FOLDERS) + r")/[\w./-]*)`")
OUTSIDE_DESIGN = re.compile(r"DESIGN\.md|\.\./shared|shared/PAPER")


def named_paths(text: str) -> list[str]:
    return sorted(set(NAMED_PATH.findall(text)))


def missing_paths(root: Path, doc: str) -> list[str]:
    text = (root / doc).read_text()
    return [f"{doc} names {path}, which does not exist" for path in named_paths(text) if not (root / path).exists()]


def test_every_path_the_docs_name_exists():
    assert [problem for doc in DOCS for problem in missing_paths(ROOT, doc)] == []


def test_the_architecture_names_its_rooms():
    # A doc that names nothing would pass the test above; this one maps the tree.
    names = named_paths((ROOT / "docs/ARCHITECTURE.md").read_text())
    assert {f"{folder}/" for folder in ("kernels", "models", "parallel", "trainer")} <= {
        name if name.endswith("/") else name.split("/")[0] + "/" for name in names
    }
    assert len(names) >= 30


def test_the_check_sees_a_missing_path(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models/args.py").write_text("")
    (tmp_path / "doc.md").write_text("`models/args.py` and `models/gone.py`, not `README.md` or train.py.\n")
    assert missing_paths(tmp_path, "doc.md") == ["doc.md names models/gone.py, which does not exist"]


def test_no_source_cites_a_document_outside_the_repository():
    cited = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in source_files(ROOT, SOURCE_FOLDERS)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE_DESIGN.search(line)
    ]
    assert cited == []


def test_the_pre_commit_hook_runs_the_pinned_ruff():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pinned = next(pin.split("==")[1] for pin in pins if pin.startswith("ruff=="))
    hook = (ROOT / ".pre-commit-config.yaml").read_text()
    assert "astral-sh/ruff-pre-commit" in hook
    assert re.search(r"^\s*rev:\s*v?(\S+)\s*$", hook, re.MULTILINE).group(1) == pinned


def test_ci_runs_the_readmes_commands_in_a_fresh_venv():
    """.ci/run proves the README's test command as a new user runs it: in a virtual environment it makes
    itself, with the CPU torch first, then the README's line unchanged."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme.split("## The two commands")[1].split("\n## ")[0], re.S)
    test_line = next(line for block in blocks for line in block.splitlines() if "pytest" in line)
    commands = [line for line in ci.splitlines() if line and not line.startswith(("#", " "))]
    venv = next(i for i, line in enumerate(commands) if line.startswith("python3 -m venv "))
    activate = next(i for i, line in enumerate(commands) if line.startswith(". ") and "bin/activate" in line)
    torch = next(i for i, line in enumerate(commands) if "torch==" in line)
    assert venv < activate < torch < commands.index(test_line) == len(commands) - 1, commands


SET_UP = ("trainer/set_up.py", ("set_up", "_set_up_locked"))  # set_up calls _set_up_locked: one order


def set_up_calls(source: str, functions: tuple[str, ...]) -> list[str]:
    """The names the set-up functions call, in the order they call them, the second function's calls in place of
    the call to it (a call's arguments are evaluated before the call: they come first)."""
    bodies = {f.name: f for f in ast.walk(ast.parse(source)) if isinstance(f, ast.FunctionDef) and f.name in functions}
    calls = []

    def walk(function: ast.FunctionDef) -> None:
        found = [n for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        for call in sorted(found, key=lambda n: (n.end_lineno, n.end_col_offset)):
            if call.func.id in bodies:
                walk(bodies[call.func.id])
            else:
                calls.append(call.func.id)

    walk(bodies[functions[0]])
    return calls


def documented_order(text: str, called: list[str]) -> list[str]:
    """The called names the numbered list of "The flow of a run" names in backquotes, in the order it names them."""
    flow = text[text.index("## The flow of a run") :]
    flow = flow[: flow.index("\n## ", 1)]
    steps = "\n".join(line for line in flow.splitlines() if re.match(r"(\d+\. |   )", line))
    named = [name for name in re.findall(r"`(\w+)`", steps) if name in called]
    return list(dict.fromkeys(named))


def order_problems(doc_text: str, source: str, functions: tuple[str, ...]) -> list[str]:
    called = set_up_calls(source, functions)
    named = documented_order(doc_text, called)
    in_code = [name for name in dict.fromkeys(called) if name in named]
    problems = [] if named == in_code else [f"the doc sets up in the order {named}, the code in {in_code}"]
    if len(named) < 6:
        problems.append(f"the doc's set-up names only {named} of the functions set_up calls")
    return problems


def test_the_documented_set_up_order_is_the_code_s():
    path, functions = SET_UP
    assert order_problems((ROOT / "docs/ARCHITECTURE.md").read_text(), (ROOT / path).read_text(), functions) == []


def test_the_order_check_sees_a_doc_out_of_order():
    source = (
        "def set_up(config):\n    env = launch(config)\n    return _set_up_locked(config, env)\n"
        "def _set_up_locked(config, env):\n    data = read(config)\n    model = build(config)\n"
        "    meters = observe(model)\n    opt = optimize(model)\n    return finish(data, model, opt, meters)\n"
    )
    doc = (
        "## The flow of a run\n\n1. `launch` then\n2. `build` (not `Config`), `read`,\n"
        "   `optimize` and `observe`\n3. `finish`.\n\n## Next\n"
    )
    assert order_problems(doc, source, ("set_up", "_set_up_locked")) == [
        "the doc sets up in the order ['launch', 'build', 'read', 'optimize', 'observe', 'finish'], "
        "the code in ['launch', 'read', 'build', 'observe', 'optimize', 'finish']"
    ]
