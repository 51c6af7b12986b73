"""Through the CLI: `torchrun --nproc-per-node 4 --no-python trillion train --parallel.cp=2
--parallel.dp_shard=2 --training.seq_len=256` logs the one-process losses and gradient norms on the
real data path (embedded corpus, packing, each data-parallel rank's slice, each cp rank's share)."""

import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.flags import SMALL, with_flags
from tests.helpers.launch import TORCHRUN, TRILLION, assert_same_curve, train_records

LONG = with_flags(
    SMALL,
    "--training.seq_len=256",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=1",
    "--training.steps=5",
)


@pytest.mark.slow  # about a minute on two cores: five interpreters start and import torch
def test_cp2_x_fsdp2_under_torchrun_logs_the_one_process_losses(tmp_path):
    trillion = shutil.which("trillion", path=str(Path(sys.executable).parent)) or shutil.which("trillion")
    alone = [r for r in train_records(tmp_path / "one", TRILLION, LONG) if "loss" in r]  # step 0's: eval only
    torchrun = [*TORCHRUN, "--nproc-per-node=4", "--no-python", trillion]
    layout = train_records(tmp_path / "cp", torchrun, [*LONG, "--parallel.cp=2", "--parallel.dp_shard=2"])
    layout = [r for r in layout if "loss" in r]
    assert [r["step"] for r in layout] == [1, 2, 3, 4, 5]
    assert_same_curve(alone, layout)
