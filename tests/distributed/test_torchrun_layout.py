"""The README's command: `torchrun --nproc-per-node 4 -m trillion train --parallel.dp_shard=2
--parallel.tp=2` logs the losses and gradient norms of the one-process run on the real data path
(embedded corpus, packing, each data-parallel rank's slice of the global batch)."""

import json
import os
import subprocess
import sys

import pytest

SMALL = [
    "--model.n_layers=2",
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=96",
    "--training.seq_len=32",
    "--training.global_batch_size=8",
    "--training.micro_batch_size=2",
    "--training.steps=3",
    "--metrics.log_freq=1",
    "--checkpoint.interval=0",
    "--checkpoint.save_final=false",
    "--logging.progress_bar=lines",
    "--lr_schedule.warmup_steps=1",
]


def _run(out, launcher: list[str], extra: list[str]) -> list[dict]:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*launcher, "-m", "trillion", "train", f"--job.output_dir={out}", *SMALL, *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow  # about a minute on two cores: five interpreters start and import torch
def test_fsdp_x_tp_under_torchrun_logs_the_one_process_losses(tmp_path):
    alone = _run(tmp_path / "one", [sys.executable], [])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    layout = _run(tmp_path / "2d", torchrun, ["--parallel.dp_shard=2", "--parallel.tp=2"])
    assert [r["step"] for r in layout] == [1, 2, 3]
    for one, parallel in zip(alone, layout):
        assert abs(one["loss"] - parallel["loss"]) <= 1e-4 * abs(one["loss"]), (one, parallel)
        assert abs(one["grad_norm"] - parallel["grad_norm"]) <= 1e-4 * abs(one["grad_norm"]), (one, parallel)
