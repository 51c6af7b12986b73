"""A checkpoint saved at ep 2 resumes at ep 1, and one saved at ep 1 resumes at ep 2 (DCP reshards the
routed experts, DTensors on the ep mesh, into whole tensors and back): the chained run ep 2 -> ep 1
-> ep 2 ends on the loss of the straight ep 2 run within 1e-5."""

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.runs import losses, run
from tests.helpers.spawn import as_launched, run_ranks

MOE = ["--model.name=debug-moe", "--model.n_layers=2", "--parallel.dp_shard=2", "--checkpoint.keep_latest=0"]
EP2, EP1 = ["--parallel.ep=2"], ["--parallel.ep=1"]


def _resume_from(source: Path, target: Path, step: int) -> None:
    """target: source's run directory as it was after checkpoint `step` (later checkpoints dropped)."""
    if dist.get_rank() == 0:
        shutil.copytree(source, target)
        for later in (target / "checkpoints").glob("step-*"):
            if int(later.name.split("-")[1]) > step:
                shutil.rmtree(later)
    dist.barrier()


def _chain(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "straight", *MOE, *EP2, "--checkpoint.interval=2", steps=4)
    _resume_from(root / "straight", root / "ep1", step=2)
    run(root / "ep1", *MOE, *EP1, "--checkpoint.interval=3", steps=3)  # ep 2's step 2 -> ep 1, saves step 3
    _resume_from(root / "ep1", root / "back", step=3)
    run(root / "back", *MOE, *EP2, steps=4)  # ep 1's step 3 -> ep 2


def test_ep2_checkpoint_resumes_at_ep1_and_back(tmp_path):
    run_ranks(_chain, 2, tmp_path)
    straight = dict(losses(tmp_path / "straight"))
    ep1, back = dict(losses(tmp_path / "ep1")), dict(losses(tmp_path / "back"))
    assert 3 in ep1 and 4 in back, (ep1, back)
    torch.testing.assert_close(ep1[3], straight[3], rtol=1e-5, atol=0)
    torch.testing.assert_close(back[4], straight[4], rtol=1e-5, atol=0)
