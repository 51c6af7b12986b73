"""`trillion train --data.prepared=DIR` on a store of the default corpus: one process and two FSDP
ranks under torchrun log the same losses (fp32), and a resumed run continues bitwise."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import flags
from tests.helpers.runs import losses
from trillion.trainer.config.schema import load_config
from trillion.trainer.train import train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = flags.with_flags(flags.TINY, "--training.steps=4", "--training.dtype=fp32")  # 4 steps in fp32


def torchrun(out, store, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--no-python",
        shutil.which("trillion") or "trillion",
        "train",
        *TINY,
        f"--data.prepared={store}",
        f"--job.output_dir={out}",
        "--parallel.dp_shard=2",
        *extra,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return losses(out)


@pytest.fixture(scope="module")
def straight(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(load_config(None, [*TINY, f"--data.prepared={store}", f"--job.output_dir={out}"]))
    return losses(out)


def test_two_fsdp_ranks_under_torchrun_log_the_one_process_losses(store, straight, tmp_path):
    layout = torchrun(tmp_path / "dp2", store)
    assert [step for step, _ in layout] == [1, 2, 3, 4]
    for (_, one), (_, two) in zip(straight, layout):
        assert abs(one - two) <= 1e-5 * abs(one), (straight, layout)


def test_a_resumed_run_continues_bitwise(store, straight, tmp_path):
    args = [*TINY, f"--data.prepared={store}", f"--job.output_dir={tmp_path}", "--training.exit_interval=2"]
    train(load_config(None, args))
    train(load_config(None, args))  # the same command resumes from step 2
    assert losses(tmp_path) == straight


@pytest.mark.slow  # another torchrun start (about 20 s on two cores)
def test_a_one_process_checkpoint_resumes_on_two_ranks(store, straight, tmp_path):
    train(
        load_config(
            None, [*TINY, f"--data.prepared={store}", f"--job.output_dir={tmp_path}", "--training.exit_interval=2"]
        )
    )
    resumed = torchrun(tmp_path, store)
    assert [step for step, _ in resumed] == [1, 2, 3, 4]
    for (_, one), (_, two) in zip(straight[2:], resumed[2:]):
        assert abs(one - two) <= 1e-5 * abs(one), (straight, resumed)
