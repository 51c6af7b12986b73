"""parallel.defer_weight_grads as the planner prices it (parallel/planner/deferred_weights.py): what a chunk's input
pass leaves queued, against what `trillion estimate`'s measurement finds a real backward's queue holding
(DeepSeek-V3's shapes on meta tensors); the rank's peak replayed in the schedule's order as the estimate replays it;
the bubble it fills; where the search turns it on."""

import dataclasses

import pytest
import torch

from trillion.models import PRESETS, parts
from trillion.models.transformer import Transformer
from trillion.parallel.activation_checkpoint import apply_activation_checkpointing
from trillion.parallel.deferred_weight_grads import defer_weight_grads
from trillion.parallel.float8 import convert
from trillion.parallel.layout import Float8Training, Layout
from trillion.parallel.planner import deferred_weights
from trillion.parallel.planner.deferred_weights import deferred_share, layer_deferred_bytes, queued_in_flight
from trillion.trainer.tools.estimate.activations import MicroBatchMemory, measure_micro_batch
from trillion.trainer.tools.estimate.pipeline_schedule import in_flight_peak

SEQ = 4096
DEEPSEEK = dataclasses.replace(PRESETS["deepseek-v3-671b"], n_layers=5, mtp_modules=0)  # 3 dense blocks, 2 MoE


@pytest.mark.parametrize(
    "float8, checkpoint",
    [
        (None, "none"),
        (Float8Training(emulate=True, experts="blockwise"), "none"),
        (Float8Training(emulate=True, experts="blockwise", cache_activations=True), "deepseek"),
    ],
)
def test_the_planned_queue_is_what_a_backward_leaves_queued(float8, checkpoint):
    """A micro-batch of 4096 tokens through DeepSeek-V3's blocks (bf16, or float8 linears and blockwise experts, their
    activations cached in float8 under DeepSeek's recompute): the bytes the queue holds after the backward, measured
    as `trillion estimate` measures (MemTracker on meta tensors), within 3% of the planner's (it leaves the float8
    scales out)."""
    with torch.device("meta"):
        model = Transformer(DEEPSEEK).to(torch.bfloat16)
    if float8 is not None:
        convert(model, float8)
    model.weight_grad_queue = defer_weight_grads(model)
    apply_activation_checkpointing(model, checkpoint)
    tokens = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    measured = measure_micro_batch(model, tokens, tokens, False, last=True).awaiting_weights
    layout = Layout(pp=2, pp_schedule="DualPipeV", defer_weight_grads=True, float8=float8)
    layout = dataclasses.replace(layout, activation_checkpoint=checkpoint)
    dense, moe = layer_deferred_bytes(DEEPSEEK, layout, SEQ)
    routed = sum(parts.routed_layer(DEEPSEEK, i) for i in range(DEEPSEEK.n_layers))
    planned = dense * (DEEPSEEK.n_layers - routed) + moe * routed
    assert planned == pytest.approx(measured, rel=0.03), (planned, measured)


@pytest.mark.parametrize("schedule, p, m", [("DualPipeV", 4, 8), ("DualPipeV", 8, 24), ("ZBVZeroBubble", 4, 8)])
def test_a_ranks_peak_with_queues_is_what_the_estimates_replay_finds(schedule, p, m):
    """queued_in_flight's peak on every rank equals pipeline_schedule.in_flight_peak's over the same order with each
    chunk holding its bytes forward and then its queued bytes until its W (no transient above them)."""
    layout = Layout(pp=p, pp_schedule=schedule, virtual_stages=2, microbatches=m, defer_weight_grads=True)
    for index in range(p):
        held, queued = (3.0, 5.0), (4.0, 1.0 + index)
        stages = (index, 2 * p - 1 - index)
        memory = {
            s: MicroBatchMemory(held=int(h), forward_peak=0, peak=int(h), grad_elements=0, awaiting_weights=int(q))
            for s, h, q in zip(stages, held, queued)
        }
        order = deferred_weights.rank_order(schedule, p, 2, m, index)
        peak, _ = in_flight_peak(order, memory, deferred=True)
        units, _ = queued_in_flight(layout, index, held, queued)
        assert units * sum(held) == pytest.approx(peak), (schedule, index)


def test_the_weight_passes_fill_the_bubble_by_the_share_that_defers():
    """Under DeepSeek's recompute DualPipeV's weight passes join their input passes without deferral; with it the
    bubble shrinks, by less where torchao's rowwise grouped product (which owns its backward) runs the experts."""
    from experiments.validation.predictions import load_runs, run_args, run_layout
    from trillion.parallel.planner.assumptions import Assumptions
    from trillion.parallel.planner.cost import step_time
    from trillion.parallel.planner.hardware import load_profile

    run = next(r for r in load_runs() if r["id"] == "deepseek-v3-671b-2048-h800")
    args, layout, profile = run_args(run), run_layout(run, run["gpus"]), load_profile(run["hardware"])

    def bubble(**changes) -> float:
        return step_time(args, profile, dataclasses.replace(layout, **changes), SEQ, Assumptions()).bubble

    rowwise = dataclasses.replace(layout.float8, experts="rowwise")
    assert (
        deferred_share(args, layout) == 1.0
        and 0.2 < deferred_share(args, dataclasses.replace(layout, float8=rowwise)) < 0.6
    )
    joined, deferred = bubble(defer_weight_grads=False), bubble(defer_weight_grads=True)
    partly = bubble(defer_weight_grads=True, float8=rowwise)
    assert deferred < 0.8 * joined and deferred < partly < bubble(defer_weight_grads=False, float8=rowwise)
