"""The GPU tier for hiding TP's collectives (`pytest -m gpu`): what async TP (parallel.async_tp) needs on this device,
and, on a machine with two or more GPUs, the debug model trained at tp 2 with async TP, with the chunked overlap and
with neither: the same loss curve within bf16's rounding, and Inductor's pass fused the collectives (it warns when it
finds none to fuse). Skipped, with the reason, without a GPU or with one GPU. Run by
experiments/bench/device_check.sh."""

import json
import os
import subprocess
import sys

import pytest
import torch

from trillion.parallel.async_tp import symmetric_memory_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
STEPS = 20
NOTHING_FUSED = "async TP found no matching all-gather/reduce-scatter patterns"


def test_this_device_has_what_async_tp_needs():
    """CUDA with a symmetric-memory backend (torch's build), and, between the first two GPUs, peer access."""
    backend = symmetric_memory_backend(torch.device("cuda"))
    if torch.version.hip and backend is None:
        pytest.skip(f"this ROCm {torch.version.hip} build of torch has no symmetric memory: use parallel.tp_overlap")
    assert backend is not None, f"torch {torch.__version__} (CUDA {torch.version.cuda}) has no symmetric memory"
    if torch.cuda.device_count() > 1:
        assert torch.cuda.can_device_access_peer(0, 1), "GPUs 0 and 1 cannot map each other's memory"


def _train(tmp_path, name: str, *settings: str) -> tuple[list[float], str]:
    out = tmp_path / name
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *("-m", "trillion", "train", f"--job.output_dir={out}", "--model.name=debug", "--parallel.tp=2"),
        *(f"--training.steps={STEPS}", "--training.seq_len=256", "--metrics.log_freq=1", "--checkpoint.interval=0"),
        *("--logging.wandb=false", "--job.seed=7", "--compile.enabled=true", *settings),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=420, env={**os.environ, "TRITON_INTERPRET": "0"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r and "eval_loss" not in r], result.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp 2 needs two GPUs; this machine has fewer")
def test_tp2_with_async_tp_and_the_chunked_overlap_trains_as_without(tmp_path):
    plain, _ = _train(tmp_path, "plain")
    fused, log = _train(tmp_path, "async", "--parallel.async_tp=true")
    chunked, _ = _train(tmp_path, "chunked", "--parallel.tp_overlap=4")
    assert NOTHING_FUSED not in log, "Inductor's micro-pipeline pass fused nothing"
    assert len(plain) == len(fused) == len(chunked) == STEPS and plain[-1] < plain[0] - 1.0
    for step, (a, b, c) in enumerate(zip(fused, chunked, plain), 1):  # bf16: the same products, rounded apart
        assert abs(a - c) <= 0.02 * abs(c) + 0.02 and abs(b - c) <= 0.02 * abs(c) + 0.02, (step, a, b, c)
