"""The pipeline schedule as the dry run (trainer/tools/estimate/dry_run.py) replays it on a rank: the
activation peak of the micro-batches it holds in flight, and its receive buffers.

What torch.distributed.pipelining (2.13) does that costs memory, as the real runs in
tests/estimate measure it:
- receive buffers: when its schedule first runs, torch's PipelineStage allocates one buffer per
  micro-batch of the step for the activation it receives (all stages but the first) and one for the
  gradient it receives (all but the last), and keeps them: 2 m hidden states on a middle stage. A
  stage class that holds them only while their micro-batch is in flight is recognized (it replaces
  torch's buffer set-up), and they are then counted with that micro-batch's activations;
- FSDP under a schedule: every backward runs with gradient sync and resharding off and the stage is
  reduce-scattered once after the last micro-batch, whatever parallel.dp_shard_mode says, so the
  stage's parameters stay gathered (compute dtype) and its gradients accumulate unsharded (fp32)
  through the step, as zero1 does without pipelining;
- in flight: the schedule's own action list (`pipeline_order`, built by the schedule class the
  trainer uses) says when each micro-batch's forward and backward run on each rank. Walking it
  with one micro-batch's measured bytes per stage gives the rank's activation peak: pp - s
  micro-batches on stage s under 1F1B, all m under GPipe and LoopedBFS, and under Interleaved1F1B
  the warm-up PyTorch's list holds ((v-1) pp + 2 (pp-1-r) + 1 chunks on rank r when m is a
  multiple of pp).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trillion.parallel.pipeline import Pipeline
from trillion.parallel.planner.schedules import leaf_actions
from trillion.trainer.tools.estimate.activations import MicroBatchMemory
from trillion.trainer.tools.estimate.rank import StagePlan


@dataclass(frozen=True)
class Schedule:
    order: dict[int, list]  # every pipeline rank's compute actions
    receives_in_flight: bool  # receive buffers live per micro-batch in flight, not for the whole step


def schedule_of(pipeline: Pipeline) -> Schedule:
    """What the schedule object the trainer builds does: its action list, and whether its stages
    replace torch's receive-buffer set-up (which allocates every micro-batch's buffers for good) with
    buffers that live only while their micro-batch is in flight (parallel/pipeline_stage.py)."""
    from torch.distributed.pipelining import PipelineStage

    pipeline.build()
    stage_class = type(pipeline.stages[0])
    in_flight = stage_class._setup_forward_recv_info is not PipelineStage._setup_forward_recv_info
    return Schedule(pipeline.schedule.pipeline_order, in_flight)


def with_receives(
    memory: dict[int, MicroBatchMemory], last_index: int, hidden_bytes: int
) -> dict[int, MicroBatchMemory]:
    """One micro-batch per stage with its receive buffers, when they live only while it is in flight:
    the activation's (all but the first stage) from its forward to its backward, the gradient's (all
    but the last) during its backward. The measurement made both before it started."""

    def one(index: int, m: MicroBatchMemory) -> MicroBatchMemory:
        activation, gradient = hidden_bytes * (index > 0), hidden_bytes * (index < last_index)
        return dataclasses.replace(
            m, held=m.held + activation, forward_peak=m.forward_peak + activation, peak=m.peak + activation + gradient
        )

    return {index: one(index, m) for index, m in memory.items()}


def in_flight_peak(actions: list, memory: dict[int, MicroBatchMemory], deferred: bool = False) -> tuple[int, int]:
    """(activation peak, most micro-batch chunks held at once) of a rank following `actions`: a
    forward keeps its stage's `held` bytes until that stage's full backward (B) or, under the
    zero-bubble schedules, its weight pass (W: the input-gradient pass I leaves the weights' inputs
    saved); with `deferred` (parallel.defer_weight_grads) the input pass frees them and what it queued
    (`awaiting_weights`) waits for the W instead. A forward or backward peaks at its own measured peak
    above what the others hold. Chunks of one stage are alike, so a backward frees "one of its stage's"
    rather than a numbered one: the single-stage schedules' lists (1F1B, GPipe) are built for display and
    number the last rank's micro-batches from 1, though their order of forwards and backwards is the runtime's."""
    live, waiting, peak, most = dict.fromkeys(memory, 0), dict.fromkeys(memory, 0), 0, 0

    def held() -> int:
        return sum(live[stage] * m.held + waiting[stage] * m.awaiting_weights for stage, m in memory.items())

    for action in leaf_actions(actions):
        kind, stage = action.computation_type.value, action.stage_index
        if kind == "F":
            peak = max(peak, held() + memory[stage].forward_peak)
            live[stage] += 1
            most = max(most, sum(live.values()))
        elif kind in ("B", "I"):
            peak = max(peak, held() - memory[stage].held + memory[stage].peak)
        if kind == "B" or (kind == "I" and deferred):
            live[stage] -= 1
            waiting[stage] += kind == "I"
        elif kind == "W":
            waiting[stage] -= deferred
            live[stage] -= not deferred
    return peak, most


def receive_bytes(plan: StagePlan, pp_rank: int, microbatches: int, hidden_bytes: int) -> int:
    """The schedule's receive buffers: per micro-batch, the activation in (all but the first stage)
    and the gradient in (all but the last), each the local shard of one micro-batch's hidden state."""
    return sum(
        microbatches * hidden_bytes * ((index > 0) + (index < plan.last_index)) for index in plan.indices(pp_rank)
    )
