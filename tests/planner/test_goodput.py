"""Goodput under failures (parallel/planner/goodput.py): the Young/Daly arithmetic against a worked example,
the figures `trillion plan` and `trillion estimate` print, and the trainer's warning about checkpoint.interval."""

import json
import logging
import math

import pytest

from tests.helpers.runs import run
from trillion.parallel.planner.goodput import (
    MTBF_HOURS_PER_GPU,
    Goodput,
    daly_goodput,
    daly_interval,
    interval_advice,
    young_interval,
)
from trillion.trainer.cli.main import main as trillion


def test_young_daly_against_a_worked_example():
    # A save blocks 5 min (delta = 300 s), the job fails once a day (M = 86,400 s). By hand:
    # Young: sqrt(2 x 300 x 86,400) = sqrt(51,840,000) = 7,200 s.
    # Daly: delta / 2M = 1/576, its root 1/24: 7,200 x (1 + 1/72 + 1/5,184) - 300 = 7,200 x 5,257/5,184 - 300
    #       = 7,301.389 - 300 = 7,001.389 s.
    assert young_interval(300, 86_400) == 7_200
    assert daly_interval(300, 86_400) == pytest.approx(7_001.389, abs=1e-3)
    assert daly_interval(200_000, 86_400) == 86_400  # a save longer than 2M: Daly's tau = M
    # Daly's interval is where his complete model's goodput peaks (restart R = 10 min) ...
    best = daly_goodput(7_001.389, 300, 600, 86_400)
    assert all(daly_goodput(tau, 300, 600, 86_400) < best for tau in (5_000, 6_500, 7_500, 9_000))
    # ... and is, by hand: R/M = 600/86,400 = 0.0069444, e^(R/M) = 1.0069686; (tau + delta)/M = 7,301.389/86,400 =
    # 0.0845068, e^x - 1 = x + x^2/2 + x^3/6 + x^4/24 = 0.0881802; wall time per unit of work
    # 86,400 x 1.0069686 x 0.0881802 / 7,001.389 = 7,671.86 / 7,001.389, so goodput 0.91261.
    assert best == pytest.approx(0.91261, abs=1e-5)


def test_failures_per_day_from_the_llama3_count():
    # 419 unexpected interruptions in 54 days on 16,384 H100s: 7.76 a day at that size, 1.45 on 3,072 GPUs
    assert MTBF_HOURS_PER_GPU == pytest.approx(50_677, abs=1)
    assert Goodput(16_384, MTBF_HOURS_PER_GPU, 60, 600, 10, 2, 1).failures_per_day == pytest.approx(419 / 54)
    assert Goodput(3_072, MTBF_HOURS_PER_GPU, 60, 600, 10, 2, 1).failures_per_day == pytest.approx(1.4549, abs=1e-4)


def test_fault_tolerant_groups_lose_less_than_restarts():
    job = Goodput(4_096, 50_000, save_s=30, restart_s=600, step_s=10, groups=4, heal_s=5)
    assert job.fault_tolerant_goodput > job.restart_goodput
    lost = (10 + 5 + 600 / 4) / job.mtbf_s  # per failure: the step retried, the heal, a quarter of the job away
    assert job.fault_tolerant_goodput == pytest.approx(job.interval_s / (job.interval_s + 30) * (1 - lost))


def test_interval_advice_only_when_far_from_the_optimum():
    # 1 GPU failing every 0.01 h (36 s), a save of 0.5 s, 0.1 s steps: sqrt(2 x 0.5 x 36) = 6 s,
    # x (1 + sqrt(1/144)/3 + (1/144)/9) - 0.5 = 5.67 s = 57 steps
    assert daly_interval(0.5, 36) == pytest.approx(5.6713, abs=1e-4)
    message = interval_advice(500, 0.1, 0.5, 1, 0.01, steps_left=1_000)
    assert "checkpoint.interval=500 is far from the Young/Daly optimum" in message
    assert "--checkpoint.interval=57" in message
    assert interval_advice(60, 0.1, 0.5, 1, 0.01, steps_left=1_000) is None  # within a factor 2
    assert interval_advice(500, 0.1, 0.5, 1, 0.01, steps_left=50) is None  # the optimum is past the run's end


SAVES_ONCE = "--checkpoint.save_final=false"  # the save of step 3 only


def test_the_trainer_warns_once_after_its_first_save(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="trillion"):
        # a GPU failing every 0.4 ms: any save costs more than that, so every step should be saved (Daly: tau = M)
        run(tmp_path / "far", "--checkpoint.interval=3", "--checkpoint.mtbf_hours_per_gpu=1e-7", SAVES_ONCE, steps=5)
    warned = [r.getMessage() for r in caplog.records if "Young/Daly" in r.getMessage()]
    assert len(warned) == 1 and "checkpoint.interval=3 is far" in warned[0] and "--checkpoint.interval=1" in warned[0]


PLAN = ["plan", "--model", "gpt-22b", "--hardware", "frontier", "--gpus", "16", "--global-batch", "640"]
FAILURES = ["--mtbf-hours-per-gpu", "1000", "--checkpoint-save-s", "20", "--restart-s", "300", "--ft-groups", "2"]


def test_plan_prints_failures_interval_and_goodput(capsys):
    assert trillion([*PLAN, *FAILURES, "--top", "1", "--format", "json", "--config-out", ""]) == 0
    figures = json.loads(capsys.readouterr().out)["goodput"]
    mtbf_s = 1000 * 3600 / 16
    assert figures["failures_per_day"] == pytest.approx(24 * 16 / 1000)
    assert figures["checkpoint_interval_s"] == pytest.approx(daly_interval(20, mtbf_s))
    assert figures["goodput_restart"] == pytest.approx(daly_goodput(daly_interval(20, mtbf_s), 20, 300, mtbf_s))
    assert figures["goodput_fault_tolerant"] > figures["goodput_restart"]
    assert trillion([*PLAN, *FAILURES, "--top", "1", "--config-out", ""]) == 0
    table = capsys.readouterr().out
    assert "0.38 a day expected on 16 GPUs" in table and "checkpoint interval (Young/Daly)" in table
    assert "with 2 fault-tolerant replica groups" in table


@pytest.mark.parametrize("flag", [["--mtbf-hours-per-gpu", "0"], ["--ft-groups", "1"], ["--restart-s", "-5"]])
def test_plan_refuses_bad_failure_settings(flag, capsys):
    assert trillion([*PLAN, *flag, "--config-out", ""]) == 2
    err = capsys.readouterr().err
    assert flag[0] in err and "Traceback" not in err


def test_estimate_prices_the_measured_checkpoint(capsys):
    argv = ["estimate", "--model", "debug", "--world-size", "2", "--hardware", "dgx-h100", "--format", "json"]
    assert trillion([*argv, "--mtbf-hours-per-gpu", "10", "--restart-s", "60"]) == 0
    result = json.loads(capsys.readouterr().out)
    figures = result["goodput"]
    # the dry run's measured shard: its fp32 master weights and its optimizer state
    saved = max(4 * rank["parameter_count"] + rank["optimizer"] for rank in result["ranks"])
    assert figures["gpus"] == 2 and figures["failures_per_day"] == pytest.approx(24 * 2 / 10)
    assert figures["save_s"] == pytest.approx(saved / 1e9)  # at the assumed 1 GB/s per GPU
    assert figures["step_s"] > 0 and math.isfinite(figures["goodput_fault_tolerant"])


GPT_1T = "--model gpt-1t --hardware frontier --gpus 3072 --global-batch 3072 --tp 4 --pp 128 --cp 1 --dp-shard 6"
KIMI = "--model kimi-k2 --hardware dgx-h100 --gpus 4096 --global-batch 4096 --seq-len 4096 --tokens 15.5e12"


@pytest.mark.parametrize(
    ("argv", "figures"),
    [
        (
            f"{GPT_1T} --dp-replicate 1 --micro-batch-size 1 --tokens 20e12",
            ["1.45 a day expected on 3,072 GPUs", "every 12.3 min of training = 3 steps", "97.8% restarting", "98.4%"],
        ),
        pytest.param(
            KIMI,
            ["1.94 a day expected on 4,096 GPUs", "every 8.9 min of training = 145 steps", "97.5% restarting", "98.7%"],
            marks=pytest.mark.slow,  # a search over MoE layouts: half a minute
        ),
    ],
    ids=["gpt-1t-3072-mi250x", "kimi-k2-4096-h100"],
)
def test_the_guides_goodput_figures(argv, figures, capsys):
    assert trillion(["plan", *argv.split(), "--top", "1", "--config-out", ""]) == 0
    out = capsys.readouterr().out
    assert all(figure in out for figure in figures), out[-800:]
