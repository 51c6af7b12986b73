"""Where this process stands: rank, world size and device, from the launcher's environment
(torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or srun's SLURM_* variables; a single process when
neither is set)."""

import datetime
import hashlib
import os
from dataclasses import dataclass

import tomllib
import torch
import torch.distributed as dist

from trillion.errors import ConfigError
from trillion.trainer.launch import rendezvous
from trillion.trainer.launch.slurm import torch_env_from_slurm

# Set by `trillion torchrun` (cli/torchrun.py) for its ranks: the file each appends one line to when it stopped
# early on a signal with its checkpoint saved, which the launcher prints before exiting 0.
STOP_REPORT_ENV = "TRILLION_STOP_REPORT"


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"Environment variable {name}={value!r} must be an integer; check the launcher.") from None


def restarted() -> bool:
    """Whether this process is a restart of its job (torchrun --max-restarts, a SLURM requeue): the run
    directory's records are then the same job's own."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0 or _env_int("SLURM_RESTART_COUNT", 0) > 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    """auto: the GPU of this local rank when there is one (CUDA or ROCm), else the CPU."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"job.device={requested!r} is not known. Use auto, cpu or cuda.")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(
                "job.device=cuda but this PyTorch sees no GPU (CUDA or ROCm). Use --job.device=cpu or auto."
            )
        visible = torch.cuda.device_count()
        # One visible device: the launcher (SLURM's GPU binding, or *_VISIBLE_DEVICES) already chose it.
        index = 0 if visible == 1 else local_rank
        if index >= visible:
            raise ConfigError(
                f"Local rank {local_rank} has no GPU: this node shows {visible}. Start at most one "
                "process per GPU (torchrun --nproc-per-node, srun --ntasks-per-node / --gpus-per-task=1)."
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_launch_env(requested_device: str, collective_timeout_s: float = 600.0) -> LaunchEnv:
    """Read the launcher's variables and, for more than one process, join the process group."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(torch_env_from_slurm(dict(os.environ)))
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world_size or not 0 <= local_rank < _env_int("LOCAL_WORLD_SIZE", world_size):
        raise ConfigError(
            f"The launcher's variables disagree: RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}, "
            f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE', 'unset')}. Start every process with the "
            "same task count (torchrun --nproc-per-node, or srun --ntasks / --ntasks-per-node)."
        )
    device = pick_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            raise ConfigError(
                f"WORLD_SIZE={world_size} but no rendezvous address: set MASTER_ADDR and MASTER_PORT, "
                "or start the processes with torchrun or srun, which set them."
            )
        # srun and plain launches check in at a rendezvous that carries start-up errors (rendezvous.py)
        store = (
            None
            if rendezvous.under_torchrun()
            else rendezvous.join(
                rank, world_size, os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), collective_timeout_s
            )
        )
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
            store=store,
            rank=rank if store else -1,
            world_size=world_size if store else -1,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
    return LaunchEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def check_same_config(config_toml: str) -> None:
    """Every rank must run the same resolved config (`config_toml`, as config.toml holds it: a rank started
    with another flag or file would train another model or layout and hang or diverge later); the
    differing settings are named."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return  # the dry run's simulated ranks share one config, and fake collectives carry no data
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(config_toml.encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tomllib.loads(config_toml))
    ours, rank = everyone[0], dist.get_rank()
    differ = [
        f"{section}.{name}"
        for section, fields in ours.items()
        for name, value in fields.items()
        if any(other[section].get(name) != value for other in everyone)
    ]
    odd = [r for r, digest in enumerate(digests) if digest != digests[0]]
    raise ConfigError(
        f"Rank {rank}: the ranks were started with different settings ({', '.join(differ)} differ between "
        f"rank 0 and rank(s) {', '.join(map(str, odd))}). Start every rank with the same --config and "
        "flags."
    )
