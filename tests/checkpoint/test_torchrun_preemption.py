"""A preempted torchrun job ends cleanly: SIGUSR1, then SIGTERM, sent to `trillion torchrun` (the command the guides
give for torchrun and SLURM jobs) while its two ranks train, each saves after the step it lands in and the command
exits 0 with a `preempted, saved` line a job script can test; the same command run again resumes, on the losses of
an unbroken run bitwise. (Plain torchrun exits 1 with a traceback after SIGTERM, and SIGUSR1 kills
it: its agent handles the first and not the second.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.fault_record import first_step_time, report
from tests.helpers.flags import TINY
from tests.helpers.runs import checkpoints, losses, run
from tests.helpers.spawn import as_launched, run_ranks

ROOT = Path(__file__).parents[2]
FLAGS = [*TINY, "--parallel.dp_shard=2", "--training.steps=6"]


def _straight(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "straight", "--parallel.dp_shard=2", steps=6)


def preempted(out: Path, scratch: Path, signum, hold_at: int) -> tuple[subprocess.CompletedProcess, float]:
    """`trillion torchrun` of the run, its ranks held in their `hold_at`-th step until `signum` has reached the
    command; returns what it printed and when the signal was sent."""
    release, held = scratch / "release", scratch / "held"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
        "HOLD_AT_STEP": str(hold_at),
        "RELEASE_FILE": str(release),
        "HELD_FILE": str(held),
    }
    command = [sys.executable, "-m", "trillion", "torchrun", "--standalone", "--nproc-per-node=2"]
    entry = str(ROOT / "tests" / "entries" / "hold_entry.py")
    job = subprocess.Popen(
        [*command, entry, *FLAGS, f"--job.output_dir={out}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 240
    while not all(Path(f"{held}.{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        assert job.poll() is None, job.communicate()
        time.sleep(0.2)
    sent = time.time()
    job.send_signal(signum)
    time.sleep(0.5)
    release.touch()
    stdout, stderr = job.communicate(timeout=300)
    for path in (release, *scratch.glob("held.*")):
        path.unlink(missing_ok=True)
    return subprocess.CompletedProcess(job.args, job.returncode, stdout.decode(), stderr.decode()), sent


def test_sigusr1_and_sigterm_to_trillion_torchrun_save_exit_0_and_resume_bitwise(tmp_path):
    out = tmp_path / "run"
    # SIGUSR1 inside step 2: the ranks agree on it after step 3, save it and exit 0
    first, first_signal = preempted(out, tmp_path, signal.SIGUSR1, hold_at=2)
    assert first.returncode == 0, first.stderr[-3000:]
    line = f"preempted, saved: SIGUSR1 at step 3 of 6, checkpoint {out / 'checkpoints' / 'step-00000003'}"
    assert first.stdout.strip() == f"{line}; the same command continues the run.", first.stdout
    assert checkpoints(out) == ["step-00000003"] and "Traceback" not in first.stderr
    # the same command: resumes at step 4; SIGTERM inside it stops the job after step 5
    second, _ = preempted(out, tmp_path, signal.SIGTERM, hold_at=1)
    assert second.returncode == 0 and "resumed from" in second.stderr, second.stderr[-3000:]
    assert second.stdout.startswith("preempted, saved: SIGTERM at step 5 of 6"), second.stdout
    assert checkpoints(out)[-1] == "step-00000005" and "Traceback" not in second.stderr
    run_ranks(_straight, 2, tmp_path)  # the unbroken run: the resumed steps 4 and 5 are its own, bit for bit
    assert losses(out) == losses(tmp_path / "straight")[:5] and [step for step, _ in losses(out)] == [1, 2, 3, 4, 5]
    report(
        "SIGTERM to torchrun (trillion torchrun)",
        second.stdout.strip().replace(str(out), "<output_dir>") + " (exit 0; torchrun alone: exit 1 and its traceback)",
        0,
        True,
        first_step_time(out / "metrics.jsonl", 4) - first_signal,
        "SIGUSR1 to `trillion torchrun --nproc-per-node=2` (FSDP) inside step 2, the same command again, SIGTERM "
        "inside its first step (recover: from the SIGUSR1 to the resumed job's first step)",
    )
