"""The job scripts' answer to SLURM's time-limit warning (experiments/slurm/requeue.sh), run by bash with SLURM's
commands replaced by recorders: SIGUSR1 to the batch shell is sent on to the job's steps, the shell waits for
them to save and exit, and only then requeues the job; without the warning it neither signals nor requeues."""

import signal
import subprocess
import time
from pathlib import Path

from tests.helpers.slurm_stubs import ROOT, stubbed

STUBS = {
    "scontrol": 'if [ "$1" = show ]; then echo node1; else echo "scontrol $*" >> "$RECORD"; fi',
    # the step: `trillion torchrun` stands in, which saves on SIGUSR1, says so and exits 0
    "srun": 'trap \'echo "step saved" >> "$RECORD"; exit 0\' USR1; echo $$ > "$RECORD.step"; '
    'for i in $(seq "$STEP_TICKS"); do sleep 0.1; done; echo "step ran to its end" >> "$RECORD"',
    "scancel": 'echo "scancel $*" >> "$RECORD"; kill -USR1 "$(cat "$RECORD.step")"',
}


def start(tmp_path: Path, ticks: int = 600) -> tuple[subprocess.Popen, Path]:
    """nvidia.sbatch under the stubs, once its step runs; the step ends by itself after `ticks` tenths of a second."""
    env, record = stubbed(tmp_path, STUBS, SLURM_JOB_NODELIST="node1", SLURM_NNODES="1", STEP_TICKS=str(ticks))
    script = ROOT / "experiments" / "slurm" / "nvidia.sbatch"
    job = subprocess.Popen(["bash", str(script), "my.toml"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not Path(f"{record}.step").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return job, record


def test_the_time_limit_warning_reaches_the_steps_and_requeues_after_they_saved(tmp_path):
    job, record = start(tmp_path)
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert record.read_text().splitlines() == ["scancel --signal=USR1 77", "step saved", "scontrol requeue 77"]
    assert b"time limit near" in out


def test_without_the_warning_the_job_neither_signals_nor_requeues(tmp_path):
    job, record = start(tmp_path, ticks=3)
    job.communicate(timeout=60)
    assert job.returncode == 0 and record.read_text().splitlines() == ["step ran to its end"]
