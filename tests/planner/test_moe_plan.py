"""The planner's mixture-of-experts block (parallel/planner/moe.py) and its search over ep."""

import dataclasses
import json
import math

import pytest

from trillion.errors import ConfigError
from trillion.models.args import MoEArgs
from trillion.models.flops import count_params
from trillion.models.presets import get_preset
from trillion.parallel.layout import Layout
from trillion.parallel.planner.assumptions import ASSUMED, Assumptions
from trillion.parallel.planner.block_cost import layer_passes
from trillion.parallel.planner.cost import rank_passes
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.memory import RankParams, layout_memory, pipeline_ranks
from trillion.parallel.planner.moe import (
    dispatch_seconds,
    expert_gemm_seconds,
    expert_numel,
    host_read_stall,
    moe_passes,
    rank_load_imbalance,
)
from trillion.parallel.planner.search import Request, search
from trillion.parallel.planner.space import ep_degrees
from trillion.parallel.planner.timing import _gemm, all_to_all_time
from trillion.trainer.tools import plan_cli

H100 = load_profile("dgx-h100")


def _expert_params(args) -> int:
    """Every routed expert's parameters, from models/flops.py: inactive = (E - top_k) experts per MoE layer."""
    moe = args.moe
    return count_params(args).inactive * moe.n_experts // (moe.n_experts - moe.top_k)


@pytest.mark.parametrize("ep", [1, 2, 8, 32])
def test_expert_memory_is_total_expert_parameters_over_ep_times_expert_fsdp(ep):
    args = get_preset("qwen3-30b-a3b")
    dp_shard = 64
    efsdp = dp_shard // ep
    local, shard = expert_numel(args, args.n_layers, etp=1, ep=ep, efsdp=efsdp)
    total = _expert_params(args)
    assert total == args.n_layers * 128 * 3 * 2048 * 768
    assert shard * ep * efsdp == total  # exactly: total / (ep x efsdp)
    assert local * ep == total  # FSDP gathers one rank's E / ep experts
    # in the rank's states (RankParams.numel), the experts are that shard beside the FSDP-sharded rest
    rank = RankParams(args.n_layers, False, False, routed_layers=args.n_layers)
    with_ep = rank.numel(args, 1, dp_shard, ep)
    without_experts = RankParams(args.n_layers, False, False, routed_layers=args.n_layers).numel(args, 1, dp_shard, 1)
    assert with_ep[1] == without_experts[1]  # states per rank do not depend on ep
    assert without_experts[0] - with_ep[0] == total - local  # the gathered copy does


def test_states_count_every_parameter_of_the_model():
    """A one-stage rank's parameters (TP 1, no FSDP) are the model's, counted by models/flops.py."""
    for name in ("qwen3-30b-a3b", "mixtral-8x7b", "debug-moe"):
        args = get_preset(name)
        (rank,) = pipeline_ranks(
            args,
            Layout(),
        )
        assert rank.routed_layers == args.n_layers - args.moe.n_dense_layers
        assert rank.numel(args, 1, 1)[0] == count_params(args).total, name


def test_all_to_all_time_on_the_links_the_group_spans():
    tokens, ep = 4096, 8
    payload = tokens * 8 * 4096 * 2
    # ep x tp within the node: NVLink only (450 GB/s per direction at 80%, 3 us)
    inside = all_to_all_time(H100, payload, ep, tp=1)
    assert inside == pytest.approx(payload * 7 / 8 / (450e9 * 0.8) + 3e-6)
    # ep x tp = 16 spans two nodes: half the peers' shares go over the GPU's share of the network
    across = all_to_all_time(H100, payload, ep, tp=2)
    assert across == pytest.approx(payload * 4 / 8 / (400e9 / 8 * 0.8) + 5e-6)
    assert all_to_all_time(H100, payload, 1, tp=1) == 0.0


def test_moe_passes_charge_the_dispatch_both_ways_and_the_counts():
    """Without overlap every all-to-all is exposed: forward the counts (latency and the host read's stall), the
    dispatch and the combine; backward the two again. Per expert inside one node: top_k rows a token, 7/8 to peers."""
    args, tokens = get_preset("qwen3-235b-a22b"), 4096
    layout = Layout(ep=8, ep_dispatch="expert")
    one = dispatch_seconds(args, H100, tokens, layout, 1.0)
    row = args.dim * 2 + 2 * 4  # bf16 token, float32 weight and expert id
    assert one == pytest.approx(tokens * row * 8 * 7 / 8 / (450e9 * 0.8) + 3e-6)
    passes = moe_passes(args, H100, tokens, layout, 1.0)
    counts = 3e-6 + host_read_stall(H100)
    assert passes.ep_forward == pytest.approx(2 * one + counts)
    assert passes.ep_backward == pytest.approx(2 * one)
    assert moe_passes(args, H100, tokens, dataclasses.replace(layout, ep=1), 1.0).ep_forward == 0.0
    capacity = moe_passes(args, H100, tokens, dataclasses.replace(layout, ep_capacity=1.5), 1.0)
    assert capacity.ep_forward == pytest.approx(2 * one)  # no counts, no host read


def test_expert_gemms_at_per_expert_shapes_and_the_imbalance():
    args, tokens = get_preset("qwen3-30b-a3b"), 8192
    launch = H100.device.kernel_overhead_us * 1e-6
    rows = tokens * 8 * 4 // 128  # ep 4: each of the 32 local experts gets tokens x top_k x ep / E rows
    one = 2 * (_gemm(H100, rows, 2048, 768) - launch) + _gemm(H100, rows, 768, 2048) - launch
    assert expert_gemm_seconds(args, H100, tokens, 1, 4, 1.0) == pytest.approx(32 * one + 3 * launch)
    # the imbalance slows the busiest rank with ep > 1; with ep 1 the rank runs every routed token whatever it is
    assert expert_gemm_seconds(args, H100, tokens, 1, 4, 1.3) > expert_gemm_seconds(args, H100, tokens, 1, 4, 1.0)
    assert expert_gemm_seconds(args, H100, tokens, 1, 1, 1.3) == expert_gemm_seconds(args, H100, tokens, 1, 1, 1.0)


def test_one_expert_of_top_one_is_the_dense_mlp():
    """E = top_k = 1 at ep 1: the experts' GEMMs are the dense MLP's, the parameters the dense block's plus the
    router's dim x 1; what remains is the router and the routing's element-wise work."""
    dense = get_preset("debug")
    moe = dataclasses.replace(dense, moe=MoEArgs(n_experts=1, top_k=1, expert_ffn_dim=dense.ffn_hidden))
    tokens, f, h = 2 * 1024, dense.ffn_hidden, dense.dim
    mlp = 2 * _gemm(H100, tokens, h, f) + _gemm(H100, tokens, f, h)
    assert expert_gemm_seconds(moe, H100, tokens, 1, 1, 1.0) == pytest.approx(mlp)
    assert mlp == pytest.approx(
        layer_passes(dense, H100, 2, 1024, 1, False).weight_grad
        - layer_passes(moe, H100, 2, 1024, 1, False, routed=True).weight_grad
    )
    rank, dense_rank_params = RankParams(4, False, False, routed_layers=4), RankParams(4, False, False)
    assert rank.numel(moe, 1, 1)[0] == dense_rank_params.numel(dense, 1, 1)[0] + 4 * h  # the router: dim x 1 a layer
    moe_rank, _ = rank_passes(moe, H100, Layout(micro_batch_size=2), 1024, Assumptions(moe_load_imbalance=1.0), rank)
    dense_rank, _ = rank_passes(dense, H100, Layout(micro_batch_size=2), 1024, ASSUMED, dense_rank_params)
    router = _gemm(H100, tokens, h, 1)  # the weight gradient: the experts' are the MLP's, plus the router's
    assert moe_rank.weight_grad == pytest.approx(dense_rank.weight_grad + 4 * router)


def test_pipeline_ranks_count_their_moe_layers():
    args = get_preset("debug-moe")  # 4 layers, the first dense
    ranks = pipeline_ranks(
        args,
        Layout(pp=2, microbatches=2),
    )
    assert [(r.layers, r.routed_layers) for r in ranks] == [(2, 1), (2, 2)]
    v_shape = pipeline_ranks(
        args,
        Layout(pp=2, pp_schedule="ZBVZeroBubble", virtual_stages=2, microbatches=4),
    )
    assert [(r.layers, r.routed_layers) for r in v_shape] == [(2, 1), (2, 2)]  # rank 0: layers 0 and 3


def test_ep_degrees():
    assert ep_degrees(get_preset("llama3-8b"), 64) == [1]
    assert ep_degrees(get_preset("mixtral-8x7b"), 64) == [1, 2, 4, 8]
    assert ep_degrees(get_preset("qwen3-235b-a22b"), 24) == [1, 2, 4, 8]


def test_expert_parallelism_shrinks_fsdp_buffers_not_states():
    args = get_preset("qwen3-30b-a3b")
    base = Layout(dp_shard=8, microbatches=8, activation_checkpoint="full")
    ep1 = layout_memory(args, base, 4096, ASSUMED)
    ep8 = layout_memory(args, dataclasses.replace(base, ep=8), 4096, ASSUMED)
    assert ep8.optimizer == ep1.optimizer and ep8.parameters == ep1.parameters
    assert ep8.buffers < ep1.buffers  # one layer's 16 experts gathered instead of 128


def test_dense_presets_plan_ep_1_and_refuse_ep():
    request = Request("llama3-1b", get_preset("llama3-1b"), H100, 8, 16, 2048, fixed={"tp": 1, "pp": 1})
    assert {c.layout.ep for c in search(request).ranked} == {1}
    with pytest.raises(ConfigError, match="no routed experts"):
        search(dataclasses.replace(request, fixed={"ep": 2}))


def test_plan_qwen3_235b_on_256_h100_searches_ep_and_says_why(capsys):
    """The issue's command: the search picks an ep > 1 and the JSON carries ep and the reason."""
    argv = "--model qwen3-235b-a22b --hardware dgx-h100 --gpus 256 --global-batch 1024 --seq-len 4096"
    assert plan_cli.main([*argv.split(), "--format", "json", "--config-out", "", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["candidates"][0]
    assert best["ep"] > 1 and "ep_exposed" in best["time_shares"]
    assert out["ep_choice"]["ep"] == best["ep"] and out["ep_choice"]["why"].startswith(f"why ep {best['ep']}:")
    assert any(alt["ep"] == 1 for alt in out["ep_choice"]["alternatives"])
    assert math.isclose(best["tokens_per_s"] * best["step_time_s"], 1024 * 4096)


def test_rank_load_imbalance_from_expert_loads():
    loads = [91, 902, 21, 835, 599, 39, 493, 1116]  # debug-moe's first step, one layer (8 experts, top-2)
    assert rank_load_imbalance(loads, 8) == pytest.approx(1116 / (sum(loads) / 8))  # one expert per rank
    assert rank_load_imbalance(loads, 2) == pytest.approx((599 + 39 + 493 + 1116) / (sum(loads) / 2))
    assert rank_load_imbalance(loads, 1) == 1.0
