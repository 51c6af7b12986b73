"""One optimizer step (`train_step`) and the step the non-finite guard may mask (`step_unless_flagged`).

The model's parts that keep state across steps take part through their step hooks
(trillion.models.step_hooks), found once when the run is assembled and passed in; a dense model
has none, and the step calls nothing for it."""

from collections.abc import Sequence

import torch

from trillion.models.step_hooks import StepHooks, find_step_hooks
from trillion.parallel.clip import clip_grad_norm_
from trillion.parallel.context_parallel import shard_batch
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import Runner, target_tokens, with_lookahead
from trillion.parallel.tensor_parallel import reduce_partial_grads
from trillion.trainer.metrics.profiling import PhaseTimer
from trillion.trainer.resilience import NonFiniteGuard


def train_step(
    runner: Runner,
    micro_batches,
    optimizer,
    scaler,
    autocast,
    max_grad_norm: float,
    dims: ParallelDims | None = None,
    guard: NonFiniteGuard | None = None,
    timer: PhaseTimer | None = None,
    *,
    clip=clip_grad_norm_,
    step_hooks: Sequence[StepHooks] | None = None,
):
    """One optimizer step: count tokens -> forward/backward -> reduce -> clip -> guard -> optimizer step.

    `runner` runs the micro-batches' forwards and backwards with the one loss, the mean over every
    target token of the global batch (parallel.forward_backward.Runner). The gradient norm spans its
    `clip_group` (the pipeline ranks) beyond the exact global one of the sharded layout. Under context
    parallelism each rank takes its share of every sequence first; token count and reported loss are
    summed over the ranks holding other tokens (data-parallel x cp, `dims`; FSDP sums the gradients).
    `step_hooks`: the model's, as the run found them at assembly; None finds them in `runner.model`
    now (for callers that build their own runner)."""
    dims = dims or ParallelDims(world_size=1)
    hooks = find_step_hooks(runner.model) if step_hooks is None else step_hooks
    # multi-token prediction's labels further on, stacked while every rank holds whole sequences
    micro_batches = with_lookahead(micro_batches, runner.lookahead)
    micro_batches = shard_batch(micro_batches, dims.cp_mesh)  # this cp rank's share of every sequence
    tokens = dims.all_reduce_dp(target_tokens(micro_batches))
    if hooks:
        token_scale = scaler.scale(1.0 / tokens)
        for hook in hooks:
            hook.before_step(token_scale)
    loss_sum = dims.all_reduce_dp(runner.forward_backward(micro_batches, tokens, autocast, scaler))
    if runner.ahead_loss is not None:  # summed as the loss is; one_step passes it on to be logged
        dims.all_reduce_dp(runner.ahead_loss)
    reduce_partial_grads(runner.model.parameters())
    if timer is not None:
        timer.mark("forward_backward")
    scaler.unscale_(optimizer)
    grad_norm = clip(runner.model.parameters(), max_grad_norm, runner.clip_group)
    if guard is None:
        scaler.step(optimizer)
    else:
        step_unless_flagged(optimizer, scaler, guard.flag(loss_sum, grad_norm, scaler))
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    for hook in hooks:
        hook.after_step(dims.all_reduce_routed)
    if timer is not None:
        timer.mark("optimizer")
    return loss_sum, grad_norm


def step_unless_flagged(optimizer, scaler, flagged: torch.Tensor) -> None:
    """The optimizer step, masked on the device by `flagged` (1.0: change nothing) where the optimizer
    takes a found-inf tensor (fused AdamW, as GradScaler drives it), so the host never waits for the
    flag; the foreach and for-loop implementations cannot be masked and read it on the host instead.
    Under fp16 the GradScaler masks the step itself (a non-finite loss makes the gradients non-finite)."""
    if scaler.is_enabled():
        scaler.step(optimizer)
    elif getattr(optimizer, "_step_supports_amp_scaling", False) and optimizer.defaults.get("fused"):
        optimizer.grad_scale, optimizer.found_inf = None, flagged
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif not flagged.item():  # a host read each step: optimizer.implementation=foreach or for-loop
        optimizer.step()
