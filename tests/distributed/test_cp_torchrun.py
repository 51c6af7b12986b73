"""Through the CLI: `torchrun --nproc-per-node 4 --no-python trillion train --parallel.cp=2
--parallel.dp_shard=2 --training.seq_len=256` logs the one-process losses and gradient norms on the
real data path (embedded corpus, packing, each data-parallel rank's slice, each cp rank's share)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = [
    "--model.n_layers=2",
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=96",
    "--training.seq_len=256",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=1",
    "--training.steps=5",
    "--metrics.log_freq=1",
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
    "--logging.progress_bar=lines",
    "--lr_schedule.warmup_steps=1",
]


def _run(out: Path, launcher: list[str], extra: list[str]) -> list[dict]:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*launcher, "train", f"--job.output_dir={out}", *SMALL, *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # about a minute on two cores: five interpreters start and import torch
def test_cp2_x_fsdp2_under_torchrun_logs_the_one_process_losses(tmp_path):
    trillion = shutil.which("trillion", path=str(Path(sys.executable).parent)) or shutil.which("trillion")
    alone = _run(tmp_path / "one", [sys.executable, "-m", "trillion"], [])
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "--no-python",
        trillion,
    ]
    layout = _run(tmp_path / "cp", torchrun, ["--parallel.cp=2", "--parallel.dp_shard=2"])
    assert [r["step"] for r in layout] == [1, 2, 3, 4, 5]
    for one, parallel in zip(alone, layout):
        assert abs(one["loss"] - parallel["loss"]) <= 1e-4 * abs(one["loss"]), (one, parallel)
        assert abs(one["grad_norm"] - parallel["grad_norm"]) <= 1e-4 * abs(one["grad_norm"]), (one, parallel)
