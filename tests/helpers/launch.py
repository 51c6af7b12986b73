"""`trillion train` started as a user starts it, in a subprocess: alone or under torchrun, or as
srun-style ranks with only SLURM's variables (`clean_env`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

TRILLION = [sys.executable, "-m", "trillion"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def clean_env(**extra):
    """This process's environment without any launcher's rank variables, W&B offline, plus `extra`."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    return {**env, "WANDB_MODE": "offline", **extra}


def train_records(out: Path, command: list[str], flags: list[str]) -> list[dict]:
    """Runs `*command train --job.output_dir=OUT *flags` (W&B offline, one intra-op thread a process)
    and returns every record of its metrics.jsonl; a failed run fails the test with its stderr."""
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, "train", f"--job.output_dir={out}", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_curve(alone: list[dict], layout: list[dict], rel: float = 1e-4) -> None:
    """Each record's loss and gradient norm within `rel` of the one-process run's."""
    for one, parallel in zip(alone, layout):
        assert abs(one["loss"] - parallel["loss"]) <= rel * abs(one["loss"]), (one, parallel)
        assert abs(one["grad_norm"] - parallel["grad_norm"]) <= rel * abs(one["grad_norm"]), (one, parallel)
