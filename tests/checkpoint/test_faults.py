"""The fault matrix, part 1 (one process): preemption by SIGTERM or SIGUSR1 mid-step, SIGKILL during
a synchronous and during an async save, an unreachable W&B server. Each run is restarted by the same
command and must end on the unbroken run's losses bitwise, losing at most the steps since the last
checkpoint; each reports to the matrix (tests/helpers/fault_record.py). The other faults report from their
own tests: test_verify (corrupted checkpoint), test_atomic (disk full), test_guards (NaN gradient),
test_distributed (a rank killed under torchrun), tests/test_launch.py (a stalled rank),
tests/test_fail_fast.py (a rank failing at start)."""

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.fault_record import first_step_time, last_line, report
from tests.helpers.flags import TINY
from tests.helpers.runs import checkpoints, losses, run
from trillion.trainer.cli.main import main
from trillion.trainer.step import train_step
from trillion.trainer.train import RunHooks


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_after_the_step_and_exits_0(signum, straight, tmp_path, monkeypatch, caplog):
    _, expected = straight
    out, calls, sent = tmp_path / "run", [], []

    def signalled_step(*args, **kwargs):  # the scheduler's signal arrives in the middle of step 3
        calls.append(1)
        if len(calls) == 3:
            sent.append(time.time())
            os.kill(os.getpid(), signum)
        return train_step(*args, **kwargs)

    with caplog.at_level(logging.INFO, logger="trillion"):
        hooks = RunHooks(step=signalled_step)
        assert main(["train", *TINY, "--training.steps=6", f"--job.output_dir={out}"], hooks=hooks) == 0
    assert checkpoints(out) == ["step-00000003"] and losses(out) == expected[:3]
    run(out)  # the same command resumes
    assert losses(out) == expected
    report(
        f"{signum.name} (preemption)",
        last_line(caplog.text, f"{signum.name} received")
        + "; then "
        + last_line(caplog.text, "checkpoint saved, exiting"),
        0,
        True,
        first_step_time(out / "metrics.jsonl", 4) - sent[0],
        "signal sent to the process during step 3; the same command run again",
    )


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_sigkill_during_a_save_loses_only_the_steps_since_the_last_checkpoint(mode, straight, tmp_path):
    _, expected = straight
    out, stamp = tmp_path / "run", tmp_path / "killed-at"
    saving = ["--checkpoint.interval=2", f"--checkpoint.async_mode={mode}"]
    result = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("kill_entry.py")),
            *TINY,
            *saving,
            "--training.steps=6",
            f"--job.output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KILL_ON_SAVE": "2", "FAULT_STAMP": str(stamp)},
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    reached = losses(out)[-1][0]  # the save of step 4 was being written
    assert checkpoints(out)[-1] == "step-00000002"  # never a half-written step-4
    run(out, *saving)
    assert losses(out) == expected
    report(
        f"SIGKILL during {'a synchronous' if mode == 'disabled' else 'an async'} save",
        "the process dies (exit -9); the next start logs 'removed 1 unfinished checkpoint directory' and "
        "'resumed from .../step-00000002'",
        reached - 2,
        True,
        first_step_time(out / "metrics.jsonl", 3) - float(stamp.read_text()),
        f"SIGKILL while writing step 4's checkpoint (checkpoint.interval=2, async_mode={mode}); same command again",
    )


def test_unreachable_wandb_server_costs_one_timeout_and_nothing_else(straight, tmp_path, monkeypatch, caplog):
    _, expected = straight
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    start = time.time()
    run(
        tmp_path / "run",
        "--logging.wandb=true",
        "--logging.wandb_project=trillion-test",
        "--logging.wandb_init_timeout_s=3",
    )
    assert losses(tmp_path / "run") == expected
    report(
        "W&B server unreachable",
        last_line(caplog.text, "offline") or "a warning, then the run is written offline",
        0,
        True,
        first_step_time(tmp_path / "run" / "metrics.jsonl", 1) - start,
        "WANDB_BASE_URL at a closed port, logging.wandb_init_timeout_s=3 (recover: start to the first step)",
    )
