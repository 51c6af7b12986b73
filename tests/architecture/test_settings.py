"""One door for each setting. The parallel layout is resolved from the config in one function
(trainer/assemble.py resolve_layout) into one value, Layout, that everything below reads: no runtime module
outside that function reads the layout's config sections, `parallelize`, the pipeline and the micro-batch loop
take no keyword that Layout holds, and one `trillion train` builds ParallelDims once. The model's parts receive
typed settings (models/parts/settings.py): models/ reads no trainer config key ("section.field"). Read from the
source (AST) like the other structure tests, each with a planted violation it must see."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

from tests.architecture.test_layers import plant
from tests.helpers.runs import run
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.layout import Layout
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline
from trillion.trainer.config import Config

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
CONFIG_KEY = re.compile(rf"^({'|'.join(SECTIONS)})\.\w+$")  # "parallel.ep", "data.document_mask", ...

# The config settings Layout resolves, by section: every field of these sections (None), or the fields named
RESOLVED_INTO_LAYOUT = {"parallel": None, "compile": None, "float8": None, "moe": {"rank_capacity_factor"}}
RESOLVER = ("trainer/assemble.py", "resolve_layout")
# Where the config is read as it is, not as the run's settings: its own sections and checks, and the tools,
# which write configs (`trillion plan --config-out`, the estimate's tiny run) and adjust them before resolving
NOT_RUNTIME = ("trainer/config/", "trainer/tools/")


def _string(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def config_key_reads(root: Path, folder: str = "models") -> list[str]:
    """Every string of the form "<config section>.<field>" used as a subscript, a .get/.pop argument, a dict
    literal's key or the left of an `in`: a part reading a trainer setting by its config name."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            keys = []
            if isinstance(node, ast.Subscript):
                keys = [node.slice]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                keys = node.args[:1] if node.func.attr in ("get", "pop", "setdefault") else []
            elif isinstance(node, ast.Dict):
                keys = [key for key in node.keys if key is not None]
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
                keys = [node.left]
            for key in keys:
                if (text := _string(key)) is not None and CONFIG_KEY.match(text):
                    found.append(f"{path.relative_to(root)}:{node.lineno} reads the config key {text!r}")
    return found


def test_models_read_no_trainer_config_key():
    assert config_key_reads(ROOT) == []


def test_the_key_check_sees_a_part_reading_a_config_key(tmp_path):
    root = plant(
        tmp_path,
        {
            "models/parts/bad.py": (
                '"""Mentions "parallel.ep" in prose: not a read."""\n'
                "def f(settings, args):\n"
                '    ep = settings["parallel.ep"]\n'
                '    impl = settings.get("kernels.grouped_gemm", "auto")\n'
                '    if "data.document_mask" in settings:\n'
                "        pass\n"
                '    message = f"model.n_kv_heads={args.kv_heads} is refused"  # a message naming a setting\n'
                '    return {"moe.top_k": 2, "not a key": 1}\n'
            ),
        },
    )
    assert config_key_reads(root) == [
        "models/parts/bad.py:3 reads the config key 'parallel.ep'",
        "models/parts/bad.py:4 reads the config key 'kernels.grouped_gemm'",
        "models/parts/bad.py:5 reads the config key 'data.document_mask'",
        "models/parts/bad.py:8 reads the config key 'moe.top_k'",
    ]


def _reads_a_resolved_setting(node: ast.Attribute) -> bool:
    """`config.parallel`, `self.config.float8`, `config.moe.rank_capacity_factor`: a read of a setting Layout
    holds from the config (the base named `config`)."""
    section, field = (node, None) if node.attr in RESOLVED_INTO_LAYOUT else (node.value, node.attr)
    if not isinstance(section, ast.Attribute) or section.attr not in RESOLVED_INTO_LAYOUT:
        return False
    fields = RESOLVED_INTO_LAYOUT[section.attr]
    if (fields is None) != (field is None) or (field is not None and field not in fields):
        return False
    base = section.value
    return (isinstance(base, ast.Name) and base.id == "config") or (
        isinstance(base, ast.Attribute) and base.attr == "config"
    )


def layout_setting_reads(root: Path) -> list[str]:
    """Every read of a setting Layout holds from the config outside resolve_layout, in the runtime modules
    (trainer/ but its config and tools, parallel/, models/), with the function it is in."""
    found = []
    for folder in ("trainer", "parallel", "models"):
        for path in sorted((root / folder).rglob("*.py")):
            where = str(path.relative_to(root))
            if where.startswith(NOT_RUNTIME):
                continue
            tree = ast.parse(path.read_text())
            functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _reads_a_resolved_setting(n)]
            for node in sorted(reads, key=lambda n: (n.lineno, n.col_offset)):
                inside = [f for f in functions if f.lineno <= node.lineno <= f.end_lineno]
                name = max(inside, key=lambda f: f.lineno).name if inside else "<module>"
                if (where, name) != RESOLVER:
                    found.append(f"{where}:{node.lineno} {name} reads {ast.unparse(node)}")
    return found


def test_each_layout_setting_is_resolved_in_one_function():
    assert layout_setting_reads(ROOT) == []


def test_the_resolver_check_sees_a_second_door(tmp_path):
    root = plant(
        tmp_path,
        {
            "trainer/assemble.py": (
                "def resolve_layout(config):\n    return config.parallel.tp, config.moe.rank_capacity_factor\n"
            ),
            "trainer/bad.py": (
                "def build(config, layout):\n"
                "    mode = config.parallel.dp_shard_mode\n"
                "    return layout.float8, config.moe.top_k, self.config.compile.enabled, config.float8\n"
            ),
            "trainer/tools/plan.py": "def write(config):\n    config.parallel.tp = 2\n",
        },
    )
    assert layout_setting_reads(root) == [
        "trainer/bad.py:2 build reads config.parallel",
        "trainer/bad.py:3 build reads self.config.compile",
        "trainer/bad.py:3 build reads config.float8",
    ]


def test_the_runtime_takes_no_keyword_that_layout_holds():
    """parallelize, the pipeline and the micro-batch loop read every layout setting from the Layout they are given
    (dims.layout): a keyword of the same name would be a second door."""
    synonyms = {"n_microbatches", "schedule", "virtual", "layers", "paired"}  # the keywords they took before
    held = {f.name for f in dataclasses.fields(Layout)} | synonyms
    for function in (parallelize, Pipeline.__init__, MicroBatchLoop.__init__):
        assert set(inspect.signature(function).parameters) & held == set(), function.__qualname__


def test_one_train_builds_its_parallel_dims_once(tmp_path, monkeypatch):
    """A real one-process `trillion train` (two steps, an evaluation, a checkpoint) builds ParallelDims once: the
    layout's checks are functions of the Layout, not of throwaway meshes."""
    built = []
    post_init = ParallelDims.__post_init__
    monkeypatch.setattr(ParallelDims, "__post_init__", lambda dims: (built.append(dims.layout), post_init(dims)))
    record = run(tmp_path / "run", "--eval.interval=2", "--eval.steps=1", steps=2)
    assert record["step"] == 2 and "eval_loss" in record
    assert len(built) == 1 and built[0].micro_batch_size == 2 and built[0].microbatches == 2, built
