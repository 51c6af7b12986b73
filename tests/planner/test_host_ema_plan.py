"""The parameters' average in host memory (optimizer.ema_decay, parallel/host_ema.py) as `trillion plan --ema-decay`
and `trillion estimate` price it: no GPU memory, 8 bytes of host memory a parameter of the rank's shard (a float32
average and a staging copy of the fp32 master weights), the average saved with the checkpoint; the planner's shard
is the one the dry run measures from the trainer's own sharded parameters."""

import json

import pytest
import tomllib

from trillion.trainer.cli.main import main as trillion

PLAN = ["plan", "--model", "debug", "--hardware", "dgx-h100", "--gpus", "2", "--global-batch", "8", "--seq-len", "256"]
LAYOUT = ["--dp-shard", "2", "--tp", "1", "--pp", "1", "--dp-shard-mode", "zero3", "--checkpoint-save-s", "1e-3"]


def _plan(capsys, *flags: str) -> dict:
    assert trillion([*PLAN, *LAYOUT, *flags, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_prices_the_average_on_the_shard_the_dry_run_measures(tmp_path, capsys):
    plain = _plan(capsys, "--config-out", "")
    averaged = _plan(capsys, "--ema-decay", "0.99", "--config-out", str(tmp_path / "plan.toml"))
    assert tomllib.loads((tmp_path / "plan.toml").read_text())["optimizer"]["ema_decay"] == 0.99
    assert trillion(["estimate", "--config", str(tmp_path / "plan.toml"), "--world-size", "2", "--format", "json"]) == 0
    measured = max(rank["parameter_count"] for rank in json.loads(capsys.readouterr().out)["ranks"])
    best = averaged["candidates"][0]
    assert best["host_ema_gb"] == pytest.approx(8 * measured / 1e9)  # average and staging copy, float32 each
    assert best["memory_gb"] == plain["candidates"][0]["memory_gb"]  # none of it on the GPU
    assert "host_ema_gb" not in plain["candidates"][0]
    # the checkpoint saves the average beside the master weights and the moments: --checkpoint-save-s is given, so
    # the heal (a peer's copy of the checkpoint over the link) shows the bytes
    link = 400e9 / 8  # dgx-h100: node_bandwidth_gbs over gpus_per_node, bytes a second
    extra = (averaged["goodput"]["heal_s"] - plain["goodput"]["heal_s"]) * link
    assert extra == pytest.approx(4 * measured, rel=1e-6)


def test_the_plan_and_the_estimate_print_the_host_memory(tmp_path, capsys):
    assert trillion([*PLAN, *LAYOUT, "--ema-decay", "0.99", "--config-out", str(tmp_path / "plan.toml")]) == 0
    table = capsys.readouterr().out
    assert "parameter average in host memory (optimizer.ema_decay 0.99)" in table and "a node of 8 GPUs" in table
    argv = ["estimate", "--config", str(tmp_path / "plan.toml"), "--world-size", "2", "--hardware", "dgx-h100"]
    assert trillion(argv) == 0
    assert "# parameter average in host memory (optimizer.ema_decay 0.99)" in capsys.readouterr().out


@pytest.mark.parametrize("decay", ["1", "-0.5"])
def test_a_decay_outside_zero_to_one_is_refused(decay, capsys):
    assert trillion([*PLAN, "--ema-decay", decay, "--config-out", ""]) == 2
    err = capsys.readouterr().err
    assert f"--ema-decay {float(decay):g} must be in [0, 1)" in err and "Traceback" not in err
