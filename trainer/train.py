"""`trillion train`: config -> launch env -> data -> model -> optimizer -> steps -> metrics, checkpoints."""

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch

from trillion.errors import RunAborted
from trillion.models import Transformer
from trillion.models.flops import count_params, hardware_flops_per_token, model_flops_per_token
from trillion.parallel.clip import clip_grad_norm_
from trillion.parallel.context_parallel import shard_batch
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import MicroBatchLoop, target_tokens
from trillion.parallel.modes import recompute_fraction, stages_recompute_fraction
from trillion.parallel.pipeline import bubble_fraction
from trillion.parallel.tensor_parallel import reduce_partial_grads
from trillion.trainer.assemble import (
    batch_split,
    build_model,
    build_model_args,
    build_parallel_dims,
    compute_dtype,
    validate_training,
)
from trillion.trainer.checkpoint.manager import CheckpointManager
from trillion.trainer.config.schema import Config, to_toml
from trillion.trainer.data.loader import build_data_loader, held_out_fraction
from trillion.trainer.data.tokenizer import build_tokenizer
from trillion.trainer.evaluate import build_evaluator
from trillion.trainer.launch.env import check_same_config, init_launch_env
from trillion.trainer.metrics.meters import MetricsSink, Progress, ThroughputMeter, device_peak_flops, peak_memory_gb
from trillion.trainer.metrics.pipeline_timeline import PipelineTimeline
from trillion.trainer.metrics.profiling import PhaseTimer, StepProfiler
from trillion.trainer.optim import build_lr_scheduler, build_optimizer
from trillion.trainer.preflight import check_memory
from trillion.trainer.resilience import NonFiniteGuard, RunCounters, StopPolicy

log = logging.getLogger("trillion")


def train_step(
    runner,
    micro_batches,
    optimizer,
    scaler,
    autocast,
    max_grad_norm: float,
    dims: ParallelDims | None = None,
    guard: NonFiniteGuard | None = None,
    timer: PhaseTimer | None = None,
):
    """One optimizer step: count tokens -> forward/backward -> reduce -> clip -> guard -> optimizer step.

    `runner` runs the micro-batches' forwards and backwards with the one loss, the mean over every
    target token of the global batch: parallel.forward_backward.MicroBatchLoop (gradient
    accumulation) or parallel.pipeline.Pipeline (its schedule). Its `model` holds the parameters to
    clip, and the norm spans its `clip_group` (the pipeline ranks) beyond the exact global one of
    the sharded layout. Under context parallelism each rank takes its share of every sequence first;
    token count and reported loss are summed over the ranks holding other tokens (data-parallel x cp,
    `dims`; FSDP sums the gradients)."""
    dims = dims or ParallelDims(world_size=1)
    micro_batches = shard_batch(micro_batches, dims.cp_mesh)  # this cp rank's share of every sequence
    tokens = dims.all_reduce_dp(target_tokens(micro_batches))
    loss_sum = dims.all_reduce_dp(runner.forward_backward(micro_batches, tokens, autocast, scaler))
    reduce_partial_grads(runner.model.parameters())
    if timer is not None:
        timer.mark("forward_backward")
    scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm_(runner.model.parameters(), max_grad_norm, runner.clip_group)
    if guard is None or guard.allows_update(loss_sum, grad_norm, scaler):
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if timer is not None:
        timer.mark("optimizer")
    return loss_sum, grad_norm


def train(config: Config) -> dict:
    """Run the configured training; returns the last logged metrics record."""
    job_start = time.monotonic()  # training.exit_after_minutes counts set-up and loading too
    env = init_launch_env(config.job.device, config.job.collective_timeout_s)
    check_same_config(config)
    validate_training(config, env)
    tokenizer = build_tokenizer(config.tokenizer)
    model_args = build_model_args(config, tokenizer.vocab_size)
    t = config.training
    dims = build_parallel_dims(config, env, model_args)
    micro_batch_size, n_microbatches = batch_split(t, dims.dp_size)
    check_memory(config, model_args, dims, env, micro_batch_size)  # before any allocation or file
    if micro_batch_size < t.micro_batch_size:
        log.info(
            "training.micro_batch_size=%d is more than the %d sequences of each of the %d data-parallel ranks; "
            "using micro-batches of %d",
            t.micro_batch_size,
            micro_batch_size,
            dims.dp_size,
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
        dp_rank=dims.dp_rank,
        dp_size=dims.dp_size,
    )
    first_batch = loader.next_batch()  # an empty or unreadable dataset fails here, before any model work
    evaluator = build_evaluator(config, tokenizer, dims, micro_batch_size, env.device)  # and its evaluation set

    output_dir = Path(config.job.output_dir)
    if env.is_logging_rank:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.toml").write_text(to_toml(config))

    dtype = compute_dtype(t.dtype, env.device.type)
    with torch.device("meta"):
        model = Transformer(model_args)
    parts, pipeline = build_model(config, dims, model, n_microbatches, env.device, dtype)
    for part in parts:
        part.to_empty(device=env.device)
        part.init_weights(config.job.seed)
    if pipeline is not None:
        pipeline.build()
    runner = (
        pipeline if pipeline is not None else MicroBatchLoop(parts[0], dims.tp_enabled, config.parallel.dp_shard_mode)
    )
    model = runner.model
    torch.manual_seed(config.job.seed)

    autocast = torch.autocast(env.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)
    optimizer = build_optimizer(model, config.optimizer, env.device.type)
    scheduler = build_lr_scheduler(optimizer, config.lr_schedule, t.steps)
    counters = RunCounters()
    checkpointer = CheckpointManager(
        output_dir,
        config.checkpoint,
        model_parts=[model],
        optimizers=[optimizer],
        scheduler=scheduler,
        loader=loader,
        counters=counters,
        config=config,
        model_args=model_args,
        device=env.device,
        is_rank0=env.is_logging_rank,
        whole_model=pipeline is None,
    )
    if checkpointer.resume():  # the data position moved on: the batch read up front is not the next one
        first_batch = loader.next_batch()
    if counters.step >= t.steps:
        log.info(
            "%s already holds a run finished at step %d (training.steps=%d): nothing to train. Raise "
            "--training.steps to continue it, or give a new --job.output_dir for a fresh run.",
            output_dir,
            counters.step,
            t.steps,
        )
    guard, stop = NonFiniteGuard(t.max_nonfinite_skips, counters), StopPolicy(t, counters.step, env.device, job_start)

    params = count_params(model_args)
    mode = config.parallel.activation_checkpoint  # each pipeline stage checkpoints its own blocks
    recompute = (
        recompute_fraction(mode, model_args.n_layers)
        if pipeline is None
        else stages_recompute_fraction(mode, pipeline.blocks_per_stage)
    )
    meter = ThroughputMeter(
        model_flops_per_token(model_args, t.seq_len),
        hardware_flops_per_token(model_args, t.seq_len, recompute),
        device_peak_flops(env.device, config.metrics.peak_tflops),
    )
    log.info(
        "model %s: %.1fM parameters (%.1fM without embeddings), %s on %s, %d micro-batches per step",
        config.model.name,
        params.total / 1e6,
        params.non_embedding / 1e6,
        dtype,
        env.device,
        n_microbatches,
    )
    sink = (
        MetricsSink(output_dir, config.logging, {"config": dataclasses.asdict(config)}, resume=counters.step > 0)
        if env.is_logging_rank
        else None
    )
    progress = Progress(t.steps, counters.step, config.logging.progress_bar) if env.is_logging_rank else None
    profiler = StepProfiler(config.profiling, output_dir, env.rank, env.device)
    timeline = (
        PipelineTimeline(
            pipeline,
            config.profiling,
            counters.step + 1,
            env.device,
            output_dir / "profiles",
            bubble_fraction(pipeline.pp, pipeline.n_microbatches, pipeline.virtual),
        )
        if pipeline is not None and config.profiling.enabled
        else None
    )

    record, first_step, checkpoint_seconds = {}, counters.step + 1, 0.0
    batch = first_batch
    if evaluator is not None and env.is_logging_rank:
        evaluator.keep_best(output_dir, counters.step)
    if evaluator is not None and counters.step == 0:  # as nanoGPT at iteration 0: the untrained model's eval loss
        evaluation = {"step": 0, **evaluator.run(0, model, dims, autocast, pipeline), "time": time.time()}
        if sink is not None:
            sink.write(evaluation)
            progress.update(0, evaluation)
    try:
        for step in range(first_step, t.steps + 1):
            data_start = time.perf_counter()
            timer = PhaseTimer(env.device, sync=step % config.metrics.log_freq == 0 or step in (first_step, t.steps))
            batch = batch if step == first_step else loader.next_batch()
            micro_batches = [
                (x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)) for x, y in batch
            ]
            timer.mark("data")
            step_start = time.perf_counter()
            with profiler.snapshot_on_oom(), timeline.recording(step) if timeline else contextlib.nullcontext():
                loss, grad_norm = train_step(
                    runner, micro_batches, optimizer, scaler, autocast, t.max_grad_norm, dims, guard, timer
                )
            profiler.step(step)
            guard.check(step)
            counters.step, counters.tokens = step, counters.tokens + t.global_batch_size * t.seq_len
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            last = stop.should_stop(step)
            evaluate = evaluator is not None and evaluator.due(step, last)
            if step % config.metrics.log_freq == 0 or step == first_step or last or evaluate:
                loss_value, grad_value = loss.item(), grad_norm.item()  # host syncs beyond the guard's one
            end = time.perf_counter()
            tokens_per_device = sum(x.numel() for x, _ in batch) * dims.dp_size / env.world_size
            meter.add(tokens_per_device, end - step_start, step_start - data_start)
            evaluation = evaluator.run(step, model, dims, autocast, pipeline) if evaluate else {}
            if step % config.metrics.log_freq == 0 or step == first_step or last or evaluate:
                record = {
                    "step": step,
                    "loss": loss_value,
                    "grad_norm": grad_value,
                    "lr": lr,
                    **meter.report(),
                    "memory_gb": peak_memory_gb(env.device),
                    "time": time.time(),
                    "skipped_steps": counters.skipped_steps,
                    **{f"time_{phase}_s": seconds for phase, seconds in timer.seconds.items()},
                    "time_checkpoint_s": checkpoint_seconds,
                    **evaluation,
                }
                checkpoint_seconds = 0.0
                if sink is not None:
                    sink.write(record)
                    progress.update(step, record)
            elif progress is not None:
                progress.update(step, None)
            periodic = config.checkpoint.interval > 0 and step % config.checkpoint.interval == 0
            save_start = time.perf_counter()
            if periodic or (last and (config.checkpoint.save_final or stop.reason)):
                checkpointer.save(step, blocking=last)
            else:
                checkpointer.poll()
            checkpoint_seconds += time.perf_counter() - save_start
            if last:
                if stop.reason:
                    log.info("%s: checkpoint saved, exiting; the same command continues the run", stop.reason)
                break
    except RuntimeError as error:  # torch.distributed.DistError included
        if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
            raise
        raise RunAborted(
            f"Rank {env.rank} of {env.world_size}: a collective did not complete within "
            f"job.collective_timeout_s={config.job.collective_timeout_s:g} s in step {step}; another rank "
            "is stuck or has died (its own log says why). The newest complete checkpoint is intact, and "
            "the same command resumes from it."
        ) from None
    finally:
        stop.close()
        profiler.close()
        checkpointer.close()
        if progress is not None:
            progress.close()
        if sink is not None:
            sink.close()
    return record
