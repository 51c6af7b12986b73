"""parallel.etp refused up front where it cannot run, one paragraph naming the setting and the fix; auto picks the
fewer bytes and the log names it; the folded ep group counts its nodes as consecutive ranks."""

import logging

import pytest

from tests.moe.test_ep_config import MOE, _config, refusal
from trillion.parallel.ep_checks import ep_nodes
from trillion.parallel.layout import Layout
from trillion.trainer.assemble import resolve_layout


@pytest.mark.parametrize(
    "parallel, world, words",
    [
        # an etp other than 1 or tp
        (
            {"tp": 2, "dp_shard": 2, "ep": 2, "etp": 4},
            4,
            ["parallel.etp=4", "neither 1 nor parallel.tp=2", "--parallel.etp=1"],
        ),
        # ep that the borrowed tp ranks cannot hold: not a multiple of cp x tp, or not dividing dp_shard x cp x tp
        (
            {"tp": 4, "dp_shard": 2, "ep": 2, "etp": 1},
            8,
            ["parallel.ep=2 with parallel.etp=1", "cp x tp = 1 x 4 = 4", "among 4, 8", "--parallel.etp=4"],
        ),
        ({"tp": 2, "cp": 2, "dp_shard": 1, "ep": 2, "etp": 1}, 4, ["cp x tp = 2 x 2 = 4", "dp_shard x cp x tp = 4"]),
        ({"tp": 2, "dp_shard": 2, "ep": 8, "etp": 1}, 4, ["parallel.ep=8", "divide dp_shard x cp x tp = 4"]),
        # the per-node dispatch where the folded group's nodes do not match: consecutive ranks, 6 a node, ep 4
        (
            {"tp": 2, "dp_shard": 6, "ep": 4, "etp": 1, "ranks_per_node": 6, "ep_dispatch": "node"},
            12,
            ["parallel.ep=4 does not divide the 6 expert-parallel ranks of a node", "consecutive: parallel.etp=1"],
        ),
        # ... and where they all sit in one node: no network hop to spare
        (
            {"tp": 2, "dp_shard": 4, "ep": 4, "etp": 1, "ranks_per_node": 8, "ep_dispatch": "node"},
            8,
            ["parallel.ep_dispatch=node", "share one node"],
        ),
    ],
)
def test_a_folding_that_cannot_run_is_refused_with_the_fix(parallel, world, words):
    message = refusal(parallel, world, MOE)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


def test_auto_folds_where_it_can_and_names_why(caplog):
    config = _config(tp=2, dp_shard=2, ep=4)
    config.training.global_batch_size = 8
    with caplog.at_level(logging.INFO, logger="trillion"):
        folded = resolve_layout(config, 4)
    assert folded.etp == 1 and folded.folded and folded.efsdp == 1
    assert (
        "parallel.etp=1: ep 4 folded over the tp ranks" in caplog.text and "1/2 of the all-to-all bytes" in caplog.text
    )
    config = _config(tp=2, dp_shard=4, ep=2, cp=1)
    config.parallel.tp = 4
    config.parallel.dp_shard = 2
    # ep 2 cannot hold tp 4: the experts stay tensor-parallel, ep inside dp_shard
    kept = resolve_layout(config, 8)
    assert kept.etp == 4 and not kept.folded and kept.expert_tp == 4 and kept.efsdp == 1


def test_a_folded_ep_group_is_consecutive_ranks_on_a_node():
    """ep 8 folded over tp 2 x dp_shard 4 fills one node of 8; tp 2 apart (etp = tp) it spans two."""
    assert ep_nodes(Layout(tp=2, dp_shard=8, ep=8, etp=1, ranks_per_node=8)) == (1, 8)
    assert ep_nodes(Layout(tp=2, dp_shard=8, ep=8, etp=2, ranks_per_node=8)) == (2, 4)
