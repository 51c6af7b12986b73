"""A run directory on disk: `checkpoints/step-NNNNNNNN/` folders published with a `COMPLETE` marker,
what an interrupted save leaves behind, the run's `config.toml`, and the refusals made before a run
touches any of it."""

import logging
import os
import shutil
from pathlib import Path

import tomllib

from trillion.errors import ConfigError

log = logging.getLogger("trillion")
MARKER = "COMPLETE"
CONFIG_FILE = "config.toml"
PARTIAL_PREFIXES = (".staging-", ".replaced-")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if is_complete(p))


def check_run_directory(output_dir: Path, *, overwrite: bool, restarted: bool) -> None:
    """Refuse, before any work, a run directory this run would damage: a config.toml that does not
    parse (the record of an earlier run's settings, never silently replaced), or an earlier run's
    metrics with no checkpoint to continue from (a fresh start would replace them; job.overwrite
    allows it, and a restart of the same job continues its own records)."""
    config_file = output_dir / CONFIG_FILE
    if config_file.is_file():
        try:
            tomllib.loads(config_file.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise ConfigError(
                f"{config_file} does not parse ({error}): it records the settings of the run in "
                f"job.output_dir={output_dir}. Repair or remove it, or give another --job.output_dir."
            ) from None
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size and not complete_checkpoints(output_dir / "checkpoints"):
        if overwrite or restarted:
            log.warning(
                "%s holds an earlier run's metrics and no checkpoint: starting afresh, replacing them", output_dir
            )
            return
        raise ConfigError(
            f"job.output_dir={output_dir} holds the metrics of an earlier run but no checkpoint to continue it from; "
            "a fresh start would replace them. Give a new --job.output_dir, or pass --job.overwrite=true to start "
            "afresh there."
        )


def write_run_config(output_dir: Path, config_toml: str) -> None:
    """config.toml, once the run is accepted (after the resume checks), replaced atomically."""
    staged = output_dir / f".{CONFIG_FILE}.staging"
    write_synced(staged, config_toml)
    os.replace(staged, output_dir / CONFIG_FILE)


def remove_partial(root: Path) -> list[str]:
    """Delete what an interrupted save left behind: staging dirs and step dirs without the marker."""
    if not root.is_dir():
        return []
    partial = [
        p
        for p in root.iterdir()
        if p.is_dir() and (p.name.startswith(PARTIAL_PREFIXES) or (p.name.startswith("step-") and not is_complete(p)))
    ]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(p.name for p in partial)


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
