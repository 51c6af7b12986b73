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


def chain(root: Path, flags: list[str], first: list[str], other: list[str]) -> None:
    """On every rank: `first` straight to step 4 (a checkpoint at 2); from its step 2 `other` to step 3 (saving it);
    from that `first` again to step 4."""
    run(root / "straight", *flags, *first, "--checkpoint.interval=2", steps=4)
    _resume_from(root / "straight", root / "other", step=2)
    run(root / "other", *flags, *other, "--checkpoint.interval=3", steps=3)
    _resume_from(root / "other", root / "back", step=3)
    run(root / "back", *flags, *first, steps=4)


def check_chain(root: Path, rtol: float) -> None:
    """The chained run's losses, at step 3 (`other`) and step 4 (`first` again), are the straight run's."""
    straight = dict(losses(root / "straight"))
    other, back = dict(losses(root / "other")), dict(losses(root / "back"))
    assert 3 in other and 4 in back, (other, back)
    torch.testing.assert_close(other[3], straight[3], rtol=rtol, atol=0)
    torch.testing.assert_close(back[4], straight[4], rtol=rtol, atol=0)


def _chain(rank, world_size, root):
    as_launched(rank, world_size)
    chain(root, MOE, EP2, EP1)  # ep 2's step 2 -> ep 1, ep 1's step 3 -> ep 2


def test_ep2_checkpoint_resumes_at_ep1_and_back(tmp_path):
    run_ranks(_chain, 2, tmp_path)
    check_chain(tmp_path, rtol=1e-5)
