"""One run directory, one writer, and what a person at the keyboard does to a run: two jobs started on
one job.output_dir (the second exits 2 naming the first, which trains on untouched), Ctrl-C once (saves
after the step, exits 130 with one line, the same command resumes) and twice (stops at once), a refused
resume that must leave config.toml as it was, and the run directories a fresh start refuses. Real
subprocesses, as a user runs them; the two-jobs and Ctrl-C rows report to the fault matrix."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.fault_record import first_step_time, report
from tests.helpers.flags import TINY
from tests.helpers.runs import checkpoints, losses, run
from trillion.trainer.cli.main import main

ENTRIES = Path(__file__).resolve().parents[1] / "entries"


def wait_for_step(out: Path, step: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and any(
            json.loads(line).get("step", 0) >= step for line in metrics.read_text().split("\n")[:-1]
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not logged in {timeout_s} s")


def test_a_second_job_on_a_run_directory_exits_2_naming_the_first(tmp_path):
    out, steps = tmp_path / "run", 12
    args = [*TINY, f"--training.steps={steps}", "--checkpoint.interval=4", f"--job.output_dir={out}"]
    release = tmp_path / "release"  # the first job waits in step 3 until the second has been refused
    first = subprocess.Popen(
        [sys.executable, str(ENTRIES / "hold_entry.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HOLD_AT_STEP": "3", "RELEASE_FILE": str(release)},
    )
    wait_for_step(out, 1, first)
    start = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "trillion", "train", *args], capture_output=True, text=True, timeout=120
    )
    refused_s = time.monotonic() - start
    release.touch()
    assert second.returncode == 2, second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    assert "is in use by another job" in second.stderr and f"PID {first.pid}" in second.stderr
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # no torn line
    assert [r["step"] for r in records if "loss" in r] == list(range(1, steps + 1))  # one writer: each step once
    assert checkpoints(out) == ["step-00000008", "step-00000012"]
    assert (out / ".trillion.lock").read_text() == ""  # a clean exit leaves no holder
    report(
        "Two jobs on one run directory",
        second.stderr.strip().splitlines()[-1].split(" (host ")[0].replace(str(out), "<output_dir>")
        + " (host, PID, start time); exit 2",
        0,
        None,
        refused_s,
        "a second `trillion train` with the same job.output_dir while the first trains; the first runs on untouched "
        "(recover: the second's start to its refusal)",
    )


def test_ctrl_c_saves_after_the_step_exits_130_and_the_same_command_resumes(straight, tmp_path):
    _, expected = straight
    out = tmp_path / "run"
    args = [*TINY, "--training.steps=6", f"--job.output_dir={out}"]
    env = {**os.environ, "INTERRUPT_AT_STEP": "3"}
    interrupted = subprocess.run(
        [sys.executable, str(ENTRIES / "interrupt_entry.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    sent = time.time()
    assert interrupted.returncode == 130, interrupted.stderr[-2000:]
    assert "Traceback" not in interrupted.stderr
    last = interrupted.stderr.strip().splitlines()[-1]
    assert last.startswith("trillion train: interrupted (Ctrl-C) after step 3 of 6"), last
    assert checkpoints(out) == ["step-00000003"] and losses(out) == expected[:3]
    run(out)  # the same command
    assert losses(out) == expected
    report(
        "Ctrl-C (SIGINT) once",
        last.replace("trillion train: ", "") + " (exit 130)",
        0,
        True,
        first_step_time(out / "metrics.jsonl", 4) - sent,
        "SIGINT during step 3 of a 6-step run (checkpoint.interval=0); the same command run again",
    )


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "INTERRUPT_AT_STEP": "2", "INTERRUPT_TIMES": "2"}
    result = subprocess.run(
        [sys.executable, str(ENTRIES / "interrupt_entry.py"), *TINY, "--training.steps=6", f"--job.output_dir={out}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 130, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "trillion train: interrupted again (Ctrl-C): stopped at once, without saving this step"
    )
    assert not (out / "checkpoints").exists() or checkpoints(out) == []


def test_a_refused_resume_leaves_config_toml_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    run(out, steps=2)
    before = (out / "config.toml").read_text()
    start = time.monotonic()
    assert main(["train", *TINY, "--training.steps=4", f"--job.output_dir={out}", "--model.n_layers=2"]) == 2
    err = capsys.readouterr().err
    assert "Cannot resume" in err
    assert (out / "config.toml").read_text() == before
    assert main(["train", "--config", str(out / "config.toml"), "--training.steps=3"]) == 0  # the rerun recipe
    report(
        "Refused resume",
        err.strip().split(". ")[0].replace(str(out), "<output_dir>") + "; config.toml unchanged (exit 2)",
        0,
        None,
        time.monotonic() - start,
        "a finished 2-step run started again with --model.n_layers=2, then `trillion train --config RUN/config.toml` "
        "(recover: the refused start to the rerun's end)",
    )


def test_a_config_toml_that_does_not_parse_is_named_not_replaced(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("[model\nname = 'debug'\n")
    assert main(["train", *TINY, "--training.steps=1", f"--job.output_dir={out}"]) == 2
    assert f"{out / 'config.toml'} does not parse" in capsys.readouterr().err
    assert (out / "config.toml").read_text() == "[model\nname = 'debug'\n"


def test_a_fresh_start_over_an_earlier_runs_metrics_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    run(out, "--checkpoint.save_final=false", steps=2)  # metrics, no checkpoint
    records = (out / "metrics.jsonl").read_text()
    assert main(["train", *TINY, "--training.steps=2", f"--job.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "holds the metrics of an earlier run but no checkpoint" in err and "--job.overwrite=true" in err
    assert (out / "metrics.jsonl").read_text() == records
    run(out, "--job.overwrite=true", steps=3)
    assert [step for step, _ in losses(out)] == [1, 2, 3]


def test_an_output_folder_that_cannot_be_made_is_refused_before_any_work(capsys):
    # /proc exists, so the config's folder check lets it through; creating the folder is what fails
    assert main(["train", *TINY, "--training.steps=1", "--job.output_dir=/proc/forbidden/run"]) == 2
    assert "job.output_dir=/proc/forbidden/run cannot be used as a run directory" in capsys.readouterr().err


def test_a_dead_holders_lock_is_taken_over_with_a_log_line(tmp_path, caplog):
    out = tmp_path / "run"
    code = (  # a job killed while it held the lock: the OS drops the lock, the file still names the holder
        "import os, signal, sys; from trillion.trainer.launch import RunDirectoryLock; "
        "RunDirectoryLock(sys.argv[1]).acquire(); os.kill(os.getpid(), signal.SIGKILL)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)])
    assert holder.wait(timeout=60) == -signal.SIGKILL
    with caplog.at_level("WARNING", logger="trillion"):
        run(out, steps=1)
    assert "took over the run-directory lock of a job that is gone" in caplog.text
    assert f"PID {holder.pid}" in caplog.text
