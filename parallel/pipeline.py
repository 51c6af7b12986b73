"""Pipeline parallelism with torch.distributed.pipelining: split the meta model into stages, wrap
each in a PipelineStage and run a schedule chosen by name.

Splitting deletes what a stage does not own (a Transformer skips parts set to None), so parameter
names stay global: checkpoints and `init_weights` see the same names whatever the layout. The split
takes n_layers + 2 units (the embedding, the layers, the output end) over pp * virtual stages: as
Layout.stage_layers says (pp_layout.py split_units: parallel.pp_layout written out or balanced by cost, or the
older layers-per-stage settings), else evenly, a remainder going to the middle stages.

Looped schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) hold `virtual` stages per
rank, placed r, r + pp, ...; the V-shaped ones (ZBVZeroBubble, DualPipeV) hold exactly two, placed r
and 2 pp - 1 - r (the schedule's own stage-to-rank map). The loss (forward_backward.token_loss) runs
on the last stage, normalized by the token count of the global batch exactly as without PP
(`scale_grads=False`: the schedule must not divide again), under loss parallelism with TP. Every
schedule is proven by a parity test.

The zero-bubble schedules split each backward into an input-gradient pass (dI) and a later
weight-gradient pass (dW). PipelineStage finds the weights' autograd nodes from `submod.parameters()`
at the dI pass (torch/distributed/pipelining/stage.py backward_maybe_with_nosync ->
_backward.py stage_backward_input), before FSDP's pre-backward hook has unsharded the module: a
block resharded after forward then lists its sharded DTensor parameters, which are not in the
graph, and that micro-batch's weight gradients were silently dropped (0.4-0.8 of the reference
gradient). So under these schedules no FSDP module of a stage reshards after forward (parallelize
decides it from the schedule it is given); that costs no memory at the peak, since PipelineStage
keeps stages gathered from their first backward anyway.

With TP the residual stream between stages is a sequence-sharded DTensor (tensor_parallel.py):
PipelineStage sends each rank's local shard with the DTensor's metadata, and the receiving stage
rebuilds it on its own tp mesh (`_mesh`); gradients travel back the same way.

Stages are InFlightReceiveStage (pipeline_stage.py): torch's PipelineStage keeps a receive buffer for
every micro-batch of the step (2 m hidden states per stage); ours holds them only while in flight.

Evaluation runs on stage objects of its own (over the same stage modules) and a schedule of its own,
forward-only: torch's `schedule.eval` runs the training schedule's actions with `has_backward` off,
which its runtime (the looped and V schedules) does not survive everywhere: a V schedule hands a
micro-batch's input gradient from a rank's second stage to its first locally (get_local_bwd_output),
which asserts a backward, so every ZBVZeroBubble or DualPipeV run crashed in its step-0 evaluation.
A separate schedule also leaves the training stages as training left them: sharing them, every
switch between evaluation and training re-ran torch's stage set-up (metadata inference, receive
buffers with or without requires_grad) on the training stages.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trillion.errors import ConfigError
from trillion.parallel.forward_backward import carried_inputs, token_loss
from trillion.parallel.layout import Layout
from trillion.parallel.modes import (
    SCHEDULES,
    check_layout_schedule,
    joins_weight_passes,
    pairs_across_stages,
    pairs_interleaved,
)
from trillion.parallel.pipeline_ahead import AheadOutputs
from trillion.parallel.pp_layout import check_stages, describe, split_units
from trillion.parallel.tensor_parallel import loss_context

log = logging.getLogger("trillion")


def validate_pipeline(layout: Layout, n_layers: int, *, tie_embeddings: bool = False, ahead_modules: int = 0):
    """Raise ConfigError for a pipeline this build cannot run with the model's `n_layers` (and `ahead_modules`
    multi-token prediction modules): the schedule's own rules (modes.check_layout_schedule, which the planner
    applies too), then the stage sizes (pp_layout.py check_stages)."""
    check_layout_schedule(layout, n_layers)
    check_stages(layout.stage_layers, n_layers, layout.pp * layout.virtual_stages, ahead_modules)
    if layout.pp == 1:  # stage sizes given without a pipeline are refused with the config (trainer/config/effects.py)
        return
    if tie_embeddings:
        raise ConfigError(
            "parallel.pp > 1 with tied input/output embeddings is not supported: the embedding and "
            "the output projection live on different stages. Use a model without tie_embeddings."
        )


def _queued(part: nn.Module):
    """The stage's `dw_builder` under parallel.defer_weight_grads: what its backward queued (deferred_weight_grads.py),
    run at the schedule's weight-gradient action; None (torch's own split) otherwise."""
    queue = getattr(part, "weight_grad_queue", None)
    return None if queue is None else queue.take


def bubble_fraction(pp: int, n_microbatches: int, virtual: int = 1) -> float:
    """The idle share of a step for GPipe/1F1B-type schedules: (p-1) / (v m + p - 1)."""
    return (pp - 1) / (virtual * n_microbatches + pp - 1)


def stage_module(model: nn.Module, units: range) -> nn.Module:
    """A copy of the (meta) model keeping only `units`; parameter names stay global. What the stage
    drops is never copied (deepcopy's memo maps it to None), so a stage of a 128-layer model costs
    its own layers, not the whole model. The last stage holds the output end (Transformer.output_end: the head
    and what runs with it) and a copy of what of the input end that reads (the embedding, for multi-token
    prediction: pipeline_ahead.py keeps the copies equal)."""
    n_layers = len(model.layers)
    last = n_layers + 1 in units
    dropped = [block for key, block in model.layers.items() if int(key) + 1 not in units]
    if 0 not in units:
        kept = model.output_end_reads() if last else []
        dropped += [getattr(model, name) for name in ("tok_embeddings", "pos_embeddings") if name not in kept]
    if not last:
        dropped += model.output_end()
    stage = copy.deepcopy(model, memo={id(part): None for part in dropped if part is not None})
    for key in [key for key, block in stage.layers.items() if block is None]:
        del stage.layers[key]
    return stage


def stage_indices(rank: int, pp: int, virtual: int, schedule: str = "") -> list[int]:
    """This rank's stage indices: r, r + pp, ... (looped), or r, 2 pp - 1 - r for a V-shaped schedule."""
    if schedule and SCHEDULES[schedule].v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(virtual)]


def stages_as_one_module(parts: list[nn.Module]) -> nn.Module:
    """This rank's pipeline stages as one module holding the same parameters under their global
    names (stages keep them), so the optimizer's parameter groups and the checkpoint's keys are
    those of the whole model whatever the number of stages per rank. Never called: the schedule
    runs the stages."""
    union = nn.Module()
    union.layers = nn.ModuleDict()
    for part in parts:
        for name, child in part.named_children():  # a stage's missing parts are None and skipped
            if name == "layers":
                union.layers.update(child)
            elif not hasattr(union, name):  # a V's last stage's copy of the embedding: the first stage's is stepped
                union.add_module(name, child)
    return union


class Pipeline:
    """This rank's stages, their schedule and the loss; `forward_backward` runs one optimizer step's
    micro-batches (the interface of forward_backward.MicroBatchLoop), all as `dims.layout` says (its schedule, stages
    per rank, stage sizes and micro-batches). `parallelize_fn` is applied to each stage (parallelize)."""

    def __init__(self, model: nn.Module, dims, device: torch.device, *, parallelize_fn=None):
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        from trillion.parallel.pipeline_stage import InFlightReceiveStage

        layout = dims.layout
        validate_pipeline(
            layout,
            len(model.layers),
            tie_embeddings=model.args.tie_embeddings,
            ahead_modules=model.args.mtp_modules,
        )
        name, v, n_microbatches = layout.pp_schedule, layout.virtual_stages, layout.microbatches
        pp_mesh = dims.mesh["pp"]
        self.pp_group, self.pp_rank, self.pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), dims.pp
        self.name, self.virtual, self.n_microbatches = name, v, n_microbatches
        # pp_layout's M: the multi-token prediction modules beside O
        ranges = split_units(len(model.layers), dims.pp * v, layout.stage_layers, model.args.mtp_modules)
        self.blocks_per_stage = [sum(1 for unit in r if 1 <= unit <= len(model.layers)) for r in ranges]  # all ranks'
        self.parts, self.stages = [], []
        for index in stage_indices(self.pp_rank, dims.pp, v, name):
            part = stage_module(model, ranges[index])
            if parallelize_fn is not None:
                parallelize_fn(part)
            self.parts.append(part)
        self._make_stage = lambda part, index: InFlightReceiveStage(
            part, index, dims.pp * v, device, group=self.pp_group, get_mesh=self._mesh, dw_builder=_queued(part)
        )
        self._schedule_cls = get_schedule_class(name)
        self._single = issubclass(self._schedule_cls, PipelineScheduleSingle)
        self.tokens = None
        self.dims = dims
        self.pairs = pairs_across_stages(dims.layout)  # each OVERLAP_F_B paired (pipeline_pairing.py)
        if pairs_interleaved(dims.layout):  # its pairs need the extra warm-up of our schedule
            from trillion.parallel.pipeline_pairing import PairedInterleaved1F1B

            self._schedule_cls = PairedInterleaved1F1B
        self.autocast = contextlib.nullcontext()  # the step's, for the paired forwards' threads
        self.handovers: list[int] = []  # per paired action, the turns its two sides handed each other
        self.eval_stages, self._eval_schedule = [], None  # made by the first evaluation
        self.ahead = AheadOutputs(model.args, model.output_end_reads())  # multi-token prediction, if it trains
        self.lookahead = self.ahead.depths
        log.info(
            "pipeline: %s, %d stages (%d per rank) over pp=%d, %d micro-batches, bubble (p-1)/(v m+p-1) = %.1f%%; "
            "stages (parallel.pp_layout): %s",
            name,
            dims.pp * v,
            v,
            dims.pp,
            n_microbatches,
            100 * bubble_fraction(dims.pp, n_microbatches, v),
            describe([len(units) for units in ranges], len(model.layers), self.ahead.depths),
        )

    def build(self) -> None:
        """After `to_empty` + `init_weights` of every part: the stages and the schedule."""
        indices = stage_indices(self.pp_rank, self.pp, self.virtual, self.name)
        self.stages = [self._make_stage(part, index) for part, index in zip(self.parts, indices)]
        stages = self.stages[0] if self._single else self.stages
        self.schedule = self._schedule_cls(stages, self.n_microbatches, loss_fn=self._loss, scale_grads=False)
        from trillion.parallel.pipeline_pairing import join_weight_passes, pair_forwards_with_backwards

        if self.pairs:
            phase = self.dims.layout.ep_pairing_phase
            pair_forwards_with_backwards(self.schedule, lambda: self.autocast, self.handovers, phase)
        if joins_weight_passes(self.dims.layout):
            join_weight_passes(self.schedule)
        self.model = stages_as_one_module(self.parts)
        self.ahead.find_copies(self.parts, self.dims.mesh["pp"], self.pp_rank, SCHEDULES[self.name].v_shape)

    @property
    def ahead_loss(self) -> torch.Tensor | None:
        return self.ahead.loss

    @property
    def clip_group(self):
        """The gradient norm adds up over the pipeline ranks."""
        return self.pp_group

    def _mesh(self, names: tuple[str, ...], _layout):
        """The mesh a received DTensor activation lives on (the tp axis), for PipelineStage to rebuild it."""
        return self.dims.mesh[names]

    def _loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple):  # with multi-token prediction's logits: pipeline_ahead.py
            return self.ahead.loss_to_differentiate(output, labels, self.tokens)
        return token_loss(output, labels, self.tokens)

    def forward_backward(self, micro_batches, tokens: torch.Tensor, autocast, scaler) -> torch.Tensor:
        """`step` under autocast, which changes only the forwards the schedule interleaves with
        backwards. No loss scaling: fp16 runs in one process only, so never with a pipeline."""
        assert not scaler.is_enabled(), "fp16 loss scaling under a pipeline"
        self.autocast = autocast
        with autocast:
            return self.step(micro_batches, tokens)

    def step(self, micro_batches, tokens: torch.Tensor) -> torch.Tensor:
        """Forward and backward of all micro-batches; returns the loss summed over them on every pp rank
        (before the data-parallel sum)."""
        self.ahead.start_step(micro_batches[0][0].device)
        loss = self._run(self.schedule.step, micro_batches, tokens, **self.ahead.stage_inputs(micro_batches))
        self.ahead.finish_step(self.pp_group)
        return self.ahead.trunk_loss(loss)

    @torch.no_grad()
    def evaluate(self, micro_batches) -> torch.Tensor:
        """Forward only: the summed token loss of the micro-batches on every pp rank (before the
        data-parallel sum). It runs on the evaluation's own stages and schedule (`eval_schedule`), so
        the training stages and schedule are left as they were; the evaluation stages then drop what
        the forwards left (outputs, receive buffers)."""
        schedule = self.eval_schedule()
        loss = self._run(schedule.eval, micro_batches, torch.ones((), device=micro_batches[0][0].device))
        for stage in self.eval_stages:
            stage.clear_runtime_states()
        return loss

    def eval_schedule(self):
        """The evaluation's schedule, made on first use (on every pp rank at once, as evaluation runs):
        the training schedule's class over new stage objects wrapping the same stage modules, its actions
        cut to the forwards (`forward_only`), run by torch's `schedule.eval` (no backward, receive buffers
        that need no gradient, no loss scaling)."""
        if self._eval_schedule is None:
            from trillion.parallel.pipeline_stage import forward_only

            indices = stage_indices(self.pp_rank, self.pp, self.virtual, self.name)
            self.eval_stages = [self._make_stage(part, index) for part, index in zip(self.parts, indices)]
            stages = self.eval_stages[0] if self._single else self.eval_stages
            schedule = self._schedule_cls(stages, self.n_microbatches, loss_fn=self._loss, scale_grads=False)
            self._eval_schedule = forward_only(schedule)
        return self._eval_schedule

    def _run(self, schedule_step, micro_batches, tokens: torch.Tensor, **stage_inputs) -> torch.Tensor:
        if len(micro_batches) != self.n_microbatches:
            raise ValueError(f"pipeline built for {self.n_microbatches} micro-batches, got {len(micro_batches)}")
        self.tokens = tokens
        inputs = torch.cat([x for x, _ in micro_batches])
        labels = torch.cat([y for _, y in micro_batches])
        losses = []
        first = self.pp_rank == 0
        with loss_context(self.dims.tp_enabled):  # the last stage's loss forward and backward
            # return_outputs=False: the last stage would otherwise keep every micro-batch's logits
            carried = {**carried_inputs(micro_batches), **stage_inputs}
            schedule_step(*((inputs,) if first else ()), target=labels, losses=losses, return_outputs=False, **carried)
        losses = [part.to_local() if isinstance(part, DTensor) else part for part in losses]
        loss = (
            torch.stack([part.detach() for part in losses]).sum() if losses else torch.zeros((), device=inputs.device)
        )
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage's rank holds it: the others add zero
        return loss
