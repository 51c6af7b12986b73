"""`torchrun --nproc-per-node 2 -m trillion train --parallel.pp=2` on the real data path logs the
losses and gradient norms of the one-process run (the logging rank holds the first stage: the loss
comes from the last stage over the pipeline group)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from test_torchrun_layout import _run  # noqa: E402


@pytest.mark.slow  # about a minute on two cores: three interpreters start and import torch
@pytest.mark.parametrize("schedule", ["1F1B"])
def test_pp2_under_torchrun_logs_the_one_process_losses(tmp_path, schedule):
    alone = _run(tmp_path / "one", [sys.executable], [])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    layout = _run(tmp_path / "pp", torchrun, ["--parallel.pp=2", f"--parallel.pp_schedule={schedule}"])
    assert [r["step"] for r in layout] == [1, 2, 3]
    for one, parallel in zip(alone, layout):
        assert abs(one["loss"] - parallel["loss"]) <= 1e-4 * abs(one["loss"]), (one, parallel)
        assert abs(one["grad_norm"] - parallel["grad_norm"]) <= 1e-4 * abs(one["grad_norm"]), (one, parallel)
