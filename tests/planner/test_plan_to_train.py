"""The file `trillion plan --config-out` writes runs as is: `trillion estimate --config FILE` and `trillion train
--config FILE` (launched with the planned number of processes) need no flag added; it carries the world size, the
hardware and the steps of the token budget. A launch of another size is refused, naming the setting."""

import json
import os
import subprocess

from tests.helpers.launch import TORCHRUN, clean_env
from trillion.trainer.cli.main import main
from trillion.trainer.config.schema import load_config

PLAN = ["plan", "--model", "debug-moe", "--hardware", "dgx-h100", "--gpus", "2", "--global-batch", "4"]
PLAN += ["--seq-len", "64", "--tokens", "512", "--top", "1"]  # 512 tokens = 2 steps of 4 x 64


def test_plan_then_estimate_then_train_with_no_flags_added(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*PLAN, "--config-out", "plan.toml"]) == 0
    config = load_config("plan.toml")
    assert (config.job.world_size, config.job.hardware, config.training.steps) == (2, "dgx-h100", 2)
    capsys.readouterr()
    assert main(["estimate", "--config", "plan.toml", "--format", "json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["world_size"] == 2 and estimate["device"] == "h100" and estimate["error"] is None

    assert main(["train", "--config", "plan.toml"]) == 2  # one process: not what the plan is for
    err = capsys.readouterr().err
    assert "job.world_size=2" in err and "started 1" in err and "Launch 2 processes" in err

    env = clean_env(OMP_NUM_THREADS="1")
    run = subprocess.run(
        [*TORCHRUN, "--nproc-per-node", "2", "-m", "trillion", "train", "--config", "plan.toml"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in open(os.path.join(config.job.output_dir, "metrics.jsonl"))]
    assert max(r["step"] for r in records) == 2
