"""Setting up a run of `trillion train` (train.py steps it): `set_up` builds a Run, every setting checked before
any work, in this order (docs/ARCHITECTURE.md "The flow of a run" follows it; tests/architecture/test_docs.py keeps
the two in step): the launch environment, the layout (assemble.resolve_layout), the tokenizer and the model's
arguments, ParallelDims and the memory pre-flight, the data, the model and optimizer with their checkpoint, then
the meters. `RunHooks` is the seam for changing what a step does."""

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trillion.models.moe import check_grouped_gemm
from trillion.models.step_hooks import StepHooks, find_step_hooks
from trillion.parallel.clip import clip_grad_norm_
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import Runner
from trillion.parallel.host_ema import HostEMA
from trillion.parallel.layout import Layout
from trillion.parallel.pipeline import Pipeline
from trillion.trainer.assemble import (
    build_model_args,
    build_parallel_dims,
    build_runner,
    check_async_tp,
    check_float8,
    compute_dtype,
    resolve_layout,
    validate_training,
)
from trillion.trainer.checkpoint import CheckpointManager
from trillion.trainer.checkpoint.folders import check_run_directory, write_run_config
from trillion.trainer.checkpoint.manager import RunRecord
from trillion.trainer.checkpoint.state import RunStates
from trillion.trainer.config import Config, to_toml
from trillion.trainer.config.schema import Training
from trillion.trainer.data import build_data_loader, build_tokenizer, held_out_fraction
from trillion.trainer.evaluate import Evaluator, build_evaluator
from trillion.trainer.fault_tolerance import check_fault_tolerance, replica_group_config
from trillion.trainer.fault_tolerance.attach import FaultTolerantRun, join_replica_groups
from trillion.trainer.launch import LaunchEnv, RunDirectoryLock, check_same_config, init_launch_env, restarted
from trillion.trainer.metrics import ThroughputMeter
from trillion.trainer.metrics.meters import StepLog
from trillion.trainer.metrics.observers import build_observers
from trillion.trainer.metrics.pipeline_timeline import PipelineTimeline
from trillion.trainer.metrics.profiling import StepProfiler
from trillion.trainer.optim import build_lr_scheduler, build_optimizer
from trillion.trainer.preflight import check_memory, check_planned_format
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


def set_up(config: Config, hooks: RunHooks) -> Run:
    """Launch env, layout and data first (a bad setting or an unreadable dataset fails before any model
    work), then the model, optimizer and checkpoints (resuming if the run has one), then the meters.
    Rank 0 holds the run directory's lock from here to Run.close."""
    job_start = time.monotonic()  # training.exit_after_minutes counts set-up and loading too
    config = replica_group_config(config)  # a fault-tolerant replica group's own run directory
    env = init_launch_env(config.job.device, config.job.collective_timeout_s)
    check_same_config(to_toml(config))
    validate_training(config, env)
    layout = resolve_layout(config, env.world_size)  # every layout setting, once (ParallelDims is built from it)
    check_float8(layout, env.device)
    check_async_tp(layout, env.device)
    check_planned_format(layout, config.job.hardware)
    check_fault_tolerance(config, layout)
    output_dir, lock = Path(config.job.output_dir), None
    if env.is_logging_rank:
        lock = RunDirectoryLock(output_dir)
        lock.acquire()
    try:
        if lock is not None:
            rejoining = restarted() or config.fault_tolerance.enabled  # a replica group takes the others' state
            check_run_directory(output_dir, overwrite=config.job.overwrite, restarted=rejoining)
        return _set_up_locked(config, hooks, env, layout, job_start, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _set_up_locked(config: Config, hooks: RunHooks, env: LaunchEnv, layout: Layout, job_start: float, lock) -> Run:
    t = config.training
    tokenizer = build_tokenizer(config.tokenizer)
    model_args = build_model_args(config, tokenizer.vocab_size, layout)
    check_grouped_gemm(model_args, env.device, compute_dtype(t.dtype, env.device.type))
    dims = build_parallel_dims(layout, model_args, t.seq_len, env)
    layout = dims.layout  # its stage split resolved against the model (parallel.pp_layout=auto)
    groups = config.fault_tolerance.groups  # replica groups sharing each batch (1 without fault tolerance)
    check_memory(  # before any allocation or file
        layout,
        model_args,
        env,
        optimizer=config.optimizer.name,
        model_name=config.model.name,
        global_batch_size=t.global_batch_size // groups,
    )
    loader, first_batch, evaluator = read_data(config, tokenizer, dims, env.device)
    dtype = compute_dtype(t.dtype, env.device.type)
    runner, pipeline, optimizer, scheduler, counters, checkpointer, replicas = build_training(
        config, env, model_args, dims, loader, dtype
    )
    if counters.step > 0:  # the data position moved on: the batch read up front is not the next one
        first_batch = loader.next_batch()
    autocast = torch.autocast(env.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    if evaluator is not None and env.is_logging_rank:
        evaluator.keep_best(Path(config.job.output_dir), counters.step)
    meter, step_log, profiler, timeline = build_observers(
        config, env, model_args, layout, pipeline, counters.step, dtype
    )
    return Run(
        env=env,
        dims=dims,
        training=t,
        loader=loader,
        first_batch=first_batch,
        evaluator=evaluator,
        runner=runner,
        step_hooks=find_step_hooks(runner.model) + (replicas.step_hooks if replicas else ()),
        pipeline=pipeline,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16),
        autocast=autocast,
        counters=counters,
        checkpointer=checkpointer,
        guard=NonFiniteGuard(t.max_nonfinite_skips, counters),
        stop=StopPolicy(t, counters.step, job_start),
        meter=meter,
        log=step_log,
        profiler=profiler,
        timeline=timeline,
        hooks=replicas.wrap(hooks) if replicas else hooks,
        lock=lock,
        advice=CheckpointAdvice(config.checkpoint, env.world_size * groups, t.steps, env.is_logging_rank),
        replicas=replicas,
    )


def build_training(config: Config, env: LaunchEnv, model_args, dims: ParallelDims, loader, dtype):
    """(runner, pipeline, optimizer, LR schedule, counters, checkpointer, replica group): the model materialized
    and parallelized, its optimizer, the run's newest checkpoint loaded into them if it has one, and, with fault
    tolerance, the group joined to the others (a group behind them copies a healthy one's state here)."""
    runner, pipeline = build_runner(config, dims, model_args, env.device, dtype)
    torch.manual_seed(config.job.seed)
    optimizer = build_optimizer(runner.model, config.optimizer, env.device.type, model_args=model_args, dims=dims)
    scheduler = build_lr_scheduler(optimizer, config.lr_schedule, config.training.steps)
    ema = None
    if config.optimizer.ema_decay > 0:  # the parameters' moving average, in host memory (parallel/host_ema.py)
        ema = HostEMA(runner.model, config.optimizer.ema_decay, env.device)
        ema.attach(optimizer)
    counters = RunCounters()
    states = RunStates(
        [runner.model], [optimizer], scheduler, loader, counters, env.device, model_args, pipeline is None, ema
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


def read_data(config: Config, tokenizer, dims: ParallelDims, device: torch.device):
    """(loader, first batch, evaluator): an empty or unreadable dataset, or evaluation set, fails here."""
    t, micro_batch_size = config.training, dims.layout.micro_batch_size
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
