"""What a source file imports, read from its AST: `import` and `from ... import` statements anywhere
(inside functions too, relative ones resolved) and modules named in strings, such as
`importlib.import_module("trillion.x.y")`, `"trillion.x.y:NAME"` or the `"trillion.x.y.attr"` a test
patches. Each is resolved to the module file it names in the checkout, so a dotted path that ends in
attributes counts as an import of the module that holds them.

Docstrings (the first statement of a module, class or function) are prose and not scanned: a module
may describe the layers above it. Every other string constant is, wherever it appears, since a
module name can reach `import_module` through a variable or a table."""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

# Installed module prefix -> folder of the checkout ([tool.setuptools.package-dir] in pyproject.toml).
PACKAGE_DIRS = {
    "trillion.kernels": "kernels",
    "trillion.models": "models",
    "trillion.parallel": "parallel",
    "trillion.trainer": "trainer",
    "trillion": "trillion",
}
NAMED_MODULE = re.compile(r"(?<![\w.])trillion(?:\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the module (or package) imported; a `trillion...` one resolved against the checkout
    string: str | None = None  # the string that named it, None for an import statement

    @property
    def how(self) -> str:
        return "imports" if self.string is None else f"names {self.string!r}, so imports"


def module_file(root: Path, module: str) -> Path | None:
    """The file of `trillion...` module `module` in the checkout at `root`, None if there is none."""
    for prefix, folder in PACKAGE_DIRS.items():
        if module == prefix or module.startswith(prefix + "."):
            base = root.joinpath(folder, *module[len(prefix) + 1 :].split(".")) if module != prefix else root / folder
            for candidate in (base / "__init__.py", base.with_suffix(".py")):
                if candidate.is_file():
                    return candidate
            return None
    return None


def resolve(root: Path, dotted: str) -> str | None:
    """The longest prefix of `dotted` below `trillion` that names a module or package of the checkout
    (trailing parts are attributes); `dotted` itself when none does; None outside the namespace."""
    parts = dotted.split(".")
    if parts[0] != "trillion":
        return None
    for end in range(len(parts), 1, -1):
        if module_file(root, ".".join(parts[:end])) is not None:
            return ".".join(parts[:end])
    return dotted


def module_name(root: Path, path: Path) -> str:
    """The installed name of the checkout's file `path`: trainer/data/loader.py -> trillion.trainer.data.loader."""
    relative = path.relative_to(root)
    for prefix, folder in PACKAGE_DIRS.items():
        if relative.parts[0] == folder:
            rest = list(relative.with_suffix("").parts[1:])
            if rest and rest[-1] == "__init__":
                rest.pop()
            return ".".join([prefix, *rest])
    raise ValueError(f"{relative} is not in a package folder")


def docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every `trillion...` module the file `path` imports or names, in the order of the source."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(root, path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    docstrings = docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                # `from a import b` imports a.b when b is a submodule, else a (b is a name in it).
                sub = f"{base}.{alias.name}"
                found.append(Import(node.lineno, sub if module_file(root, sub) else base))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found += [Import(node.lineno, resolve(root, named), named) for named in NAMED_MODULE.findall(node.value)]
    return sorted(found, key=lambda i: i.line)
