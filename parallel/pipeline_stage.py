"""The PipelineStage our pipelines run: torch's, holding receive buffers only for micro-batches in flight;
and the forward-only cut of a schedule that evaluation runs.

Its own module so that importing parallel.pipeline (config checks, the planner, the estimate) does not
import torch.distributed.pipelining, which takes a second or more.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.schedules import _ComputationType, _PipelineScheduleRuntime

from trillion.parallel.pipeline_ahead import shape_inference

# What a forward-only run of a lowered schedule keeps: the forwards, their sends and receives, and FSDP's
# gathering of a stage's parameters around them (parallel/pipeline.py Pipeline.eval_schedule).
FORWARD_ACTIONS = frozenset(
    {
        _ComputationType.FORWARD,
        _ComputationType.SEND_F,
        _ComputationType.RECV_F,
        _ComputationType.UNSHARD,
        _ComputationType.RESHARD,
    }
)


def forward_only(schedule):
    """`schedule` (not yet run), for evaluation: the action lists of torch's schedule runtime (the looped
    and V schedules) cut to the forwards, so `schedule.eval` runs no backward action at all. torch's
    eval runs the whole list with `has_backward` off, the backward actions returning at once, except
    that a V schedule's local hand-over of an input gradient between a rank's two stages
    (get_local_bwd_output / set_local_bwd_input) asserts a backward. An overlapped forward + backward
    (DualPipeV) keeps its forward. What is left keeps each rank's order, so it cannot deadlock where the
    whole schedule did not: every wait left (a forward's receive) waits on a forward. Single-stage
    schedules (GPipe, 1F1B) check `has_backward` themselves and are returned as they are.

    Relies on `_PipelineScheduleRuntime.pipeline_order_with_comms` (rank -> the lowered `_Action`s,
    communication included, that `_step_microbatches` runs) and `_Action.sub_actions`."""
    if not isinstance(schedule, _PipelineScheduleRuntime):
        return schedule
    lowered = {}
    for rank, actions in schedule.pipeline_order_with_comms.items():
        kept = []
        for action in actions:
            if action.computation_type == _ComputationType.OVERLAP_F_B:
                kept.extend(a for a in action.sub_actions or () if a.computation_type == _ComputationType.FORWARD)
            elif action.computation_type in FORWARD_ACTIONS:
                kept.append(action)
        lowered[rank] = kept
    schedule.pipeline_order_with_comms = lowered
    return schedule


@contextlib.contextmanager
def _without_moe_traces(module):
    from trillion.models.moe import moe_layers
    from trillion.parallel.expert_parallel import forget_routes

    layers = moe_layers(module).values()
    tallies = [layer.load_tally.clone() for layer in layers]
    try:
        yield
    finally:
        for layer, tally in zip(layers, tallies):
            layer.load_tally.copy_(tally)
        forget_routes(module)


class InFlightReceiveStage(PipelineStage):
    """A PipelineStage that holds a micro-batch's receive buffers only while that micro-batch is in flight.

    torch (2.13) allocates, when a schedule first runs, a buffer for every micro-batch of the step for
    the activation coming in and one for the gradient coming back, and keeps them for the stage's life:
    2 m hidden states per stage, 8-27 GB per GCD in the paper's layouts (m = 320-512 micro-batches;
    experiments/frontier/ESTIMATE.md). Here each micro-batch's receive metadata (`_RecvInfo`) stays, but
    its buffer is allocated from `tensor_meta` (local shapes under DTensor, as torch does) when the
    receive is posted, and dropped after the micro-batch's backward_one_chunk. From then on only torch's
    own state refers to it, as long as autograd needs it: `fwd_cache` until the input-gradient pass,
    `backward_state` until a split backward's weight pass. On the last stage the micro-batch's loss,
    which the schedule keeps until the step ends, is detached after its backward, as torch detaches the
    stage's output: its graph would keep the received activation alive.

    Relies on these torch internals (check them on an upgrade):
    - `args_recv_info[chunk]` / `grad_recv_info[chunk]`: a tuple of `_RecvInfo` per micro-batch, built
      by `_setup_forward_recv_info` / `_setup_backward_recv_info` with `_make_tensor_from_meta(meta,
      self.device)`, and nothing else reading `self.device` in between (we build them on "meta");
    - `_RecvInfo.buffer` None with `tensor_meta` None means "no gradient comes" (`_get_recv_ops`,
      `_retrieve_recv_grads`), so a dropped buffer, whose `tensor_meta` stays, is allocated before
      either reads it;
    - schedules post a micro-batch's receive with get_fwd_recv_ops / get_bwd_recv_ops before its
      forward / backward, or hand it over with set_local_fwd_input / set_local_bwd_input (V schedules,
      which rebind `buffer`), and read no buffer of that micro-batch after its backward_one_chunk;
    - the loss backward_one_chunk gets is the schedule's `_internal_losses` entry, needed after that
      backward only for its value (handed to `step(losses=...)`).

    torch's metadata inference (the first step's forward and backward on empty tensors, to learn the
    shapes) leaves no trace in a mixture-of-experts stage: its loads are not tallied (balancing and the
    statistics see only real tokens) and the routes it cached for a recompute are dropped; nor in the
    losses multi-token prediction records (pipeline_ahead.py).

    Under parallel.defer_weight_grads the stage module's queue (deferred_weight_grads.py) takes weight gradients
    only during an input-gradient pass (`full_backward=False`), whose W the schedule runs later: a full backward
    computes them as it goes, as without deferral, holding nothing more.
    """

    def _forward_metadata_inference(self, *args, **kwargs):
        with _without_moe_traces(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        with _without_moe_traces(self.submod), shape_inference():
            return super()._backward_metadata_inference(*args, **kwargs)

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        with self._buffers_on_meta():
            super()._setup_forward_recv_info(num_microbatches, has_backward)
        self._drop_buffers(range(num_microbatches))

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        with self._buffers_on_meta():
            super()._setup_backward_recv_info(num_microbatches)
        self._drop_buffers(range(num_microbatches))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        self._allocate(self.grad_recv_info.get(bwd_chunk_id, ()))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        # torch zeroes the buffer of a gradient the next stage did not produce: it must exist
        self._allocate(
            [info for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs) if grad is None]
        )
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False) -> None:
        queue = getattr(self.submod, "weight_grad_queue", None)
        with queue.deferring(not full_backward) if queue is not None else contextlib.nullcontext():
            super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
        self._drop_buffers([bwd_chunk_id])
        if isinstance(loss, torch.Tensor) and not loss._is_view():
            # the schedule keeps every micro-batch's loss until the step ends, and its graph (saved
            # tensors freed, nodes not) reaches the received activation through that leaf's AccumulateGrad
            loss.detach_()

    def clear_runtime_states(self) -> None:
        """A step starts with no micro-batch in flight: drop what a forward-only or failed step left."""
        super().clear_runtime_states()
        self._drop_buffers(self.args_recv_info)

    def _allocate(self, infos) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    def _drop_buffers(self, chunks) -> None:
        for chunk in chunks:
            for info in (*self.args_recv_info.get(chunk, ()), *self.grad_recv_info.get(chunk, ())):
                if not info.is_root_arg:
                    info.buffer = None

    @contextlib.contextmanager
    def _buffers_on_meta(self):
        device, self.device = self.device, torch.device("meta")
        try:
            yield
        finally:
            self.device = device
