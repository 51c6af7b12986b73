"""Muon under each layout equals one process (tests/muon/harness.py): 2 ranks in the default suite (FSDP zero3,
TP, EP, EP folded over TP, PP, MuonClip under TP and under dp), the rest of the issue's matrix marked slow."""

import pytest

from tests.helpers.spawn import run_ranks
from tests.muon.harness import check_cases

TAU, PUMP = 2.0, 30.0  # head 0 of each layer starts with logits past tau, the others below

FAST_TWO = [
    {"name": "dp_shard 2 zero3", "dp_shard": 2},
    {"name": "tp 2", "tp": 2},
    {
        "name": "ep 2 (debug-moe), in rounds of 8192 elements",
        "model": "moe",
        "dp_shard": 2,
        "ep": 2,
        "round_elements": 8192,
    },
    {"name": "pp 2", "pp": 2},
    # ep folded over the tp ranks (parallel.etp=1): the experts whole on their ep rank, the exchange over both
    {"name": "ep 2 over tp 2 (debug-moe, folded)", "model": "moe", "tp": 2, "ep": 2},
    {"name": "MuonClip tp 2 (heads sharded)", "tp": 2, "qk_clip": TAU, "pump": PUMP},
    {"name": "MuonClip dp_shard 2 (maxima reduced)", "dp_shard": 2, "qk_clip": TAU, "pump": PUMP},
]


def test_muon_two_ranks_match_one_process():
    run_ranks(check_cases, 2, FAST_TWO)


SLOW_TWO = [
    {"name": "dp_shard 2 zero1", "dp_shard": 2, "mode": "zero1"},
    {"name": "dp_shard 2 zero2", "dp_shard": 2, "mode": "zero2"},
    {"name": "cp 2", "cp": 2},
    {"name": "ep 2 with latent attention (debug-deepseek's kind)", "model": "mla", "dp_shard": 2, "ep": 2},
    {"name": "MuonClip tp 2, latent attention", "model": "mla", "tp": 2, "qk_clip": TAU / 2, "pump": PUMP},
    {"name": "MuonClip cp 2", "cp": 2, "qk_clip": TAU, "pump": PUMP},
]
FOUR = [
    {"name": "HSDP 2x2", "dp_replicate": 2, "dp_shard": 2},
    {"name": "dp 2 x tp 2", "dp_shard": 2, "tp": 2},
    {"name": "ep 2 x tp 2 (debug-moe, folded)", "model": "moe", "dp_shard": 2, "ep": 2, "tp": 2},
    {
        "name": "ep 2 x tp 2 (debug-moe, experts tensor-parallel)",
        "model": "moe",
        "dp_shard": 2,
        "ep": 2,
        "tp": 2,
        "etp": 2,
    },
]
EIGHT = [{"name": "tp 2 x pp 2 x dp 2", "tp": 2, "pp": 2, "dp_shard": 2}]


@pytest.mark.slow
def test_muon_two_ranks_breadth():
    run_ranks(check_cases, 2, SLOW_TWO)


@pytest.mark.slow
def test_muon_four_ranks_match_one_process():
    run_ranks(check_cases, 4, FOUR)


@pytest.mark.slow
def test_muon_eight_ranks_match_one_process():
    run_ranks(check_cases, 8, EIGHT)
