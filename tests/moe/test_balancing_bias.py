"""The balancing bias is computed from the loads summed over the data-parallel ranks, not from a rank's own:
after one training step at dp 2, where the two ranks' tokens load the experts unevenly (so a rank's own loads
would move the bias another way), each MoE layer's bias equals one process's bitwise, on both ranks."""

import contextlib

import torch
import torch.distributed as dist

from tests.helpers.parity import GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, RandomWindows
from tests.helpers.spawn import run_ranks
from tests.moe.harness import _build, _dims, model_args, train_case
from trillion.models.moe import moe_layers
from trillion.trainer.data.loader import DataLoader
from trillion.trainer.step import train_step

CASE = {"variant": "bias", "dp_shard": 2}


def _bias_step(loads: torch.Tensor, rate: float) -> torch.Tensor:
    """The bias one step moves from zero for these loads (models/moe.py's rule)."""
    step = rate * torch.sign(loads.mean() - loads)
    return step - step.mean()


def _one_step(rank: int, world_size: int) -> None:
    args = model_args(CASE["variant"])
    dims = _dims(CASE, world_size, args)
    runner, (model,) = _build(CASE, dims, args)
    layers = moe_layers(model)
    chosen = {index: [] for index in layers}  # this rank's routed experts, as its router chose them
    for index, layer in layers.items():
        layer.router.register_forward_hook(lambda _m, _i, out, index=index: chosen[index].append(out[1].flatten()))
    assert all(not layer.router.expert_bias.any() for layer in layers.values())  # from zero
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(
        RandomWindows(args.vocab_size, SEQ_LEN + 1), GLOBAL_BATCH, MICRO_BATCH, dims.dp_rank, dims.dp_size
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train_step(runner, loader.next_batch(), optimizer, scaler, contextlib.nullcontext(), 0.5, dims=dims)
    bias = {index: layer.router.expert_bias.clone() for index, layer in layers.items()}
    dtype = next(iter(bias.values())).dtype
    own = {index: torch.cat(c).bincount(minlength=args.moe.n_experts).to(dtype) for index, c in chosen.items()}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (bias, own))
    if rank != 0:
        return
    expected = train_case({"variant": CASE["variant"], "steps": 1}, world_size=1)["bias"]
    (bias_0, own_0), (bias_1, own_1) = gathered
    rate = args.moe.bias_update_rate
    for index, want in expected.items():
        assert torch.equal(_bias_step(own_0[index] + own_1[index], rate), want)  # the loads recorded are the step's
        assert not torch.equal(own_0[index], own_1[index]), f"layer {index}: the ranks' loads are not uneven"
        assert torch.equal(bias_0[index], want) and torch.equal(bias_1[index], want), f"layer {index} bias"
    # the test's point: a bias from either rank's own loads would have been another one
    for own in (own_0, own_1):
        assert any(not torch.equal(_bias_step(own[i], rate), expected[i]) for i in expected)


def test_the_bias_after_a_step_at_dp2_with_uneven_loads_equals_one_process():
    run_ranks(_one_step, 2)
