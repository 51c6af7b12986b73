"""Multi-process launches as users start them: srun-style (SLURM variables, no torchrun) and torchrun."""

import json
import os
import random
import subprocess
import sys

from tests.helpers.fault_record import report
from tests.helpers.flags import LAUNCH
from tests.helpers.launch import clean_env
from tests.helpers.wandb_records import offline_run


def test_srun_style_launch_trains_and_logs_from_one_rank(tmp_path):
    """Two tasks with only SLURM's variables, as `srun -n 2 python -m trillion train` starts them."""
    out = tmp_path / "run"
    job = str(random.randint(1000, 9999))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trillion", "train", *LAUNCH, f"--job.output_dir={out}"],
            env=clean_env(
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
                SLURM_NTASKS="2",
                SLURM_JOB_ID=job,
                SLURM_STEP_NODELIST="localhost",
                SLURM_STEP_TASKS_PER_NODE="2",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 4]  # written once, by rank 0 (the step-0 evaluation aside)
    run = offline_run(out)
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1, "only one rank writes the W&B run"
    assert [row["loss"] for row in run["history"] if "loss" in row] == [r["loss"] for r in records]
    assert run["config"]["config"]["parallel"]["dp_shard"] == 2


def test_torchrun_launch_with_profiling_writes_a_trace_per_rank(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "trillion",
            "train",
            *LAUNCH,
            f"--job.output_dir={out}",
            "--logging.wandb=false",
            "--profiling.enabled=true",
            "--profiling.wait=1",
            "--profiling.warmup=1",
            "--profiling.active=1",
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    traces = sorted(p.name for p in (out / "profiles").iterdir())
    assert traces == ["trace-rank0-step3.json", "trace-rank1-step3.json"]
    for trace in (out / "profiles").iterdir():
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("ProfilerStep#") for e in events)
        assert any(e.get("name") == "aten::mm" or e.get("name") == "aten::addmm" for e in events)
    # Records of steps 1, 2 and 4 (log_freq 2). Step 4's phases were timed inside step 4, which the
    # record's step_time_s + data_wait_s average over with step 3; the checkpoint time is that of
    # steps 2 and 3's saves (a poll each), between the writes of the step-2 and step-4 records.
    previous, last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[-2:]]
    assert (previous["step"], last["step"]) == (2, 4)
    phases = {phase: last[f"time_{phase}_s"] for phase in ("data", "forward_backward", "optimizer")}
    assert all(seconds > 0 for seconds in phases.values()), phases
    assert sum(phases.values()) <= 2 * (last["step_time_s"] + last["data_wait_s"]), (phases, last)
    assert 0 < last["time_checkpoint_s"] <= last["time"] - previous["time"], last
    assert last["time_forward_backward_s"] > last["time_data_s"]


def test_a_hung_rank_ends_the_job_with_the_step_and_rank(tmp_path):
    out = tmp_path / "run"
    # Its own folder: a script run from tests/ would find tests/kernels/ before the kernels package.
    entry = os.path.join(os.path.dirname(__file__), "entries", "stall_entry.py")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            entry,
            *LAUNCH,
            f"--job.output_dir={out}",
            "--logging.wandb=false",
            "--job.collective_timeout_s=5",
        ],
        env=clean_env(STALL_AT_STEP="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "Rank 0 of 2: a collective did not complete within job.collective_timeout_s=5 s in step 2" in result.stderr
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    report(
        "stalled rank (collective timeout)",
        next(line for line in result.stderr.splitlines() if "Rank 0 of 2" in line),
        None,
        None,
        None,
        "rank 1 of 2 sleeps 120 s in step 2, job.collective_timeout_s=5: every rank ends (exit 1) "
        "instead of hanging; the same command then resumes from the newest checkpoint, as in the SIGKILL rows",
    )
