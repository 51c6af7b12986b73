"""`torchrun --nproc-per-node 2 -m trillion train --parallel.pp=2` on the real data path logs the
losses and gradient norms of the one-process run (the logging rank holds the first stage: the loss
comes from the last stage over the pipeline group)."""

import pytest

from tests.helpers.flags import SMALL
from tests.helpers.launch import TORCHRUN, TRILLION, assert_same_curve, train_records


@pytest.mark.slow  # about a minute on two cores: three interpreters start and import torch
@pytest.mark.parametrize("schedule", ["1F1B"])
def test_pp2_under_torchrun_logs_the_one_process_losses(tmp_path, schedule):
    alone = [r for r in train_records(tmp_path / "one", TRILLION, SMALL) if "loss" in r]
    torchrun = [*TORCHRUN, "--nproc-per-node=2", "-m", "trillion"]
    layout = train_records(tmp_path / "pp", torchrun, [*SMALL, "--parallel.pp=2", f"--parallel.pp_schedule={schedule}"])
    layout = [r for r in layout if "loss" in r]
    assert [r["step"] for r in layout] == [1, 2, 3]
    assert_same_curve(alone, layout)
