"""Context parallelism is a layout change like any other: a checkpoint saved with cp 2 (2 ranks)
resumes in one process, and one saved in one process resumes with cp 2, each continuing on the
one-process loss curve (gloo, fp32)."""

import json
import shutil
from pathlib import Path

import torch

from tests.helpers.runs import losses, run
from tests.helpers.spawn import as_launched, run_ranks

CP = ["--parallel.cp=2", "--parallel.dp_shard=1"]
SAVE = ["--checkpoint.interval=2", "--checkpoint.keep_latest=0"]


def _step_2_of(source: Path, target: Path) -> None:
    shutil.copytree(source, target)
    shutil.rmtree(target / "checkpoints" / "step-00000004")


def _cp_runs(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "cp2", *CP, *SAVE, steps=4)
    run(root / "one-then-cp2", *CP, steps=4)


def test_cp2_checkpoint_resumes_in_one_process_and_back(tmp_path):
    run(tmp_path / "one", *SAVE, steps=4)
    _step_2_of(tmp_path / "one", tmp_path / "one-then-cp2")
    run_ranks(_cp_runs, 2, tmp_path)
    _step_2_of(tmp_path / "cp2", tmp_path / "cp2-then-one")
    run(tmp_path / "cp2-then-one", steps=4)

    reference = losses(tmp_path / "one")
    assert [step for step, _ in reference] == [1, 2, 3, 4]
    for name in ("cp2", "one-then-cp2", "cp2-then-one"):
        got = losses(tmp_path / name)
        assert [step for step, _ in got] == [1, 2, 3, 4], name  # the resumed runs keep steps 1-2's records
        torch.testing.assert_close(
            [loss for _, loss in got], [loss for _, loss in reference], rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}"
        )
    for resumed, source in (("one-then-cp2", "one"), ("cp2-then-one", "cp2")):  # steps 3-4 trained again
        records = [
            map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines()) for n in (resumed, source)
        ]
        times = [
            [r["time"] for r in rs if "loss" in r] for rs in records
        ]  # training records (step 0's holds eval only)
        assert times[0][:2] == times[1][:2] and times[0][2] > times[1][3], resumed
