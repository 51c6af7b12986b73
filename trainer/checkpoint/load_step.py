"""Which checkpoints a resume may load: all of them (the newest intact one is taken), or, with
`checkpoint.load_step`, those up to that step, the later ones set aside as `abandoned-step-*` so
they are never loaded, pruned or replaced by the steps that run again.

A run resumed this way writes `load_step` into every checkpoint it saves (its config.toml), so a
newest checkpoint past `load_step` with that same setting means the choice was already made: the same
command run again after a preemption then continues from there instead of going back again."""

import logging
from pathlib import Path

from trillion.errors import ConfigError
from trillion.trainer.checkpoint.folders import CONFIG_FILE
from trillion.trainer.checkpoint.resume_check import saved_config

log = logging.getLogger("trillion")
SETTING = "checkpoint.load_step"


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step-"))


def loadable(checkpoints: list[Path], load_step: int, root: Path, is_rank0: bool) -> list[Path]:
    """`checkpoints` (oldest first) a resume may load under `load_step`; rank 0 sets the later ones aside
    (the caller holds a barrier before anyone lists the folder again)."""
    if load_step == 0 or (checkpoints and _already_applied(checkpoints[-1], load_step)):
        return checkpoints
    steps = [step_of(c) for c in checkpoints]
    if load_step not in steps:
        there = ", ".join(map(str, steps)) if steps else "none"
        raise ConfigError(
            f"{SETTING}={load_step}: {root} has no complete checkpoint of step {load_step} (the complete ones: "
            f"{there}). Give one of those steps, or {SETTING}=0 to resume from the newest."
        )
    later = [c for c in checkpoints if step_of(c) > load_step]
    if is_rank0 and later:
        aside = [_set_aside(c) for c in later]
        log.warning(
            "%s=%d: set aside the later checkpoint%s %s (kept, never loaded again); steps %d on run again",
            SETTING,
            load_step,
            "s" if len(aside) > 1 else "",
            ", ".join(aside),
            load_step + 1,
        )
    return [c for c in checkpoints if step_of(c) <= load_step]


def _already_applied(newest: Path, load_step: int) -> bool:
    return step_of(newest) > load_step and saved_config(newest / CONFIG_FILE).get(SETTING) == load_step


def _set_aside(checkpoint: Path) -> str:
    target, copy = checkpoint.with_name(f"abandoned-{checkpoint.name}"), 1
    while target.exists():  # set aside once before, by an earlier going back
        copy += 1
        target = checkpoint.with_name(f"abandoned-{checkpoint.name}.{copy}")
    checkpoint.rename(target)
    return target.name
