"""`trillion train` as a user runs it: a subprocess on the embedded corpus."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from trillion.trainer.config.schema import load_config


def test_train_writes_a_run_directory_and_learns(tmp_path):
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "trillion",
        "train",
        f"--job.output_dir={out}",
        "--training.steps=24",
        "--training.seq_len=128",
        "--metrics.log_freq=4",
        "--lr_schedule.warmup_steps=4",
        "--checkpoint.interval=10",
        "--checkpoint.keep_latest=1",
        "--eval.interval=12",
        "--eval.steps=4",
    ]
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "WANDB_MODE": "offline"}
    )
    assert result.returncode == 0, result.stderr
    assert "step 24/24" in result.stderr and "tok/s" in result.stderr and "eta" in result.stderr

    config = load_config(str(out / "config.toml"))
    assert config.training.steps == 24 and config.job.output_dir == str(out)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 4, 8, 12, 16, 20, 24]
    # the held-out loss: before the first step, every eval.interval steps and at the end, falling
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [step for step, _ in evals] == [0, 12, 24] and "loss" not in records[0]
    assert evals[2][1] < evals[1][1] < evals[0][1] and evals[2][1] < 0.8 * evals[0][1], evals
    assert records[-1]["eval_ppl"] == pytest.approx(math.exp(evals[2][1])) and records[-1]["eval_tokens"] == 4 * 8 * 128
    assert json.loads((out / "best_eval.json").read_text()) == {"step": 24, "eval_loss": evals[2][1]}
    assert "eval 5." in result.stderr  # the step-0 evaluation on the console
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "hfu", "memory_gb", "data_wait_s"):
        assert key in records[-1]
    if not torch.cuda.is_available():
        assert records[-1]["mfu"] is None  # CPU: no known peak, so no made-up MFU
    assert records[-1]["loss"] < records[1]["loss"] - 1.5, [r.get("loss") for r in records]

    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step-00000024"]  # keep_latest=1 pruned step 20 once 24 was whole
    assert (out / "checkpoints" / "step-00000024" / "COMPLETE").is_file()
    if importlib.util.find_spec("wandb") is not None:  # optional: machines without it train all the same
        assert list((out / "wandb").glob("offline-run-*")), "an offline W&B run is written next to the metrics"
