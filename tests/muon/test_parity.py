"""Muon under each layout equals one process (tests/muon/harness.py): 2 ranks in the default suite (FSDP zero3,
TP, EP, PP, MuonClip under TP and under dp), the rest of the issue's matrix marked slow."""

from tests.helpers.spawn import run_ranks
from tests.muon.harness import check_cases

TAU, PUMP = 2.0, 30.0  # head 0 of each layer starts with logits past tau, the others below

FAST_TWO = [
    {"name": "dp_shard 2 zero3", "dp_shard": 2},
    {"name": "tp 2", "tp": 2},
    {"name": "ep 2 (debug-moe)", "model": "moe", "dp_shard": 2, "ep": 2},
    {"name": "pp 2", "pp": 2},
    {"name": "MuonClip tp 2 (heads sharded)", "tp": 2, "qk_clip": TAU, "pump": PUMP},
    {"name": "MuonClip dp_shard 2 (maxima reduced)", "dp_shard": 2, "qk_clip": TAU, "pump": PUMP},
]


def test_muon_two_ranks_match_one_process():
    run_ranks(check_cases, 2, FAST_TWO)
