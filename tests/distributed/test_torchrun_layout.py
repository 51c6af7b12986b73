"""The parallelism guide's command: `torchrun --nproc-per-node 4 -m trillion train --parallel.dp_shard=2
--parallel.tp=2` logs the losses and gradient norms of the one-process run on the real data path
(embedded corpus, packing, each data-parallel rank's slice of the global batch)."""

import pytest

from tests.helpers.flags import SMALL
from tests.helpers.launch import TORCHRUN, TRILLION, assert_same_curve, train_records


@pytest.mark.slow  # about a minute on two cores: five interpreters start and import torch
def test_fsdp_x_tp_under_torchrun_logs_the_one_process_losses(tmp_path):
    alone = [r for r in train_records(tmp_path / "one", TRILLION, SMALL) if "loss" in r]
    torchrun = [*TORCHRUN, "--nproc-per-node=4", "-m", "trillion"]
    layout = train_records(tmp_path / "2d", torchrun, [*SMALL, "--parallel.dp_shard=2", "--parallel.tp=2"])
    layout = [r for r in layout if "loss" in r]
    assert [r["step"] for r in layout] == [1, 2, 3]
    assert_same_curve(alone, layout)
