"""Before any work: what fault tolerance needs that the config alone cannot say (torchft installed, the
Lighthouse's address, a layout with room for the groups), and each group's own run directory. torchft is
imported only when fault tolerance is on: a run without it never loads it."""

import dataclasses
import os
from pathlib import Path
from urllib.parse import urlsplit

from trillion.errors import ConfigError
from trillion.parallel.layout import Layout
from trillion.trainer.config.schema import Config

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
LIGHTHOUSE_COMMAND = "torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000"


def check_fault_tolerance(config: Config, layout: Layout) -> None:
    """Refuse fault tolerance that cannot work in the run's `layout`, naming the setting and the fix (a ConfigError,
    exit 2)."""
    ft = config.fault_tolerance
    if not ft.enabled:
        return
    try:
        import torchft  # noqa: F401 (only with fault tolerance on)
    except ImportError:
        raise ConfigError(
            "fault_tolerance.enabled=true needs torchft, which is not installed. Install it with "
            "`pip install 'trillion[ft]'` (or `pip install torchft==0.2.0`), or turn fault tolerance off."
        ) from None
    if layout.dp_replicate > 1:
        raise ConfigError(
            f"fault_tolerance.enabled=true with parallel.dp_replicate={layout.dp_replicate}: the replica "
            "groups are the data-parallel replicas (torchft's managed all-reduce between groups replaces "
            "dp_replicate), so there is no dp_replicate room inside a group. Run each group with "
            f"--parallel.dp_replicate=1 and start fault_tolerance.group_size={ft.group_size} groups (FSDP, tp, pp, "
            "cp and ep stay available inside each)."
        )
    if config.training.dtype == "fp16":
        raise ConfigError(
            "fault_tolerance.enabled=true with training.dtype=fp16: the loss scaler steps the optimizer whatever "
            "the groups' commit vote says. Use --training.dtype=bf16 (or fp32 on a CPU)."
        )
    address = os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            f"fault_tolerance.enabled=true but {LIGHTHOUSE_ENV} is not set: every replica group finds the torchft "
            f"Lighthouse there. Start one (`{LIGHTHOUSE_COMMAND}`, which listens on port 29510) and set "
            f"{LIGHTHOUSE_ENV}=http://HOST:29510 for every group (experiments/slurm/ft.sbatch does both)."
        )
    if problem := lighthouse_address_problem(address):
        raise ConfigError(
            f"{LIGHTHOUSE_ENV}={address!r} is not a Lighthouse address: {problem}. torchft reaches the Lighthouse "
            f"by a URL, http://HOST:PORT (the port `torchft_lighthouse` listens on, 29510 by default), e.g. "
            f"{LIGHTHOUSE_ENV}=http://{_host_guess(address)}:29510."
        )


def lighthouse_address_problem(address: str) -> str | None:
    """What keeps `address` from being a URL torchft's client can dial (None when it can): torchft retries a
    malformed one until fault_tolerance.timeout_s, so it is refused here, before any wait."""
    try:
        parts = urlsplit(address)
        parts.port  # noqa: B018 (raises for a port that is not a number, or out of range)
    except ValueError as error:
        return str(error)
    if parts.scheme not in ("http", "https"):
        return "it has no http:// (or https://) scheme" if "://" not in address else f"the scheme {parts.scheme!r}"
    return None if parts.hostname else "it names no host"


def _host_guess(address: str) -> str:
    """The host the user most likely meant, for the example in the message."""
    host = urlsplit(address if "://" in address else f"http://{address}").hostname if address else None
    return host or "HOST"


def replica_group_config(config: Config) -> Config:
    """The config this group runs: its own run directory, `<job.output_dir>/replica_<id>` (lock, metrics,
    checkpoints: groups start and fail on their own), unless job.output_dir already is that folder (a rerun
    of the group's config.toml)."""
    ft = config.fault_tolerance
    folder = f"replica_{ft.replica_id}"
    if not ft.enabled or Path(config.job.output_dir).name == folder:
        return config
    job = dataclasses.replace(config.job, output_dir=str(Path(config.job.output_dir) / folder))
    return dataclasses.replace(config, job=job)
