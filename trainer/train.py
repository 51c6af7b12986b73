"""`trillion train`: `set_up` (set_up.py) builds a Run, every check before any work; `train_loop` steps it, one
`train_step` (step.py) at a time; `train` is both."""

import contextlib
import dataclasses
import logging
import time

import torch

from trillion.errors import Interrupted, RunAborted
from trillion.parallel.forward_backward import map_tensors
from trillion.trainer.config import Config
from trillion.trainer.data.documents import step_attention_share
from trillion.trainer.metrics import peak_memory_gb
from trillion.trainer.metrics.profiling import PhaseTimer
from trillion.trainer.set_up import Run, RunHooks, set_up

log = logging.getLogger("trillion")


@dataclasses.dataclass
class StepDone:
    """One step's outputs as the loop reads them: loss and norm stay on the device until logged."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    ahead_loss: torch.Tensor | None  # the multi-token prediction modules' mean loss, with them
    lr: float
    tokens_per_device: float
    attention_share: float  # the attention work document masking left (1.0 without it): models/flops.py
    start: float  # perf_counter when the step's compute began
    data_seconds: float
    timer: PhaseTimer


def train(config: Config, *, hooks: RunHooks | None = None) -> dict:
    """Run the configured training; returns the last logged metrics record."""
    run = set_up(config, hooks or RunHooks())
    try:
        record = train_loop(run)
    except RuntimeError as error:  # torch.distributed.DistError included
        if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
            raise
        raise RunAborted(
            f"Rank {run.env.rank} of {run.env.world_size}: a collective did not complete within "
            f"job.collective_timeout_s={config.job.collective_timeout_s:g} s in step {run.counters.step + 1}; another "
            "rank is stuck or has died (its own log says why). The newest complete checkpoint is intact, and the same "
            "command resumes from it."
        ) from None
    finally:
        run.close()
    if run.stop.interrupted:
        raise Interrupted(
            f"interrupted (Ctrl-C) after step {run.counters.step} of {run.training.steps}: its checkpoint is saved, "
            "and the same command continues the run."
        )
    return record


def train_loop(run: Run) -> dict:
    """The steps from where the run stands to where this job stops; returns the last logged record."""
    record, checkpoint_seconds = {}, 0.0
    if run.evaluator is not None and run.counters.step == 0:  # as nanoGPT at iteration 0: the untrained model
        run.log.write({"step": 0, **evaluate(run, 0), "time": time.time()})
    for step in range(run.counters.step + 1, run.training.steps + 1):
        with run.hooks.iteration(step):
            done = one_step(run, step)
            last = run.stop.should_stop(step)
            stopping_early = bool(run.stop.reason)
            evaluated = run.evaluator is not None and run.evaluator.due(step, last)
            logged = run.log.should_log(step, last, evaluated)
            saving = run.checkpointer.due(step, last=last, stopping_early=stopping_early)
            if logged or saving or run.checkpointer.awaiting_confirmation:
                run.guard.check(step)  # the skipped-step flags since the last check, in one read
                run.checkpointer.confirm(step)
            values = step_values(done) if logged else None  # a logged step's host reads
            step_seconds = time.perf_counter() - done.start
            run.meter.add(done.tokens_per_device, step_seconds, done.data_seconds, done.attention_share)
            evaluation = evaluate(run, step) if evaluated else {}
            if logged:
                record = step_record(run, step, done, values, evaluation, checkpoint_seconds)
                run.log.write(record)
                checkpoint_seconds = 0.0
            else:
                run.log.tick(step)
            spent = run.checkpointer.maybe_save(step, last=last, stopping_early=stopping_early)
            checkpoint_seconds += spent
            if run.checkpointer.last_saved_step == step:
                run.advice.after_save(step, spent, step_seconds)
        if last:
            if stopping_early and run.checkpointer.last_saved_step == step:
                log.info("%s: checkpoint saved, exiting; the same command continues the run", run.stop.reason)
                run.stop.report_saved(run.checkpointer.root / f"step-{step:08d}")
            elif stopping_early:  # a non-finite step refused the save, or another replica group saves
                log.info("%s: exiting without a checkpoint of this step", run.stop.reason)
            break
    return record


def one_step(run: Run, step: int) -> StepDone:
    """Read the step's batch, run it, advance the counters and the LR schedule."""
    data_start = time.perf_counter()
    timer = PhaseTimer(run.env.device, sync=run.log.planned(step))
    batch = run.first_batch if step == run.log.first_step else run.loader.next_batch()
    device = run.env.device
    if device.type == "cuda":  # a copy from pageable memory would wait for the device; pinned memory does not
        batch = [map_tensors(mb, torch.Tensor.pin_memory) for mb in batch]
    micro_batches = [map_tensors(mb, lambda t: t.to(device, non_blocking=True)) for mb in batch]
    timer.mark("data")
    start = time.perf_counter()
    recording = run.timeline.recording(step) if run.timeline else contextlib.nullcontext()
    with run.profiler.snapshot_on_oom(), recording:
        t = run.training
        loss, grad_norm = run.hooks.step(
            run.runner,
            micro_batches,
            run.optimizer,
            run.scaler,
            run.autocast,
            t.max_grad_norm,
            run.dims,
            run.guard,
            timer,
            clip=run.hooks.clip,
            step_hooks=run.step_hooks,
        )
    run.profiler.step(step)
    run.counters.step, run.counters.tokens = step, run.counters.tokens + t.global_batch_size * t.seq_len
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    tokens_per_device = sum(x.numel() for x, _ in batch) * run.dims.dp_size / run.env.world_size
    share = step_attention_share(batch)  # from the host's document ids
    return StepDone(
        loss=loss,
        grad_norm=grad_norm,
        # the runner's tensor of this step (the next step makes a new one), read on the host only when logged
        ahead_loss=run.runner.ahead_loss,
        lr=lr,
        tokens_per_device=tokens_per_device,
        attention_share=share,
        start=start,
        data_seconds=start - data_start,
        timer=timer,
    )


def step_values(done: StepDone) -> dict:
    """A logged step's values read on the host: loss, grad_norm and, with multi-token prediction, mtp_loss."""
    values = {"loss": done.loss.item(), "grad_norm": done.grad_norm.item()}
    if done.ahead_loss is not None:
        values["mtp_loss"] = done.ahead_loss.item()
    return values


def evaluate(run: Run, step: int) -> dict:
    return run.evaluator.run(step, run.runner.model, run.dims, run.autocast, run.pipeline)


def step_record(run: Run, step: int, done: StepDone, values, evaluation: dict, checkpoint_seconds: float) -> dict:
    """The metrics.jsonl record of a logged step."""
    return {
        "step": step,
        **values,
        "lr": done.lr,
        **run.meter.report(),
        "memory_gb": peak_memory_gb(run.env.device),
        "time": time.time(),
        "skipped_steps": run.counters.skipped_steps,
        **{f"time_{phase}_s": seconds for phase, seconds in done.timer.seconds.items()},
        "time_checkpoint_s": checkpoint_seconds,
        **{name: value for hook in run.step_hooks for name, value in hook.statistics().items()},
        **evaluation,
    }
