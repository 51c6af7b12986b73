"""Latent attention (models/mla.py) under tensor, context, expert and pipeline parallelism reproduces one
process (tests/moe/harness.py, "model": "mla"): losses, gradient norms, every gradient (the replicated down
projections' and the shared rotary key's included), the initial weights and the routing, fp32 on gloo."""

import pytest

from tests.helpers.spawn import run_ranks
from tests.moe.harness import check_cases


def test_two_ranks_mla_tp2_and_cp2():
    run_ranks(
        check_cases,
        2,
        [
            {"name": "mla-tp2", "model": "mla", "dp_shard": 1, "tp": 2},
            {"name": "mla-cp2", "model": "mla", "dp_shard": 1, "cp": 2},  # k and v of different widths gathered
        ],
    )


@pytest.mark.slow  # four ranks on two cores
def test_four_ranks_mla_ep2_x_tp2_and_pp2_x_ep2():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "mla-ep2xtp2", "model": "mla", "dp_shard": 2, "tp": 2, "ep": 2},
            {"name": "mla-ep2xpp2", "model": "mla", "pp": 2, "dp_shard": 2, "ep": 2},
        ],
    )


@pytest.mark.slow
def test_two_ranks_mla_full_rank_queries_tp2():  # DeepSeek-V2-Lite's and Moonlight's wq, column-wise
    run_ranks(check_cases, 2, [{"name": "mla-full-q-tp2", "model": "mla-full-q", "dp_shard": 1, "tp": 2}])
