"""Which blocks activation checkpointing recomputes, seen from the outside: after `parallelize` (or on a
pipeline stage module), a checkpointed block runs its forward again during backward, so its
sub-modules are entered twice, once in forward and once in backward; a block that keeps its
activations is entered only in forward. Losses and FLOP counts cannot see this (recomputing changes
neither the loss nor the gradients), so checkpointing every block, or none, under `selective:N` would
pass them; here each mode's set of blocks is written out by hand, not derived from modes.py.
"""

import dataclasses

import pytest
import torch

from trillion.models import PRESETS, Transformer
from trillion.parallel.dims import ParallelDims
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import stage_module

N_LAYERS = 7  # odd, and not a multiple of 2 or 3: the patterns differ at the end as well as the start
ARGS = dataclasses.replace(
    PRESETS["debug"], n_layers=N_LAYERS, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=64, max_seq_len=16
)
ALL = set(range(N_LAYERS))
EXPECTED = {
    "none": set(),
    "full": ALL,
    "selective": {0, 2, 4, 6},  # every second block, the first included
    "selective:2": {0, 2, 4, 6},
    "selective:3": {0, 3, 6},
    "selective:5": {0, 5},
    "selective:7": {0},
    "selective:op": ALL,  # every block, recomputing only the elementwise work (its norms run again)
}


def recomputed_blocks(model: torch.nn.Module, inputs: torch.Tensor) -> set[int]:
    """The global indices of the blocks whose sub-modules run again during backward. Forward pre-hooks
    on every sub-module of each block: a recompute enters the block's first sub-module (its norm) even
    when torch stops it early, once the tensors backward needs are back."""
    phase = {"now": "forward"}
    entered = {int(key): {"forward": 0, "backward": 0} for key in model.layers}
    handles = []
    for key, block in model.layers.items():
        counts = entered[int(key)]
        for module in block.modules():
            if module is not block:
                handles.append(module.register_forward_pre_hook(lambda *_, c=counts: c.__setitem__(phase["now"], 1)))
    try:
        out = model(inputs)
        assert all(c["forward"] for c in entered.values()), "a block did not run in forward"
        assert not any(c["backward"] for c in entered.values())
        phase["now"] = "backward"
        out.float().pow(2).mean().backward()
    finally:
        for handle in handles:
            handle.remove()
    return {index for index, c in entered.items() if c["backward"]}


@pytest.fixture(autouse=True)
def one_thread():
    """A tiny model: one intra-op thread runs it in milliseconds, two on a busy machine in seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(mode: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallelize(model, ParallelDims.of(activation_checkpoint=mode))  # one process: AC only
    model.to_empty(device="cpu")
    model.init_weights(3)
    return model


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_each_mode_checkpoints_exactly_its_blocks(mode):
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    assert recomputed_blocks(_model(mode), tokens) == EXPECTED[mode]


@pytest.mark.parametrize(
    "mode,expected",
    [("selective:2", {1, 3}), ("selective:3", {1, 4}), ("full", {1, 2, 3, 4}), ("none", set())],
)
def test_a_pipeline_stage_counts_its_blocks_from_its_first(mode, expected):
    """A stage module (here layers 1-4 of 7: pipeline units 2-5) checkpoints every N-th of its own blocks
    starting with its first, as modes.stages_recompute_fraction counts them: not every N-th of the whole
    model's (that would be 2 and 4, or 3)."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    stage = stage_module(model, range(2, 6))
    assert sorted(int(key) for key in stage.layers) == [1, 2, 3, 4]
    parallelize(stage, ParallelDims.of(pp=1, world_size=1, activation_checkpoint=mode))
    stage.to_empty(device="cpu")
    stage.init_weights(3)
    hidden = torch.randn(2, 8, ARGS.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)
    assert recomputed_blocks(stage, hidden) == expected
