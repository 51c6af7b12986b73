"""The planner's parameter, gradient and optimizer bytes equal those of the real model sharded by
the trainer's own TP plan and FSDP2 on a fake process group (rank 0, the one holding the most)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from trillion.models.presets import get_preset
from trillion.models.transformer import Transformer
from trillion.parallel.fsdp import apply_fsdp
from trillion.parallel.layout import Layout
from trillion.parallel.planner.memory import RankParams, pipeline_ranks, states_bytes
from trillion.parallel.tensor_parallel import apply_tensor_parallel


@pytest.fixture
def fake_world():
    def start(world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield start
    dist.destroy_process_group()


def _local_numel(model: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


def _stage(model: Transformer, rank: RankParams, first_layer: int) -> Transformer:
    """Keep what one pipeline rank holds, as a pipeline split does (parameter names stay global)."""
    for name in list(model.layers):
        if not first_layer <= int(name) < first_layer + rank.layers:
            del model.layers[name]
    if not rank.first:
        model.tok_embeddings = model.pos_embeddings = None
    if not rank.last:
        model.norm = model.output = None
    return model


# dp_shard 3 does not divide the 320-row vocabulary shard, so rank 0's ceiling is what is checked.
@pytest.mark.parametrize("preset,tp,dp_shard,pp", [("debug-gpt", 2, 3, 1), ("debug", 2, 3, 2), ("debug-gpt", 4, 2, 2)])
def test_states_match_fsdp_tp_on_fake_process_group(fake_world, preset, tp, dp_shard, pp):
    args = dataclasses.replace(get_preset(preset), n_layers=4)
    layout = Layout(tp=tp, pp=pp, dp_shard=dp_shard, microbatches=4)
    rank = pipeline_ranks(args, layout)[0]
    predicted_tp, predicted_shard = rank.numel(args, tp, dp_shard)

    fake_world(tp * dp_shard)
    mesh = init_device_mesh("cpu", (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    with torch.device("meta"):
        model = _stage(Transformer(args), rank, 0)
    apply_tensor_parallel(model, mesh["tp"])
    assert _local_numel(model) == predicted_tp
    apply_fsdp(model, mesh["dp_shard"], "zero3")
    measured = _local_numel(model)
    assert measured == predicted_shard

    # Gradients and AdamW moments have the shapes of the (sharded) parameters they belong to.
    assert states_bytes(predicted_tp, predicted_shard, "zero3") == (4 * measured, 4 * measured, 8 * measured)
    # zero1/zero2 add the gathered bf16 copy of the TP shard; zero1 keeps fp32 gradients that size.
    assert states_bytes(predicted_tp, predicted_shard, "zero1") == (
        4 * measured + 2 * predicted_tp,
        4 * predicted_tp,
        8 * measured,
    )
