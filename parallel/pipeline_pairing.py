"""DualPipe's pairing across pipeline stages: under `pp_schedule=DualPipeV` with `parallel.ep_overlap`, each
OVERLAP_F_B action (one micro-batch's forward through one of this rank's two stages and another's backward
through the other, which torch's ScheduleDualPipeV emits in its steady state) runs the two together.

Under `pp_schedule=Interleaved1F1B` with `parallel.ep_overlap` the schedule is torch's with two changes
(`PairedInterleaved1F1B`), Kimi K2's recipe (arXiv 2507.20534: interleaved 1F1B whose extra warm-up micro-batches
let one micro-batch's all-to-alls overlap another's compute): each rank runs one forward more before its first
backward (modes.INTERLEAVED_EXTRA_WARMUP), and each steady-state forward runs paired with the backward after it.
Without the extra forward the pairs wait on each other: a rank's pair needs the gradient the next rank's pair
makes from this pair's own forward (one extra warm-up breaks that cycle at every pp and virtual-stage count the
tests run; tests/pipeline/test_interleaved_pairing.py checks the orders for deadlock). It costs one chunk's
activations more in flight on each rank, which `trillion estimate` replays from this schedule's own order.

The forward and the backward each run in a thread of their own and take turns, one at a time, handing the turn to
the other right after posting an expert all-to-all (ep_exchange.py; the Pair of expert_overlap.py with its
backward side): while one micro-batch's dispatch or combine travels, the other computes its attention, its experts
or their gradients. That is DeepSeek-V3's pairing (arXiv 2412.19437 section 3.2.1, Figure 4), Megatron-Core's
"batch-level EP all-to-all overlap". Both sides post their all-to-alls in the same order on every rank of an ep
group (they run the same schedule, the same stages and the same turns), so the collectives match. What torch's
runtime would do for the two sub-actions is done here, in the same order: the receives the two wait on, the
forward with its loss on the last stage and its local hand-over to the next stage on this rank (the V), the full
backward with its count towards the last backward (gradient sync), and its local hand-over to the previous stage.
The schedule defers the weight-gradient passes of the backwards outside OVERLAP_F_B (its zero-bubble steps).

Activation checkpointing composes: a recomputed forward runs inside the backward's graph task, so it is the
backward's side, and hands the turn over at its all-to-alls too (unlike a barrier counted per layer, which a
recompute unbalances). The forward runs under the step's autocast, entered again in its thread.

Under activation checkpointing a split-backward schedule (the zero-bubble ones, DualPipeV's ends) runs each input-
gradient pass as the full backward and its deferred weight-gradient pass as nothing (`join_weight_passes`): a weight
pass in a backward of its own would recompute every checkpointed region a second time, which selective
checkpointing refuses ("backward once on any region") and which would repeat the expert all-to-alls of replayed
blocks. The passes' order on every rank is the schedule's, so no collective changes place; the fill the deferred
passes gave the pipeline's ends is lost (the planner prices it: planner/schedules.py bubble_slots).

Relies on these internals of torch 2.13's _PipelineScheduleRuntime (check them on an upgrade): the custom function's
(action, _PipelineContext) call, `fwd_recv_ops` / `bwd_recv_ops` keyed by (stage, micro-batch), `_wait_batch_p2p`,
`_assert_unsharded`, `_maybe_compute_loss`, `_maybe_get_loss`, `backward_counter`, `_n_microbatches`, and the
stages' forward_one_chunk / backward_one_chunk / set_local_fwd_input / set_local_bwd_input /
get_local_bwd_output, as _step_microbatches's _perform_action uses them for FORWARD and FULL_BACKWARD.
"""

from __future__ import annotations

import copy

from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleInterleaved1F1B,
    _Action,
    _get_1f1b_rank_ops,
    _get_warmup_ops,
    _wait_batch_p2p,
)

from trillion.parallel.expert_overlap import Pair
from trillion.parallel.modes import INTERLEAVED_EXTRA_WARMUP


def pair_forwards_with_backwards(schedule, autocast_of, handovers: list, phase: int = 0) -> None:
    """Run `schedule`'s OVERLAP_F_B actions paired, each backward handing the turn straight back `phase` times before
    it starts (parallel.ep_pairing_phase); `autocast_of()` gives the step's autocast context; each action's count of
    turns handed over is appended to `handovers`."""
    schedule.register_custom_function(
        OVERLAP_F_B, lambda action, ctx: handovers.append(_overlapped(action, ctx, autocast_of(), phase))
    )


def join_weight_passes(schedule) -> None:
    """Each BACKWARD_INPUT of `schedule` runs the full backward, each BACKWARD_WEIGHT nothing (the module docstring)."""
    schedule.register_custom_function(BACKWARD_INPUT, _input_pass_in_full)
    schedule.register_custom_function(BACKWARD_WEIGHT, lambda action, ctx: None)


def _input_pass_in_full(action, ctx) -> None:
    schedule = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in schedule._stages}
    stage = stages[action.stage_index]
    _received_gradient(schedule, stages, stage, action.microbatch_index)
    _backward(schedule, stages, stage, action.microbatch_index)


def _received_gradient(schedule, stages: dict, stage, micro_batch: int) -> None:
    if not stage.is_last and stage.stage_index + 1 not in stages:  # a local hand-over needs no receive
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((stage.stage_index, micro_batch)))


def _overlapped(action, ctx, autocast, phase: int) -> int:
    schedule = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in schedule._stages}
    forward, backward = action.sub_actions
    ahead, behind = stages[forward.stage_index], stages[backward.stage_index]
    if not ahead.is_first and forward.stage_index - 1 not in stages:  # a local hand-over needs no receive
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((forward.stage_index, forward.microbatch_index)))
    _received_gradient(schedule, stages, behind, backward.microbatch_index)
    pair = Pair(backward_side=True, lead=phase)
    pair.run(
        lambda: _forward(schedule, ctx, stages, ahead, forward.microbatch_index, autocast),
        lambda: _backward(schedule, stages, behind, backward.microbatch_index),
    )
    return pair.handovers


def _forward(schedule, ctx, stages: dict, stage, micro_batch: int, autocast) -> None:
    schedule._assert_unsharded(stage)
    with copy.copy(autocast):  # its own: autocast's state is the thread's
        output = stage.forward_one_chunk(
            micro_batch, ctx.arg_mbs[micro_batch], ctx.kwarg_mbs[micro_batch], save_forward_output=False
        )
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, micro_batch)
    if stage.stage_index + 1 in stages:
        stages[stage.stage_index + 1].set_local_fwd_input(output, micro_batch)


def _backward(schedule, stages: dict, stage, micro_batch: int) -> None:
    schedule._assert_unsharded(stage)
    loss = schedule._maybe_get_loss(stage, micro_batch)
    schedule.backward_counter[stage.stage_index] += 1
    last = schedule.backward_counter[stage.stage_index] == schedule._n_microbatches
    stage.backward_one_chunk(micro_batch, loss=loss, full_backward=True, last_backward=last)
    if stage.stage_index - 1 in stages:
        stages[stage.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(micro_batch), micro_batch)


class PairedInterleaved1F1B(ScheduleInterleaved1F1B):
    """Interleaved 1F1B whose steady state runs each forward paired with the backward after it (one OVERLAP_F_B),
    every rank running INTERLEAVED_EXTRA_WARMUP forwards more before its first backward (the module docstring)."""

    def _calculate_single_rank_operations(self, rank):
        p, v, per_round, m = self.pp_group_size, self.n_local_stages, self.microbatches_per_round, self._n_microbatches
        warmup = min(_get_warmup_ops(rank, v, per_round, p, m) + INTERLEAVED_EXTRA_WARMUP, v * m)

        def forward_stage(step: int) -> int:  # torch's Interleaved1F1B's, over the longer warm-up
            return (step // per_round) % v * p + rank

        def backward_stage(step: int) -> int:
            return (v - 1 - (step - warmup) // per_round % v) * p + rank

        ops = _get_1f1b_rank_ops(v, p, warmup, v * m - warmup, warmup, rank, forward_stage, backward_stage)
        return _merge_steady_pairs([op for op in ops if op is not None])


def _merge_steady_pairs(ops: list) -> list:
    """`ops` with each forward that a full backward follows merged with it into one OVERLAP_F_B (the steady state's
    pairs; the warm-up's forwards and the cool-down's backwards stay alone)."""
    merged = []
    for op in ops:
        if op.computation_type == FULL_BACKWARD and merged and merged[-1].computation_type == FORWARD:
            merged[-1] = _Action(-1, OVERLAP_F_B, None, (merged[-1], op))
        else:
            merged.append(op)
    return merged
