"""The expert dispatch's settings refused up front, one paragraph naming the setting and the fix (ranks per node
that do not divide ep, a per-node dispatch with no network hop, a capacity below the minimum or with a dispatch
that has no fixed buffers), a warning where group-limited routing does not line up with the nodes; and `auto`
resolved from where the ep group lies."""

import logging

import pytest

from trillion.errors import ConfigError
from trillion.models import PRESETS
from trillion.trainer.assemble import check_model_layout, resolve_layout
from trillion.trainer.config.schema import Config, load_config

MOE, DEEPSEEK = PRESETS["debug-moe"], PRESETS["debug-deepseek"]  # 8 experts; debug-deepseek: 4 routing groups


def _layout(world: int, args=MOE, capacity: float = 0.0, **parallel):
    config = Config()
    config.training.global_batch_size = 24
    config.moe.rank_capacity_factor = capacity
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    layout = resolve_layout(config, world)
    check_model_layout(layout, args, config.training.seq_len)
    return layout


@pytest.mark.parametrize(
    "world, settings, words",
    [
        (8, {"ep": 4, "ranks_per_node": 3}, ["parallel.ranks_per_node=3", "does not divide ep", "multiple of 3"]),
        (12, {"ep": 4, "ranks_per_node": 6}, ["parallel.ep=4 does not divide the 6", "straddle"]),
        (4, {"ep": 4, "ep_dispatch": "node"}, ["parallel.ep_dispatch=node", "share one node", "ep_dispatch=rank"]),
        (4, {"ep": 2, "capacity": 1.5, "ep_dispatch": "expert"}, ["rank_capacity_factor=1.5", "ep_dispatch=rank"]),
        (4, {"ep": 1, "ep_overlap": True}, ["parallel.ep_overlap=true", "parallel.ep=1", "--parallel.ep=2"]),
    ],
)
def test_bad_dispatch_settings_are_refused_with_the_fix(world, settings, words, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    capacity = settings.pop("capacity", 0.0)
    with pytest.raises(ConfigError) as error:
        _layout(world, capacity=capacity, dp_shard=-1, **settings)
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_a_capacity_below_the_minimum_is_refused():
    with pytest.raises(ConfigError, match=r"moe.rank_capacity_factor.*at least 1"):
        load_config(None, ["--moe.rank_capacity_factor=0.5"])


def test_auto_picks_per_node_across_nodes_and_per_rank_inside_one(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the launcher's ranks per node
    assert _layout(4, ep=4, dp_shard=-1).ep_dispatch == "node"
    assert _layout(4, ep=2, dp_shard=-1).ep_dispatch == "rank"  # each ep group inside a node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _layout(4, ep=4, dp_shard=-1).ep_dispatch == "rank"


def test_groups_not_lined_up_with_the_nodes_warn(caplog, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with caplog.at_level(logging.WARNING, logger="trillion"):
        layout = _layout(8, DEEPSEEK, ep=8, dp_shard=-1, ranks_per_node=1, ep_dispatch="node")  # 8 nodes, 4 groups
    assert layout.ep_dispatch == "node"
    assert "4 groups do not line up with the 8 nodes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trillion"):
        _layout(8, DEEPSEEK, ep=8, dp_shard=-1, ranks_per_node=2, ep_dispatch="node")  # 4 nodes: a group each
    assert "line up" not in caplog.text
