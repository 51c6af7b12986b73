"""optimizer.state_dtype (parallel/adamw_states.py): AdamW's moments in bfloat16. With float32 moments the step is
torch's AdamW's; with bfloat16 each moment is the float32 one rounded, in half the bytes, and the parameters drift
from torch's AdamW by a small share of how far they moved; under FSDP its DTensor moments shard with the parameters
and step as one process does. The loss drift over 200 steps of debug-deepseek is a benchmark's figure, not a test's:
experiments/bench/RESULTS.md, written by experiments/bench/memory_recipe.py (docs/optimizers.md quotes it)."""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.spawn import run_ranks
from trillion.errors import ConfigError
from trillion.models import PRESETS, Transformer
from trillion.parallel.adamw_states import StateDtypeAdamW
from trillion.trainer.config.schema import load_config
from trillion.trainer.optim import build_optimizer

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((64, 32), (32,), (16, 16))]


def _run(optimizer_of, steps: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = _params(seed)
    optimizer = optimizer_of(
        [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1:2], "weight_decay": 0.0}]
    )
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator) * 1e-2
        optimizer.step()
    return [param.detach().clone() for param in params], optimizer


def test_float32_moments_step_as_torchs_adamw():
    ours, _ = _run(lambda groups: StateDtypeAdamW(groups, **HYPER, state_dtype=torch.float32), 20)
    torchs, _ = _run(lambda groups: torch.optim.AdamW(groups, **HYPER, foreach=False), 20)
    for got, want in zip(ours, torchs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_bfloat16_moments_are_the_float32_ones_rounded_in_half_the_bytes():
    params, optimizer = _run(lambda groups: StateDtypeAdamW(groups, **HYPER), 1)
    gradient = torch.randn((64, 32), generator=torch.Generator().manual_seed(1)) * 1e-2  # the first step's
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert state["exp_avg"].element_size() * 2 == torch.ones((), dtype=torch.float32).element_size()
    assert torch.equal(state["exp_avg"], (0.1 * gradient).to(torch.bfloat16))
    assert torch.equal(state["exp_avg_sq"], (0.05 * gradient * gradient).to(torch.bfloat16))
    # 200 steps: the parameters end within 2% of their own movement from torch's AdamW (float32 moments)
    start = [param.detach() for param in _params()]
    ours, _ = _run(lambda groups: StateDtypeAdamW(groups, **HYPER), 200)
    torchs, _ = _run(lambda groups: torch.optim.AdamW(groups, **HYPER, foreach=False), 200)
    for got, want, first in zip(ours, torchs, start):
        assert (got - want).norm() <= 0.02 * (want - first).norm()


def test_the_trainer_builds_it_and_refuses_the_fused_step():
    with torch.device("meta"):
        model = Transformer(PRESETS["debug"])
    config = load_config(None, ["--optimizer.state_dtype=bfloat16"])
    optimizer = build_optimizer(model, config.optimizer, "cpu")
    assert isinstance(optimizer, StateDtypeAdamW) and optimizer.state_dtype == torch.bfloat16
    assert isinstance(build_optimizer(model, load_config(None, []).optimizer, "cpu"), torch.optim.AdamW)
    fused = load_config(None, ["--optimizer.state_dtype=bfloat16", "--optimizer.implementation=fused"])
    with pytest.raises(ConfigError, match="optimizer.state_dtype=bfloat16 with optimizer.implementation=fused"):
        build_optimizer(model, fused.optimizer, "cpu")


def _sharded_steps(rank: int, world_size: int) -> None:
    """Each rank's shard of a parameter and its moments (DTensors on a 2-rank mesh) step as the whole one does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    whole = _params()
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in copy.deepcopy(whole)]
    optimizers = [StateDtypeAdamW(params, **HYPER, weight_decay=0.1) for params in (whole, sharded)]
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=generator) for p in whole]
        for param, other, grad in zip(whole, sharded, grads):
            param.grad, other.grad = grad, distribute_tensor(grad, mesh, [Shard(0)])
        for optimizer in optimizers:
            optimizer.step()
    for param, other in zip(whole, sharded):
        assert isinstance(optimizers[1].state[other]["exp_avg"], DTensor)
        assert torch.equal(other.full_tensor(), param.detach())
        assert torch.equal(optimizers[1].state[other]["exp_avg"].full_tensor(), optimizers[0].state[param]["exp_avg"])


def test_sharded_moments_step_as_one_process():
    run_ranks(_sharded_steps, 2)
