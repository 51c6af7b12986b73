"""The paper's 1T model on its 3072-GPU layout (dp_shard 384 x tp 8), checked in one process:
a fake process group stands in for the other ranks, the model stays on the meta device, and each
sampled rank must hold 1/3072 of the parameters, up to FSDP's padding of uneven shards (FSDP splits
dim 0 of each tensor-parallel shard in 384 torch.chunk pieces: wq's 3200 rows give 9 rows to the
first ranks and none to the last ones, but every rank allocates the padded 9)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from trillion.models import PRESETS, Transformer
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.parallelize import parallelize

WORLD, DP_SHARD, TP = 3072, 384, 8


def _padded_share(param: DTensor) -> int:
    """Elements one rank allocates for `param`: its tp shard, dim 0 split over dp_shard, rounded up."""
    shape = list(param.shape)
    tp_placement = param.placements[param.device_mesh.mesh_dim_names.index("tp")]
    if tp_placement.is_shard():
        shape[tp_placement.dim] //= TP
    return math.ceil(shape[0] / DP_SHARD) * math.prod(shape[1:])


def _parameters_held(rank: int) -> tuple[int, int, int, set]:
    dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    try:
        args = PRESETS["gpt-1t"]
        dims = ParallelDims.of(
            dp_shard=DP_SHARD, tp=TP, world_size=WORLD, dp_shard_mode="zero1", activation_checkpoint="full"
        )
        check_layout(dims.layout, args, seq_len=2048, gpus_per_node=8)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(args)
        parallelize(model, dims)
        params = list(model.parameters())
        meshes = {tuple(p.device_mesh.mesh_dim_names) for p in params if isinstance(p, DTensor)}
        assert all(isinstance(p, DTensor) and p.is_meta for p in params)
        held = sum(p.to_local().numel() for p in params)
        return held, sum(_padded_share(p) for p in params), sum(p.numel() for p in params), meshes
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, WORLD - 1])
def test_gpt_1t_on_3072_ranks_holds_one_3072th_per_rank(rank):
    held, padded, total, meshes = _parameters_held(rank)
    assert total > 1.0e12
    assert meshes == {("dp_shard", "tp")}  # every parameter sharded (or replicated) over both axes
    fair = total / WORLD
    assert held <= padded, f"rank {rank} holds {held:,} parameters, more than the padded share {padded:,}"
    # The padding (and the tp-replicated LayerNorm weights and biases) cost under 3% per rank.
    assert fair <= padded < 1.03 * fair, f"padded share {padded:,} vs total / {WORLD} = {fair:,.0f}"
    if rank == 0:  # the first ranks get the rounded-up shards: exactly the padded share
        assert held == padded
