"""A checkpoint saved with ep folded over the tp ranks (tp 2 x dp_shard 2, ep 4, parallel.etp=1) resumes without
tp (dp_shard 4, ep 2: the experts on other ranks, whole tensors DCP reshards), and one saved there resumes folded:
the chained run folded -> unfolded -> folded ends on the losses of the straight folded run within 1e-6 relative."""

import torch

from tests.helpers.runs import losses, run
from tests.helpers.spawn import as_launched, run_ranks
from tests.moe.test_ep_checkpoint import _resume_from

MOE = ["--model.name=debug-moe", "--model.n_layers=2", "--training.global_batch_size=8", "--checkpoint.keep_latest=0"]
FOLDED = ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=4", "--parallel.etp=1"]
UNFOLDED = ["--parallel.dp_shard=4", "--parallel.ep=2"]


def _chain(rank, world_size, root):
    as_launched(rank, world_size)
    run(root / "straight", *MOE, *FOLDED, "--checkpoint.interval=2", steps=4)
    _resume_from(root / "straight", root / "unfolded", step=2)
    run(root / "unfolded", *MOE, *UNFOLDED, "--checkpoint.interval=3", steps=3)  # folded step 2 -> unfolded, saves 3
    _resume_from(root / "unfolded", root / "back", step=3)
    run(root / "back", *MOE, *FOLDED, steps=4)  # unfolded step 3 -> folded


def test_folded_checkpoint_resumes_unfolded_and_back(tmp_path):
    run_ranks(_chain, 4, tmp_path)
    straight = dict(losses(tmp_path / "straight"))
    unfolded, back = dict(losses(tmp_path / "unfolded")), dict(losses(tmp_path / "back"))
    assert 3 in unfolded and 4 in back, (unfolded, back)
    torch.testing.assert_close(unfolded[3], straight[3], rtol=1e-6, atol=0)
    torch.testing.assert_close(back[4], straight[4], rtol=1e-6, atol=0)
