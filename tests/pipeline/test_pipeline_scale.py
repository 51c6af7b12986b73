"""The paper's 1T layouts build on one CPU: a fake process group of 1024 or 3072 ranks, the meta
device, and the trainer's own path (Pipeline's split, then TP plan and FSDP2 by `parallelize`) for
a rank of the first, a middle and the last pipeline stage.

Each built rank's parameters are counted twice: whole (DTensor numel: its stage, unsharded) and as
the rank holds them (local shards). The stages' whole counts add up to the model exactly; a rank's
local count is its stage over tp x dp, plus FSDP's padding of uneven shards (the dp rank 0 shown
takes the larger chunk) and the few vectors TP replicates (norms, row-wise biases): under 1 %.
Run with -s to see the per-rank table."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trillion.models import PRESETS, Transformer
from trillion.models.flops import count_params
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.layout import StageLayers
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline, stage_module
from trillion.parallel.pp_layout import split_units

GPT_1T = PRESETS["gpt-1t"]  # 128 layers, hidden 25600, 200 heads
SEQ_LEN = 2048


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """This process as `rank` of a fake process group: collectives do nothing, meshes cost nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _whole(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _local(module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):
        return Transformer(GPT_1T)


@pytest.mark.parametrize("tp, pp, dp", [(4, 128, 2), (8, 16, 24)], ids=["1024-ranks", "3072-ranks"])
def test_gpt_1t_layout_builds_for_first_middle_and_last_stage(model, tp, pp, dp):
    world = tp * pp * dp
    stage_counts = [_whole(stage_module(model, units)) for units in split_units(GPT_1T.n_layers, pp)]
    assert sum(stage_counts) == _whole(model) == count_params(GPT_1T).total
    rows = []
    for pp_rank in (0, pp // 2, pp - 1):
        rank = pp_rank * dp * tp  # pp is the outermost mesh axis: the stage's first rank (dp 0, tp 0)
        with fake_rank(rank, world):
            dims = ParallelDims.of(pp=pp, dp_shard=dp, tp=tp, world_size=world, microbatches=pp)
            check_layout(dims.layout, GPT_1T, SEQ_LEN)
            dims.build_mesh("cpu")
            pipeline = Pipeline(model, dims, torch.device("cpu"), parallelize_fn=lambda part: parallelize(part, dims))
            [part] = pipeline.parts
            assert pipeline.pp_rank == pp_rank
            whole, local = _whole(part), _local(part)
        assert whole == stage_counts[pp_rank]
        share = whole / (tp * dp)
        assert share <= local < 1.01 * share, (pp_rank, local, share)
        rows.append(
            f"rank {rank:5d} (stage {pp_rank:3d}): stage {whole / 1e9:8.3f} B parameters, "
            f"this rank {local / 1e6:9.2f} M (stage / tp x dp = {share / 1e6:9.2f} M)"
        )
    if pp == 128:  # 130 units over 128 stages: the first stage is the embedding alone
        assert stage_counts[0] == count_params(GPT_1T).embedding
    print(f"\ngpt-1t, tp {tp} x pp {pp} x dp {dp} = {world} ranks:\n" + "\n".join(rows))


def test_explicit_stage_sizes_reach_the_stages(model):
    """pp 128 with one layer on every stage, the first and last beside the embedding and the output."""
    tp, pp, dp = 4, 128, 2
    for pp_rank, layers in ((0, ["0"]), (1, ["1"]), (pp - 1, ["127"])):
        with fake_rank(pp_rank * dp * tp, tp * pp * dp):
            stages = StageLayers(written="E+1 | 1*126 | 1+O")  # one layer per stage, beside E and O
            dims = ParallelDims.of(
                pp=pp, dp_shard=dp, tp=tp, world_size=tp * pp * dp, microbatches=pp, stage_layers=stages
            )
            dims.build_mesh("cpu")
            pipeline = Pipeline(model, dims, torch.device("cpu"))
        [part] = pipeline.parts
        assert list(part.layers.keys()) == layers
        assert (part.tok_embeddings is not None, part.output is not None) == (pp_rank == 0, pp_rank == pp - 1)
