"""A checkpoint saved with ep folded over the tp ranks (tp 2 x dp_shard 2, ep 4, parallel.etp=1) resumes without
tp (dp_shard 4, ep 2: the experts on other ranks, whole tensors DCP reshards), and one saved there resumes folded:
the chained run folded -> unfolded -> folded ends on the losses of the straight folded run within 1e-6 relative."""

from tests.helpers.spawn import as_launched, run_ranks
from tests.moe.test_ep_checkpoint import chain, check_chain

MOE = ["--model.name=debug-moe", "--model.n_layers=2", "--training.global_batch_size=8", "--checkpoint.keep_latest=0"]
FOLDED = ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=4", "--parallel.etp=1"]
UNFOLDED = ["--parallel.dp_shard=4", "--parallel.ep=2"]


def _chain(rank, world_size, root):
    as_launched(rank, world_size)
    chain(root, MOE, FOLDED, UNFOLDED)  # folded step 2 -> unfolded, unfolded step 3 -> folded


def test_folded_checkpoint_resumes_unfolded_and_back(tmp_path):
    run_ranks(_chain, 4, tmp_path)
    check_chain(tmp_path, rtol=1e-6)
