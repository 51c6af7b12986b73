"""Multi-process gloo: exact resume under FSDP (with async saves); torchrun --max-restarts bringing
back a killed rank; a checkpoint saved at dp_shard 2 x tp 2 (4 ranks) loaded at dp_shard 2 (2 ranks)
and in one process: model and optimizer equal after load, and training continues on the same loss
curve."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.fault_record import first_step_time, report
from tests.helpers.flags import TINY
from tests.helpers.runs import losses, read_checkpoint, run
from tests.helpers.spawn import as_launched, run_ranks
from trillion.trainer.cli.main import main
from trillion.trainer.train import RunHooks

FSDP = ["--parallel.dp_shard=2"]
FSDP_TP = ["--parallel.dp_shard=2", "--parallel.tp=2"]


def _exact_resume(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "straight", *FSDP, steps=4)
    saving = ["--checkpoint.async_mode=async", "--checkpoint.interval=1"]  # async writes beside FSDP's collectives
    run(root / "chained", *FSDP, *saving, "--training.exit_interval=2", steps=4)
    run(root / "chained", *FSDP, *saving, steps=4)
    # lr 0: the step leaves the weights as loaded, each rank keeping its shards of the full tensors
    run(root / "from-hf", *FSDP, f"--checkpoint.initial_load={root / 'hf'}", "--optimizer.lr=0", steps=1)


def test_fsdp_resume_is_exact_and_starts_from_hf_weights(tmp_path):
    run(tmp_path / "source", steps=1)
    assert main(["export", "--checkpoint", str(tmp_path / "source"), "--format", "hf", str(tmp_path / "hf")]) == 0
    run_ranks(_exact_resume, 2, tmp_path)
    assert losses(tmp_path / "chained") == losses(tmp_path / "straight")
    assert [step for step, _ in losses(tmp_path / "chained")] == [1, 2, 3, 4]
    source, started = read_checkpoint(tmp_path / "source", step=1), read_checkpoint(tmp_path / "from-hf", step=1)
    assert all(torch.equal(started[name], value) for name, value in source.items() if name.startswith("model."))


def _save_fsdp_tp(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "4ranks", *FSDP_TP, "--checkpoint.interval=2", "--checkpoint.keep_latest=0", steps=3)


def _continue_and_reload(rank, world_size, root, layout):
    as_launched(rank, world_size)
    _continue(root, layout)


def _continue(root: Path, layout: list[str]) -> None:
    """From the 4-rank step-2 checkpoint: train step 3 here; and reload it (`_reload`)."""
    run(root / f"continued-{len(layout)}", *layout, steps=3)
    _reload(root, layout)


def _reload(root: Path, layout: list[str]) -> None:
    """A run whose step does nothing saves right away, which writes back exactly what was loaded."""

    def no_step(*args, **kwargs):
        return torch.zeros(()), torch.zeros(())

    run(root / f"reloaded-{len(layout)}", *layout, steps=3, hooks=RunHooks(step=no_step))


def _reload_on(rank, world_size, root, layout):
    as_launched(rank, world_size)
    _reload(root, layout)


def _save_step_2(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "4ranks", *FSDP_TP, steps=2)


def _assert_reloaded_equal(root: Path) -> None:
    saved = read_checkpoint(root / "4ranks", step=2)
    for layout in (FSDP, []):
        reloaded = read_checkpoint(root / f"reloaded-{len(layout)}", step=3)
        for name, value in saved.items():
            if name.startswith(("model.", "optimizer.")) and not name.endswith(".lr"):  # the LR moved on a step
                assert (
                    torch.equal(reloaded[name], value) if isinstance(value, torch.Tensor) else reloaded[name] == value
                ), (layout, name)


def test_checkpoint_saved_on_4_ranks_reloads_bitwise_on_2_and_1(tmp_path):
    """The fast representative of resharding 4 -> 2 -> 1 (the slow test below also trains on)."""
    run_ranks(_save_step_2, 4, tmp_path)
    for layout in (FSDP, []):
        shutil.copytree(tmp_path / "4ranks", tmp_path / f"reloaded-{len(layout)}")
    run_ranks(_reload_on, 2, tmp_path, FSDP)
    _reload(tmp_path, [])
    _assert_reloaded_equal(tmp_path)


def _from_step_2(source: Path, target: Path) -> None:
    shutil.copytree(source, target)
    shutil.rmtree(target / "checkpoints" / "step-00000003")


@pytest.mark.slow  # four ranks, then two, then one: about two minutes on two cores
def test_checkpoint_reshards_across_layouts(tmp_path):
    run_ranks(_save_fsdp_tp, 4, tmp_path)
    for layout in (FSDP, []):
        for kind in ("continued", "reloaded"):
            _from_step_2(tmp_path / "4ranks", tmp_path / f"{kind}-{len(layout)}")
    run_ranks(_continue_and_reload, 2, tmp_path, FSDP)
    _continue(tmp_path, [])

    _assert_reloaded_equal(tmp_path)
    reference = losses(tmp_path / "4ranks")
    for layout in (FSDP, []):
        continued = losses(tmp_path / f"continued-{len(layout)}")
        assert continued[:2] == reference[:2] and continued[2][0] == 3
        torch.testing.assert_close(continued[2][1], reference[2][1], rtol=1e-5, atol=0)


def test_torchrun_restarts_a_killed_rank_and_ends_on_the_same_loss(tmp_path):
    out = tmp_path / "crashed"
    args = [*TINY, f"--job.output_dir={out}", *FSDP, "--checkpoint.interval=2", "--training.steps=4"]
    command = [
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        str(Path(__file__).with_name("crash_entry.py")),
        *args,
    ]
    # The restarted workers must not read the dead ones' addresses from torchrun's shared store
    # (pytorch/pytorch#135712); docs/checkpoints.md asks the same of every torchrun --max-restarts job.
    env = {
        **os.environ,
        "CRASH_AT_STEP": "3",
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "FAULT_STAMP": str(tmp_path / "killed-at"),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # rank 1 was killed; torchrun names whichever failure it saw first: the kill (-9) or rank 0's exit 1 on the
    # connection the kill reset
    assert (tmp_path / "killed-at").exists() and re.search(r"failed \(exitcode: (-9|1)\) local_rank", result.stderr)
    assert "resumed from" in result.stderr and "step-00000002" in result.stderr  # ... and the restart resumed

    run_ranks(_straight, 2, tmp_path)
    assert losses(out) == losses(tmp_path / "straight")
    report(
        "SIGKILL of one rank mid-step (torchrun --max-restarts=1)",
        "torchrun logs the killed worker's exitcode -9 (or its peer's exit 1 on the reset connection) and restarts "
        "the group; the new workers log 'resumed from .../step-00000002'",
        0,
        True,
        first_step_time(out / "metrics.jsonl", 3) - float((tmp_path / "killed-at").read_text()),
        "rank 1 of 2 (FSDP) kills itself in step 3, checkpoint.interval=2; compared with an unbroken 2-rank run",
    )


def _straight(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "straight", *FSDP, "--checkpoint.interval=2", steps=4)
