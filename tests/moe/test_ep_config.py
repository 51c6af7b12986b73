"""Expert-parallel layouts refused up front, one paragraph naming the setting and the fix; ep = 1 adds
nothing to the mesh."""

import dataclasses

import pytest
import torch

from trillion.errors import ConfigError
from trillion.models import PRESETS
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.layout import layout_on
from trillion.trainer.assemble import build_parallel_dims, resolve_layout
from trillion.trainer.config.schema import Config
from trillion.trainer.launch.env import LaunchEnv

MOE, DENSE = PRESETS["debug-moe"], PRESETS["debug"]  # debug-moe: 8 routed experts


def _config(**parallel) -> Config:
    config = Config()
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    return config


@pytest.mark.parametrize(
    "parallel, world, args, words",
    [
        (
            {"dp_shard": 4, "ep": 3},
            4,
            MOE,
            ["parallel.ep=3", "dp_shard x cp = 4 x 1 = 4", "valid: 1, 2, 4"],
        ),
        ({"dp_shard": 2, "cp": 2, "ep": 8}, 4, MOE, ["parallel.ep=8", "dp_shard x cp = 2 x 2 = 4"]),
        (
            {"dp_shard": 6, "ep": 3},
            6,
            MOE,
            ["parallel.ep=3", "8 routed experts", "model.n_experts", "valid: 1, 2"],
        ),
        ({"dp_shard": 2, "ep": 2}, 2, DENSE, ["parallel.ep=2", "dense", "--parallel.ep=1", "debug-moe"]),
    ],
)
def test_bad_expert_parallel_degree_is_refused_with_the_fix(parallel, world, args, words):
    message = refusal(parallel, world, args)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


def refusal(parallel: dict, world: int, args) -> str:
    """The one-paragraph ConfigError `parallel` gets on `world` ranks (a batch of 24 sequences)."""
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"))
    config = _config(**parallel)
    config.training.global_batch_size, config.training.micro_batch_size = 24, 2  # splits over every world here
    with pytest.raises(ConfigError) as error:
        build_parallel_dims(resolve_layout(config, world), args, config.training.seq_len, env)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_ep_divides_experts_of_an_overridden_model():
    args = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, n_experts=6))
    with pytest.raises(ConfigError, match="6 routed experts"):
        check_layout(layout_on(dp_shard=4, ep=4, world_size=4), args, 64)


def test_ep1_builds_no_expert_mesh():
    dims = ParallelDims(world_size=1)
    assert dims.ep == 1 and not dims.ep_enabled and dims.build_mesh("cpu") is None
    assert dims.ep_mesh is None and dims.expert_fsdp_mesh is None and dims.efsdp == 1


def test_the_cli_refuses_ep_on_one_process(capsys):
    from trillion.trainer.cli.main import main

    assert main(["train", "--model.name=debug-moe", "--parallel.ep=2", "--training.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "parallel.ep=2" in err and "Traceback" not in err


def test_split_backward_schedules_join_their_weight_passes_where_a_second_recompute_cannot_run():
    """Expert parallelism's replayed blocks (their all-to-alls) and selective checkpointing's regions recompute once:
    under them the zero-bubble schedules run each weight pass with its input pass (parallel/pipeline_pairing.py)."""
    from trillion.parallel.layout import Layout
    from trillion.parallel.modes import joins_weight_passes

    def joins(**fields) -> bool:
        return joins_weight_passes(Layout(pp=2, pp_schedule="ZBVZeroBubble", virtual_stages=2, **fields))

    assert joins(ep=2, activation_checkpoint="full") and joins(activation_checkpoint="selective:op")
    assert joins(activation_checkpoint="deepseek") and not joins(ep=2) and not joins(activation_checkpoint="full")
    assert not joins_weight_passes(Layout(pp=2, pp_schedule="1F1B", ep=2, activation_checkpoint="full"))
