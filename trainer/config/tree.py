"""The whole configuration: Config holds one section of each file beside this one, in the order
files and `--help` show them; validate_config runs every field's check, then each section's relations, then
refuses settings that do nothing in this configuration (effects.py)."""

import dataclasses
import typing
from dataclasses import dataclass, field

from trillion.errors import ConfigError
from trillion.trainer.config.checks import OneOf
from trillion.trainer.config.data_sections import Data, Eval, Tokenizer
from trillion.trainer.config.effects import check_effects
from trillion.trainer.config.fault_sections import FaultTolerance
from trillion.trainer.config.model_sections import Compile, Float8, Kernels, Model, Moe
from trillion.trainer.config.observe_sections import Logging, Metrics, Profiling
from trillion.trainer.config.parallel_sections import Parallel
from trillion.trainer.config.run_sections import Checkpoint, Job, LRSchedule, Optimizer, Training


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    moe: Moe = field(default_factory=Moe)
    data: Data = field(default_factory=Data)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    logging: Logging = field(default_factory=Logging)
    parallel: Parallel = field(default_factory=Parallel)
    kernels: Kernels = field(default_factory=Kernels)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    profiling: Profiling = field(default_factory=Profiling)
    eval: Eval = field(default_factory=Eval)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)


def validate_config(config: Config) -> None:
    """Every field's declared check, then each section's relations, then the settings that do nothing in this
    configuration (effects.py); the first problem is raised as a ConfigError naming the setting and the fix."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for f in dataclasses.fields(values):
            value, check = getattr(values, f.name), f.metadata["check"]
            problem = check.problem(value) if check is not None else None
            if problem:
                raise ConfigError(
                    f"{section.name}.{f.name}={value!r} {problem}. The default is {f.default!r}; "
                    f"`trillion train --help` documents every setting."
                )
        if hasattr(values, "check_relations"):
            values.check_relations()
    check_effects(config)


def to_toml(config: Config) -> str:
    lines = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for name, value in dataclasses.asdict(getattr(config, section.name)).items():
            if isinstance(value, bool):
                lines.append(f"{name} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                lines.append(f"{name} = {_toml_string(value)}")
            else:
                lines.append(f"{name} = {value!r}")
        lines.append("")
    return "\n".join(lines)


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def help_text() -> str:
    """Every field with its type, default and documentation; a field with a table of choices lists
    them from the table (the presets, the kernels' implementations), so help never drifts from it."""
    lines = ["Configuration (TOML sections, or --section.field=value on the command line):", ""]
    for section in dataclasses.fields(Config):
        lines.append(f"[{section.name}]")
        hints = typing.get_type_hints(section.default_factory)
        for f in dataclasses.fields(section.default_factory):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{section.name}.{f.name}  ({hints[f.name].__name__}, default {default!r})")
            lines.append(f"      {f.metadata['doc']}")
            if isinstance(check := f.metadata["check"], OneOf):
                lines.append(f"      One of: {', '.join(check.choices())}.")
        lines.append("")
    return "\n".join(lines)
