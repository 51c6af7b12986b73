"""What each dp_shard_mode keeps gathered between uses (the parallelism guide's table), observed on the module
itself: FSDP2 swaps a block's parameters for unsharded tensors while it holds them gathered and back
to DTensor shards when it reshards. zero3 reshards after every forward and backward; zero2 and zero1
keep a block gathered from its first forward through every micro-batch until the last backward.
Numerics cannot tell these apart (zero2 resharding like zero3 trains the same losses)."""

import dataclasses
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from trillion.models import Transformer, get_preset
from trillion.parallel.fsdp import apply_fsdp, set_micro_batch


@pytest.fixture
def one_rank_mesh():
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def gathered(block) -> bool:
    return all(not isinstance(p, DTensor) for p in block.parameters())


@pytest.mark.parametrize(("mode", "held_through_the_step"), [("zero3", False), ("zero2", True), ("zero1", True)])
def test_blocks_are_held_gathered_as_the_mode_says(mode, held_through_the_step, one_rank_mesh):
    args = dataclasses.replace(
        get_preset("debug"), n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256
    )
    model = Transformer(args)
    model.init_weights(0)
    apply_fsdp(model, one_rank_mesh, mode)
    after_forward = []
    for block in model.layers.values():  # runs after FSDP's own post-forward (reshard) hook
        block.register_forward_hook(lambda module, inputs, output: after_forward.append(gathered(module)))
    between_micro_batches = []
    for index in range(3):
        set_micro_batch(model, mode, is_last=index == 2)
        model(torch.randint(0, 256, (2, 16))).sum().backward()
        between_micro_batches.append(all(gathered(block) for block in model.layers.values()))
    assert after_forward == [held_through_the_step] * 6
    assert between_micro_batches == [held_through_the_step, held_through_the_step, False]  # all reshard at the end
