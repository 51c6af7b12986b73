"""One rank's start-up error ends every rank within seconds, with that rank's message (srun-style
launches; torchrun's agent already ends the others); ranks started with different settings stop,
naming them."""

import random
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.fault_record import report
from tests.helpers.flags import LAUNCH
from tests.helpers.launch import clean_env
from trillion.errors import RunAborted
from trillion.trainer.launch import rendezvous


def srun(per_rank_args: list[list[str]], tmp_path, **env):
    """Start one process per entry, as `srun -n N python -m trillion train` would; (codes, stderrs, seconds)."""
    job, start = str(random.randint(1000, 9999)), time.monotonic()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trillion",
                "train",
                *LAUNCH,
                f"--job.output_dir={tmp_path / 'run'}",
                "--job.collective_timeout_s=300",
                *args,
            ],
            env=clean_env(
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
                SLURM_NTASKS=str(len(per_rank_args)),
                SLURM_JOB_ID=job,
                SLURM_STEP_NODELIST="localhost",
                **env,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, args in enumerate(per_rank_args)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    return [p.returncode for p in procs], errs, time.monotonic() - start


def test_a_bad_flag_on_one_rank_ends_both_within_60_s(tmp_path):
    codes, errs, seconds = srun([[], ["--optimizer.lr=-1"]], tmp_path, SLURM_STEP_TASKS_PER_NODE="2")
    assert codes == [2, 2] and seconds < 60, (codes, seconds, errs)
    assert "optimizer.lr=-1.0" in errs[1] and "Traceback" not in errs[1]
    assert "Rank 1 of 2: optimizer.lr=-1.0" in errs[0] and "Traceback" not in errs[0]  # rank 0 says who and why
    report(
        "one rank fails at start",
        errs[0].strip().splitlines()[-1],
        0,
        None,
        seconds,
        "srun-style start of 2 ranks, rank 1 with --optimizer.lr=-1: both exit 2; time from launch to both exited",
    )


def test_a_launch_error_on_rank_1_ends_rank_0(tmp_path):
    """The issue's case: two nodes' worth of tasks without SLURM's tasks-per-node count, so rank 1
    derives LOCAL_WORLD_SIZE=1 and refuses; rank 0 used to wait in the rendezvous until killed."""
    codes, errs, seconds = srun([[], []], tmp_path, SLURM_NNODES="2")
    assert codes == [2, 2] and seconds < 60, (codes, seconds, errs)
    assert "LOCAL_RANK=1" in errs[1] and "Rank 1 of 2" in errs[0]


def test_ranks_with_different_settings_name_them(tmp_path):
    codes, errs, _ = srun([["--training.steps=4"], ["--training.steps=5"]], tmp_path, SLURM_STEP_TASKS_PER_NODE="2")
    assert codes == [2, 2], errs
    assert all("training.steps differ" in err and "Traceback" not in err for err in errs)


def test_a_taken_rendezvous_port_is_one_paragraph():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RunAborted, match="cannot host the rendezvous .* set MASTER_PORT to a free one"):
            rendezvous.join(0, 2, "127.0.0.1", taken.getsockname()[1], timeout_s=5)
