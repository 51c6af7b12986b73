"""The run's configuration: one small dataclass per component, loaded from TOML and overridden
from the command line (`--section.field=value`), checked before any work starts.

Every field carries its documentation, which `trillion train --help` prints, and its check
(checks.py: ranges, choices, paths), run by `validate_config` once the file and the overrides are
read; relations between a section's fields are its `check_relations` method. Each component
receives only its own section, never the whole Config.

This module is the one name the rest of the trainer imports the configuration by; it lives in
files by section (run_sections.py, model_sections.py, data_sections.py, parallel_sections.py,
observe_sections.py, fault_sections.py: what each field accepts), the whole (tree.py: Config, checks, TOML and help
output), the settings that act only in some configurations (effects.py) and the reading of files and flags
(loading.py).
"""

from trillion.errors import ConfigError
from trillion.trainer.config.data_sections import Data, Eval, Tokenizer
from trillion.trainer.config.effects import without_idle
from trillion.trainer.config.fault_sections import FaultTolerance
from trillion.trainer.config.fields import divisor_near
from trillion.trainer.config.loading import load_config
from trillion.trainer.config.model_sections import Compile, Float8, Kernels, Model, Moe
from trillion.trainer.config.observe_sections import Logging, Metrics, Profiling
from trillion.trainer.config.parallel_sections import Parallel
from trillion.trainer.config.run_sections import ASYNC_MODES, Checkpoint, Job, LRSchedule, Optimizer, Training
from trillion.trainer.config.tree import Config, help_text, to_toml, validate_config

__all__ = [
    "ASYNC_MODES",
    "Checkpoint",
    "Compile",
    "Config",
    "ConfigError",
    "Data",
    "Eval",
    "FaultTolerance",
    "Float8",
    "Job",
    "Kernels",
    "LRSchedule",
    "Logging",
    "Metrics",
    "Model",
    "Moe",
    "Optimizer",
    "Parallel",
    "Profiling",
    "Tokenizer",
    "Training",
    "divisor_near",
    "help_text",
    "load_config",
    "without_idle",
    "to_toml",
    "validate_config",
]
