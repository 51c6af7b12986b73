"""`trillion train` as a user runs it: a subprocess on the embedded corpus."""
import importlib.util
import json
import subprocess
import sys

import torch

from trillion.trainer.config import load_config


def test_train_writes_a_run_directory_and_learns(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "trillion", "train", f"--job.output_dir={out}", "--training.steps=24",
            "--training.seq_len=128", "--metrics.log_freq=4", "--lr_schedule.warmup_steps=4", "--checkpoint.interval=10",
            "--checkpoint.keep_latest=1"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr
    assert "step 24/24" in result.stderr and "tok/s" in result.stderr and "eta" in result.stderr

    config = load_config(str(out / "config.toml"))
    assert config.training.steps == 24 and config.job.output_dir == str(out)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 4, 8, 12, 16, 20, 24]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "hfu", "memory_gb", "data_wait_s"):
        assert key in records[-1]
    if not torch.cuda.is_available():
        assert records[-1]["mfu"] is None  # CPU: no known peak, so no made-up MFU
    assert records[-1]["loss"] < records[0]["loss"] - 1.5, [r["loss"] for r in records]

    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step-00000024"]  # keep_latest=1 pruned step 20 once 24 was whole
    assert (out / "checkpoints" / "step-00000024" / "COMPLETE").is_file()
    if importlib.util.find_spec("wandb") is not None:  # optional: machines without it train all the same
        assert list((out / "wandb").glob("offline-run-*")), "an offline W&B run is written next to the metrics"
