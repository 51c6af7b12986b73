"""`trillion train`: `set_up` builds a Run (config -> launch env -> data -> model -> optimizer ->
checkpoints and metrics, in docs/ARCHITECTURE.md's order, every check before any work); `train_loop`
steps it, one `train_step` (step.py) at a time; `train` is both."""

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trillion.errors import Interrupted, RunAborted
from trillion.models.moe import check_grouped_gemm
from trillion.models.step_hooks import StepHooks, find_step_hooks
from trillion.parallel.clip import clip_grad_norm_
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import Runner, map_tensors
from trillion.parallel.pipeline import Pipeline
from trillion.trainer.assemble import (
    batch_split,
    build_model_args,
    build_parallel_dims,
    build_runner,
    compute_dtype,
    validate_training,
)
from trillion.trainer.checkpoint import CheckpointManager
from trillion.trainer.checkpoint.folders import check_run_directory, write_run_config
from trillion.trainer.checkpoint.manager import RunRecord
from trillion.trainer.checkpoint.state import RunStates
from trillion.trainer.config import Config, to_toml
from trillion.trainer.config.schema import Training
from trillion.trainer.data import build_data_loader, build_tokenizer, held_out_fraction
from trillion.trainer.data.documents import step_attention_share
from trillion.trainer.evaluate import Evaluator, build_evaluator
from trillion.trainer.fault_tolerance import check_fault_tolerance, replica_group_config
from trillion.trainer.fault_tolerance.attach import FaultTolerantRun, join_replica_groups
from trillion.trainer.launch import LaunchEnv, RunDirectoryLock, check_same_config, init_launch_env, restarted
from trillion.trainer.metrics import ThroughputMeter, peak_memory_gb
from trillion.trainer.metrics.meters import StepLog
from trillion.trainer.metrics.observers import build_observers
from trillion.trainer.metrics.pipeline_timeline import PipelineTimeline
from trillion.trainer.metrics.profiling import PhaseTimer, StepProfiler
from trillion.trainer.optim import build_lr_scheduler, build_optimizer
from trillion.trainer.preflight import check_memory
from trillion.trainer.resilience import CheckpointAdvice, NonFiniteGuard, RunCounters, StopPolicy
from trillion.trainer.step import train_step

log = logging.getLogger("trillion")


@dataclasses.dataclass
class RunHooks:
    """The documented seam for changing what a step does without patching this module: `step` runs one
    optimizer step (train_step's signature), `clip` clips the gradients (clip_grad_norm_'s),
    `iteration(step)` is a context around each loop iteration. The fault-injection tests wrap them to
    crash, stall or signal in the middle of a step, or to make a gradient norm non-finite; the
    host-read counter opens one per step; the defaults are the real thing."""

    step: Callable = train_step
    clip: Callable = clip_grad_norm_
    iteration: Callable = lambda step: contextlib.nullcontext()  # noqa: E731 (wraps each loop iteration)


@dataclasses.dataclass
class Run:
    """A run set up and ready to step: everything the loop reads, each built once by `set_up`."""

    env: LaunchEnv
    dims: ParallelDims
    training: Training
    loader: object
    first_batch: list
    evaluator: Evaluator | None
    runner: Runner
    step_hooks: tuple[StepHooks, ...]  # the model parts' (models/step_hooks.py), found once at assembly
    pipeline: Pipeline | None
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    autocast: object
    counters: RunCounters
    checkpointer: CheckpointManager
    guard: NonFiniteGuard
    stop: StopPolicy
    meter: ThroughputMeter
    log: StepLog
    profiler: StepProfiler
    timeline: PipelineTimeline | None
    hooks: RunHooks
    lock: RunDirectoryLock | None  # rank 0's hold on the run directory
    advice: CheckpointAdvice
    replicas: FaultTolerantRun | None  # this job's replica group among the others (fault_tolerance.enabled)

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
        self.stop.close()
        self.profiler.close()
        self.checkpointer.close()
        self.log.close()
        if self.lock is not None:
            self.lock.release()


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
    # the runner's tensor of this step (the next step makes a new one), read on the host only when logged
    done = (loss, grad_norm, run.runner.ahead_loss, lr, tokens_per_device, share, start, start - data_start, timer)
    return StepDone(*done)


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


def set_up(config: Config, hooks: RunHooks) -> Run:
    """Launch env, layout and data first (a bad setting or an unreadable dataset fails before any model
    work), then the model, optimizer and checkpoints (resuming if the run has one), then the meters.
    Rank 0 holds the run directory's lock from here to Run.close."""
    job_start = time.monotonic()  # training.exit_after_minutes counts set-up and loading too
    config = replica_group_config(config)  # a fault-tolerant replica group's own run directory
    env = init_launch_env(config.job.device, config.job.collective_timeout_s)
    check_same_config(to_toml(config))
    validate_training(config, env)
    check_fault_tolerance(config)
    output_dir, lock = Path(config.job.output_dir), None
    if env.is_logging_rank:
        lock = RunDirectoryLock(output_dir)
        lock.acquire()
    try:
        if lock is not None:
            rejoining = restarted() or config.fault_tolerance.enabled  # a replica group takes the others' state
            check_run_directory(output_dir, overwrite=config.job.overwrite, restarted=rejoining)
        return _set_up_locked(config, hooks, env, job_start, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _set_up_locked(config: Config, hooks: RunHooks, env: LaunchEnv, job_start: float, lock) -> Run:
    t = config.training
    tokenizer = build_tokenizer(config.tokenizer)
    model_args = build_model_args(config, tokenizer.vocab_size)
    check_grouped_gemm(model_args, env.device, compute_dtype(t.dtype, env.device.type))
    dims = build_parallel_dims(config, env, model_args)
    groups = config.fault_tolerance.groups  # replica groups sharing each batch (1 without fault tolerance)
    micro_batch_size, n_microbatches = batch_split(t, dims.dp_size * groups)
    check_memory(
        dims.layout, model_args, env, model_name=config.model.name, global_batch_size=t.global_batch_size // groups
    )  # before any allocation or file
    loader, first_batch, evaluator = read_data(config, tokenizer, dims, micro_batch_size, env.device)
    dtype = compute_dtype(t.dtype, env.device.type)
    runner, pipeline, optimizer, scheduler, counters, checkpointer, replicas = build_training(
        config, env, model_args, dims, n_microbatches, loader, dtype
    )
    if counters.step > 0:  # the data position moved on: the batch read up front is not the next one
        first_batch = loader.next_batch()
    autocast = torch.autocast(env.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    if evaluator is not None and env.is_logging_rank:
        evaluator.keep_best(Path(config.job.output_dir), counters.step)
    return Run(
        env,
        dims,
        t,
        loader,
        first_batch,
        evaluator,
        runner,
        find_step_hooks(runner.model) + (replicas.step_hooks if replicas else ()),
        pipeline,
        optimizer,
        scheduler,
        torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16),
        autocast,
        counters,
        checkpointer,
        NonFiniteGuard(t.max_nonfinite_skips, counters),
        StopPolicy(t, counters.step, job_start),
        *build_observers(config, env, model_args, pipeline, counters.step, dtype, n_microbatches),
        replicas.wrap(hooks) if replicas else hooks,
        lock,
        CheckpointAdvice(config.checkpoint, env.world_size * groups, t.steps, env.is_logging_rank),
        replicas,
    )


def build_training(config: Config, env: LaunchEnv, model_args, dims: ParallelDims, n_microbatches: int, loader, dtype):
    """(runner, pipeline, optimizer, LR schedule, counters, checkpointer, replica group): the model materialized
    and parallelized, its optimizer, the run's newest checkpoint loaded into them if it has one, and, with fault
    tolerance, the group joined to the others (a group behind them copies a healthy one's state here)."""
    runner, pipeline = build_runner(config, dims, model_args, n_microbatches, env.device, dtype)
    torch.manual_seed(config.job.seed)
    optimizer = build_optimizer(runner.model, config.optimizer, env.device.type, model_args=model_args, dims=dims)
    scheduler = build_lr_scheduler(optimizer, config.lr_schedule, config.training.steps)
    counters = RunCounters()
    states = RunStates(
        [runner.model], [optimizer], scheduler, loader, counters, env.device, model_args, pipeline is None
    )
    checkpointer = CheckpointManager(
        Path(config.job.output_dir),
        config.checkpoint,
        states,
        RunRecord(to_toml(config), config.data),
        is_rank0=env.is_logging_rank,
    )
    checkpointer.resume()
    replicas = join_replica_groups(config, env.rank, env.world_size, states, checkpointer)
    if env.is_logging_rank:  # the run is accepted: its resolved settings become the directory's record
        write_run_config(Path(config.job.output_dir), to_toml(config))
    if counters.step >= config.training.steps:
        log.info(
            "%s already holds a run finished at step %d (training.steps=%d): nothing to train. Raise "
            "--training.steps to continue it, or give a new --job.output_dir for a fresh run.",
            config.job.output_dir,
            counters.step,
            config.training.steps,
        )
    return runner, pipeline, optimizer, scheduler, counters, checkpointer, replicas


def read_data(config: Config, tokenizer, dims: ParallelDims, micro_batch_size: int, device: torch.device):
    """(loader, first batch, evaluator): an empty or unreadable dataset, or evaluation set, fails here."""
    t = config.training
    dp_rank, dp_size = config.fault_tolerance.data_rank(dims.dp_rank, dims.dp_size)  # over every replica group
    if micro_batch_size < t.micro_batch_size:
        log.info(
            "training.micro_batch_size=%d is more than the %d sequences of each of the %d data-parallel ranks; "
            "using micro-batches of %d",
            t.micro_batch_size,
            micro_batch_size,
            dp_size,
            micro_batch_size,
        )
    loader = build_data_loader(
        config.data,
        tokenizer,
        seed=config.job.seed,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=micro_batch_size,
        held_out=held_out_fraction(config.eval),
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    first_batch = loader.next_batch()  # an empty or unreadable dataset fails here, before any model work
    evaluator = build_evaluator(
        config.eval,
        config.data,
        tokenizer,
        dims,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        micro_batch_size=micro_batch_size,
        device=device,
    )  # and its evaluation set
    return loader, first_batch, evaluator
