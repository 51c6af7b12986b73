"""What collectives cost in the planner: TP's kinds at their own measured figures, DTensor's host
work per block where a CPU calibration measured it, nothing of either on a profile that has
neither (the published rows stay as they were), and no hiding behind compute where the cores
that compute also move the bytes (a CPU)."""

import dataclasses

import pytest

from trillion.models.presets import get_preset
from trillion.parallel.layout import Layout
from trillion.parallel.planner.assumptions import ASSUMED
from trillion.parallel.planner.cost import collective_time, dp_comm, step_time
from trillion.parallel.planner.hardware import Link, load_profile
from trillion.parallel.planner.memory import pipeline_ranks

ARGS = get_preset("llama3-8b")
TP8 = Layout(tp=8)
SEQ = 4096


def test_a_slower_reduce_scatter_costs_each_layer_its_four_reduce_scatters():
    stock = load_profile("dgx-h100")
    bandwidth = stock.intra_node[0].bandwidth_gbs
    slow = dataclasses.replace(
        stock, intra_node=(Link(8, bandwidth, (("reduce_scatter", bandwidth / 2, stock.link_latency_us),)),)
    )
    activation = SEQ * ARGS.dim * stock.element_bytes
    extra = collective_time(slow, activation, 8, 8, "reduce_scatter") - collective_time(
        stock, activation, 8, 8, "reduce_scatter"
    )
    assert extra > 0
    # per layer 2 reduce-scatters forward and 2 backward, the output's one backward
    expected = (4 * ARGS.n_layers + 1) * extra
    added = step_time(ARGS, slow, TP8, SEQ, ASSUMED).tp_exposed - step_time(ARGS, stock, TP8, SEQ, ASSUMED).tp_exposed
    assert added == pytest.approx(expected)


def test_dtensor_host_work_is_charged_per_block_and_pass_only_under_tp():
    stock = load_profile("dgx-h100")
    hosted = dataclasses.replace(stock, tp_layer_host_s=(1e-3, 2e-3))
    added = step_time(ARGS, hosted, TP8, SEQ, ASSUMED).total - step_time(ARGS, stock, TP8, SEQ, ASSUMED).total
    assert added == pytest.approx(ARGS.n_layers * 3e-3)
    no_tp = Layout(dp_shard=8)
    assert step_time(ARGS, hosted, no_tp, SEQ, ASSUMED).total == step_time(ARGS, stock, no_tp, SEQ, ASSUMED).total


def test_without_overlap_every_fsdp_collective_is_charged():
    stock = load_profile("dgx-h100")
    cpu_like = dataclasses.replace(stock, overlaps_collectives=False)
    fsdp = Layout(dp_shard=8, microbatches=4)
    per_microbatch, after_backward, before_forward = dp_comm(ARGS, cpu_like, fsdp, pipeline_ranks(ARGS, fsdp)[0])
    hidden = step_time(ARGS, stock, fsdp, SEQ, ASSUMED).dp_exposed
    charged = step_time(ARGS, cpu_like, fsdp, SEQ, ASSUMED).dp_exposed
    assert charged - hidden > 0.5 * 4 * per_microbatch  # most of it hid behind compute on the GPU profile
    assert charged >= 4 * per_microbatch + after_backward + before_forward


def test_a_ring_across_nodes_runs_over_as_many_nics_as_it_has_ranks_in_a_node():
    """NCCL runs one ring per NIC across nodes (nccl issue 812: 192 GB/s all-reduce bus bandwidth on a DGX A100's
    8 x 200 Gb/s): 16 ranks on 2 nodes of 8 move their bytes over 8 NICs at once; one rank per node (outside tp 8)
    over its own; never faster than the node's link."""
    hw = load_profile("dgx-h100")
    share = hw.node_bandwidth_gbs / hw.gpus_per_node * 1e9 * hw.collective_efficiency  # one GPU's NIC
    nbytes, latency = 1e9, hw.network_latency_us * 1e-6

    def seconds(group: int, span: int, bandwidth: float) -> float:
        return (group - 1) / group * nbytes / bandwidth + (group - 1) * latency

    assert collective_time(hw, nbytes, 16, 16, "reduce_scatter") == pytest.approx(seconds(16, 16, 8 * share))
    assert collective_time(hw, nbytes, 16, 32, "reduce_scatter") == pytest.approx(seconds(16, 32, 4 * share))
    assert collective_time(hw, nbytes, 16, 128, "all_gather") == pytest.approx(seconds(16, 128, share))
    fat = dataclasses.replace(hw, node_bandwidth_gbs=10 * hw.node_bandwidth_gbs)  # NICs faster than NVLink
    nvlink = hw.collective_link(8, False, "reduce_scatter")[0]
    assert collective_time(fat, nbytes, 16, 16, "reduce_scatter") == pytest.approx(seconds(16, 16, nvlink))
