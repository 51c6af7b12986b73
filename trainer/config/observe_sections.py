"""The sections of what a run reports: [metrics], [logging], [profiling]."""

from dataclasses import dataclass

from trillion.trainer.config.checks import Flag, OneOf, Range, Text
from trillion.trainer.config.fields import NONNEGATIVE, POSITIVE, doc


@dataclass
class Metrics:
    log_freq: int = doc(10, "Log metrics every N steps (and the first and last).", POSITIVE)
    peak_tflops: float = doc(
        0.0, "Peak dense TFLOP/s per device for MFU (0 = look the device up; unknown devices get no MFU).", NONNEGATIVE
    )


@dataclass
class Logging:
    wandb: bool = doc(
        True, "Write a Weights & Biases run: online when a project or API key is configured, offline otherwise.", Flag()
    )
    wandb_project: str = doc(
        "", "W&B project (or WANDB_PROJECT); setting it, or WANDB_API_KEY, makes the run online.", Text()
    )
    wandb_entity: str = doc("", "W&B entity (team or user).", Text())
    wandb_run_name: str = doc("", "W&B run name (default: the output directory's name).", Text())
    wandb_group: str = doc("", "W&B group (or WANDB_RUN_GROUP), e.g. one scaling study.", Text())
    wandb_tags: str = doc("", "Comma-separated W&B tags (or WANDB_TAGS).", Text())
    wandb_init_timeout_s: float = doc(
        30.0,
        "Give up reaching the W&B server after this long and write the run offline instead.",
        Range(0, open_low=True),
    )
    tensorboard: bool = doc(
        False, "Also write TensorBoard event files under <output_dir>/tensorboard (needs `tensorboard`).", Flag()
    )
    progress_bar: str = doc(
        "auto", "auto (a live bar on a terminal, log lines otherwise) | bar | lines.", OneOf(("auto", "bar", "lines"))
    )


@dataclass
class Profiling:
    enabled: bool = doc(
        False, "Write torch.profiler traces (Chrome/Perfetto JSON) per rank under <output_dir>/profiles.", Flag()
    )
    wait: int = doc(5, "Profiler schedule: steps to skip before each recording.", NONNEGATIVE)
    warmup: int = doc(2, "Profiler schedule: steps recorded and thrown away (the profiler's own warm-up).", NONNEGATIVE)
    active: int = doc(3, "Profiler schedule: steps recorded into one trace.", POSITIVE)
    repeat: int = doc(1, "Profiler schedule: how many traces (0 = until the end).", NONNEGATIVE)
    memory_snapshot: bool = doc(
        False, "GPUs: record allocations; write a snapshot at memory_snapshot_step and on out-of-memory.", Flag()
    )
    memory_snapshot_step: int = doc(3, "Step after which the memory snapshot is written.", POSITIVE)
