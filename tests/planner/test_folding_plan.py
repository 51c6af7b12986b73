"""The planner prices MoE parallel folding as the trainer runs it (parallel/planner/moe.py): a folded rank routes
its sequence-parallel share of the tokens (the expert GEMMs' rows, the dispatch's bytes), its ep group is
consecutive GPUs (one node for ep 8 with tp inside it), its experts are whole and sharded over the efsdp ranks the
folded region leaves; with etp = tp each expert is split over tp; `trillion plan` searches etp with ep."""

import dataclasses
import json

from trillion.models.presets import get_preset
from trillion.parallel.layout import Layout
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.moe import (
    dispatch_seconds,
    expert_gemm_seconds,
    expert_numel,
    expert_rows,
    members_per_node,
    routed_tokens,
)
from trillion.parallel.planner.space import expert_layouts
from trillion.trainer.cli.main import main

QWEN, H100 = get_preset("qwen3-235b-a22b"), load_profile("dgx-h100")
FOLDED = Layout(tp=4, dp_shard=8, ep=8, etp=1, ranks_per_node=8)  # Megatron's PP8 row's
SPLIT = dataclasses.replace(FOLDED, etp=4)


def test_a_folded_rank_routes_a_quarter_of_the_tokens_into_whole_experts():
    assert routed_tokens(4096, FOLDED) == 1024 and routed_tokens(4096, SPLIT) == 4096
    assert 4 * expert_rows(QWEN, 1024, 8, 1.0) == expert_rows(QWEN, 4096, 8, 1.0)
    # the same expert FLOPs a rank either way: a quarter of the rows through whole experts, or all of them through a
    # quarter of each expert (the split GEMMs are narrower, so no faster)
    folded = expert_gemm_seconds(QWEN, H100, routed_tokens(4096, FOLDED), 1, 8, 1.0)
    split = expert_gemm_seconds(QWEN, H100, routed_tokens(4096, SPLIT), 4, 8, 1.0)
    assert folded <= split


def test_a_folded_ep_group_of_8_is_one_node_and_sends_a_quarter_of_the_rows():
    assert members_per_node(FOLDED) == 8 and members_per_node(SPLIT) == 2  # tp 4 apart: 4 nodes of 2
    folded = dispatch_seconds(QWEN, H100, routed_tokens(4096, FOLDED), FOLDED, 1.0)
    split = dispatch_seconds(QWEN, H100, routed_tokens(4096, SPLIT), SPLIT, 1.0)
    inside = dispatch_seconds(QWEN, H100, 4096, dataclasses.replace(FOLDED, ranks_per_node=64), 1.0)
    assert folded < inside / 3  # the same NVLink, a quarter of the rows (and a latency)
    assert folded < split / 10  # ... where tp 4 apart the group crosses the network with every tp rank's copy


def test_the_experts_are_whole_and_sharded_over_what_the_folded_region_leaves():
    efsdp = FOLDED.efsdp
    assert efsdp == 4 and SPLIT.efsdp == 1  # dp_shard x tp / ep, or dp_shard / ep
    whole, split = expert_numel(QWEN, 1, 1, 8, efsdp), expert_numel(QWEN, 1, 4, 8, SPLIT.efsdp)
    assert whole[0] == 4 * split[0] and whole[1] == split[1]  # the same states a rank, gathered 4x wider folded


def test_the_pairs_the_search_considers_follow_the_folding_rule():
    pairs = expert_layouts(QWEN, tp=4, cp=1, dp_shard=8)
    assert (8, 1) in pairs and (32, 1) in pairs and (8, 4) in pairs and (1, 4) in pairs
    assert (2, 1) not in pairs and (64, 1) not in pairs  # not a multiple of tp 4, or more than dp_shard x tp


def test_trillion_plan_searches_etp_and_names_it(tmp_path, capsys):
    argv = ["plan", "--model", "qwen3-235b-a22b", "--hardware", "dgx-h100", "--gpus", "256", "--global-batch", "2048"]
    argv += ["--seq-len", "4096", "--tp", "2", "--pp", "1", "--ep", "8", "--micro-batch-size", "4"]
    argv += ["--activation-checkpoint", "full", "--dp-shard-mode", "zero3", "--top", "4", "--format", "json"]
    argv += ["--config-out", str(tmp_path / "best.toml")]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert {c["etp"] for c in data["candidates"]} == {1, 2}
    best = data["candidates"][0]
    assert best["etp"] == 1 and data["ep_choice"]["etp"] == 1 and "ep 8 etp 2" in data["ep_choice"]["why"]
    assert "etp = 1" in (tmp_path / "best.toml").read_text()
    assert main([*argv, "--etp", "2"]) == 0
    assert {c["etp"] for c in json.loads(capsys.readouterr().out)["candidates"]} == {2}
