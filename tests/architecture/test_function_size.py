"""Functions stay short enough to read: none over 80 lines anywhere in the tree but the Triton kernels
(a kernel is one launch, and splitting it costs registers), and the training loop's module, where
`train()` and the step it runs live, keeps each function under 60. Read from the AST: a function
spans its `def` line to its last line, docstring and nested functions included (decorators not)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 80
MAX_LOOP_LINES = 59  # under 60
TRITON_KERNEL_FILES = {
    "kernels/_flash_attention_kernels.py",
    "kernels/_flash_attention_dkdv_kernel.py",
    "kernels/_norm_kernels.py",
}
LOOP_MODULE = "trainer/train.py"
SKIPPED_FOLDERS = {"__pycache__", "build", "outputs", "wandb"}  # as .gitignore


def python_files(root: Path) -> list[Path]:
    return sorted(
        path
        for path in root.rglob("*.py")
        if not any(
            part.startswith(".") or part in SKIPPED_FOLDERS or part.endswith(".egg-info")
            for part in path.relative_to(root).parts[:-1]
        )
    )


def is_triton_kernel(function: ast.AST) -> bool:
    # @triton.jit, or @triton.autotune / @triton.heuristics over it
    return any(
        isinstance(target := (d.func if isinstance(d, ast.Call) else d), ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "triton"
        for d in function.decorator_list
    )


def functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, `def` line, length in lines, node) of every function and method of the file."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child.lineno, child.end_lineno - child.lineno + 1, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def long_functions(root: Path) -> list[str]:
    long = []
    for path in python_files(root):
        where = str(path.relative_to(root))
        for name, line, length, node in functions(path):
            if length > MAX_LINES and not (where in TRITON_KERNEL_FILES and is_triton_kernel(node)):
                long.append(f"{where}:{line} {name}: {length} lines (at most {MAX_LINES})")
    return long


def long_loop_functions(root: Path) -> list[str]:
    path = root / LOOP_MODULE
    found = functions(path)
    long = [
        f"{LOOP_MODULE}:{line} {name}: {length} lines (under {MAX_LOOP_LINES + 1})"
        for name, line, length, _ in found
        if length > MAX_LOOP_LINES
    ]
    if "train" not in {name for name, *_ in found}:
        long.append(f"{LOOP_MODULE} defines no train()")
    return long


def test_no_function_outside_the_triton_kernels_is_over_80_lines():
    assert long_functions(ROOT) == []


def test_train_and_the_loop_body_are_each_under_60_lines():
    assert long_loop_functions(ROOT) == []


def test_the_checks_see_a_long_function(tmp_path):
    body = "".join(f"    x = {i}\n" for i in range(80))  # with the def line: 81 lines
    (tmp_path / "kernels").mkdir()
    (tmp_path / "trainer").mkdir()
    (tmp_path / ".venv").mkdir()
    (tmp_path / "kernels" / "_norm_kernels.py").write_text(
        f"import triton\n@triton.jit\ndef norm_fwd():\n{body}\ndef helper():\n{body}"
    )
    (tmp_path / ".venv" / "site.py").write_text(f"def vendored():\n{body}")
    short = "".join(f"    x = {i}\n" for i in range(59))  # 60 lines
    (tmp_path / "trainer" / "train.py").write_text(
        f"class Loop:\n    def step(self):\n{body.replace('    ', '        ')}\n\ndef train():\n{short}"
    )
    assert long_functions(tmp_path) == [
        "kernels/_norm_kernels.py:85 helper: 81 lines (at most 80)",
        "trainer/train.py:2 Loop.step: 81 lines (at most 80)",
    ]
    assert long_loop_functions(tmp_path) == [
        "trainer/train.py:2 Loop.step: 81 lines (under 60)",
        "trainer/train.py:85 train: 60 lines (under 60)",
    ]
