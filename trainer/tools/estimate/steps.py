"""`trillion estimate --steps N`: the training loop itself, N steps as simulated ranks of the requested
layout on the fake backend, with a tiny model of the same depth and head counts.

What runs is trainer/train.py's `train`, unchanged: the launch environment (RANK, WORLD_SIZE, ...
set for the simulated rank, whose fake process group is already up), the embedded corpus and the
byte tokenizer (a cluster's data and tokenizer files are not here), the model on meta, parallelize
(TP plan, activation checkpointing, FSDP2) or the pipeline split, to_empty + init_weights, AdamW and
the LR schedule, train_step with its data-parallel token count, clipping and optimizer step, and the
metrics. The model keeps the preset's heads (so the same TP splits and FSDP groups exist) and, with
pipelining, its layers (the same stages); without, two activation-checkpointing periods of blocks.
It has two dimensions per head, a vocabulary just large enough for the byte tokenizer and divisible
by tp, and sequences of 4 tp tokens; each pipeline takes max(2, pp) micro-batches of one sequence.
Off for the run: compile, checkpoints, W&B. fp16 becomes bf16 (the trainer refuses fp16 across
ranks). Collectives on the fake backend complete without moving data, so losses and
norms are meaningless; what is shown is that every call of the loop runs with this mesh, these
shard shapes and this checkpointing.

What cannot run there is a pipeline schedule. torch.distributed.pipelining (2.13) starts its first
step by exchanging a vote and the stages' tensor metadata between neighbouring stages with
point-to-point receives (`dist.recv`, then `dist.recv_object_list`); the fake backend completes a
receive without writing into it, so the vote reads 0 (forcing metadata inference) and
recv_object_list reads an uninitialized length and tries to allocate it (139 TB when tried here).
With pp > 1 the run goes as far as the schedule's first step (stages split, parallelized and
initialized, PipelineStages and the schedule built, the optimizer made) and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import time
from dataclasses import dataclass

import torch.distributed as dist

from trillion.parallel.modes import checkpoint_mode
from trillion.parallel.pipeline import Pipeline
from trillion.trainer.assemble import build_model_args
from trillion.trainer.config.schema import Config, without_idle
from trillion.trainer.data.tokenizer import ByteTokenizer
from trillion.trainer.tools.estimate.rank import fake_world, quiet, target_dtype

SCHEDULE_ON_FAKE = (
    "the pipeline schedule cannot step on the fake backend: torch.distributed.pipelining exchanges a "
    "vote and the stages' tensor metadata by point-to-point receives before the first micro-batch, "
    "and fake receives return nothing (the metadata's length reads as garbage)"
)


class _ScheduleNotRun(Exception):
    """Raised in place of the pipeline schedule's step (see the module doc)."""


@dataclass
class StepsRun:
    rank: int
    steps: int  # steps completed
    seconds: float
    stopped: str | None  # why the loop stopped before its steps: the fake backend's limit (pipelines)
    failed: str | None  # the error the loop raised: a layout the trainer cannot run
    record: dict  # the trainer's last metrics record (values meaningless on the fake backend)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def tiny_config(config: Config, dims, steps: int, output_dir: str) -> Config:
    """The config with a tiny model and batch for `steps` steps in the same layout (see the module doc)."""

    args = build_model_args(config, 0, dims.layout)
    dim = 2 * args.n_heads
    microbatches = max(2, dims.pp)
    # without stages to split, two checkpointing periods of blocks show the loop as well as 128 would, in
    # seconds rather than minutes (DTensor's sharding propagation of the foreach optimizer grows with them)
    period = checkpoint_mode(dims.layout.activation_checkpoint).period
    layers = args.n_layers if dims.pp > 1 else min(args.n_layers, 2 * period)
    r = dataclasses.replace
    return without_idle(  # what evaluation, logging and the user's data would have read is idle here
        r(
            config,
            job=r(config.job, output_dir=output_dir, device="cpu"),
            model=r(
                config.model,
                n_layers=layers,
                dim=dim,
                ffn_dim=4 * dim,
                vocab_size=math.ceil(ByteTokenizer.vocab_size / dims.tp) * dims.tp,
            ),
            # the chunked TP overlap at a chunk count that divides the tiny sequence's 4 positions on a rank
            parallel=r(
                config.parallel,
                tp_overlap=math.gcd(config.parallel.tp_overlap, 4) if config.parallel.tp_overlap else 0,
            ),
            data=r(config.data, path="", name=""),
            tokenizer=r(config.tokenizer, kind="byte", path=""),
            training=r(
                config.training,
                steps=steps,
                seq_len=4 * dims.tp,
                micro_batch_size=1,
                exit_interval=0,
                global_batch_size=microbatches * dims.dp_size,
                exit_after_minutes=0.0,
                dtype="bf16" if config.training.dtype == "fp16" else config.training.dtype,
            ),
            checkpoint=r(config.checkpoint, interval=0, save_final=False),
            eval=r(config.eval, interval=0),  # the training step is measured; a fake pipeline could not evaluate either
            compile=r(config.compile, enabled=False),
            logging=r(config.logging, wandb=False, tensorboard=False, progress_bar="lines"),
            metrics=r(config.metrics, log_freq=1),
            profiling=r(config.profiling, enabled=False),
        )
    )


def run_steps(config: Config, world_size: int, steps: int, ranks: list[int]) -> tuple[list[StepsRun], str]:
    """`train` for `steps` steps of the tiny model as each of `ranks` of a fake world of the layout;
    also says what the tiny model and batch were."""
    from trillion.trainer.tools.estimate.dry_run import layout_dims, model_args_for, runnable_here
    from trillion.trainer.train import train

    config, _ = runnable_here(config)  # the estimate's note says so
    dims, _ = layout_dims(config, world_size)
    runs = []
    with tempfile.TemporaryDirectory(prefix="trillion-estimate-steps-") as folder:
        tiny = tiny_config(config, dims, steps, folder)
        for rank in ranks:
            start, stopped, failed, record = time.perf_counter(), None, None, {}
            with (
                fake_world(rank, dims.world_size),
                _launched_as(rank, dims.world_size),
                _every_group_fake(),
                _no_schedule_step(),
                quiet(),
            ):
                try:
                    record = train(tiny)
                except _ScheduleNotRun:
                    stopped = SCHEDULE_ON_FAKE
                except Exception as error:  # the finding itself: the loop does not run in this layout
                    failed = f"{type(error).__name__}: {error}"
            seconds, done = time.perf_counter() - start, record.get("step", 0)
            runs.append(StepsRun(rank=rank, steps=done, seconds=seconds, stopped=stopped, failed=failed, record=record))
    args = model_args_for(tiny, dims.layout)
    t = tiny.training
    model = (
        f"a tiny {config.model.name} ({args.n_layers} layers, {args.n_heads} heads of {args.head_dim}, vocabulary "
        f"{args.vocab_size}), {t.global_batch_size // dims.dp_size} micro-batches of {t.seq_len} tokens per "
        f"pipeline, {str(target_dtype(tiny)).removeprefix('torch.')}"
    )
    return runs, model


def summary(runs: list[StepsRun], model: str) -> list[str]:
    """What the runs showed, a line each, for people."""
    lines = [
        f"steps: trainer/train.py's loop with {model}, on the fake backend (values are meaningless there: "
        "collectives move no data)"
    ]
    for run in runs:
        outcome = (
            f"failed: {run.failed}"
            if run.failed
            else f"stopped before its first step: {run.stopped}"
            if run.stopped
            else f"ran {run.steps} step(s)"
        )
        lines.append(f"steps: as rank {run.rank}: {outcome} ({run.seconds:.1f} s)")
    return lines


@contextlib.contextmanager
def _launched_as(rank: int, world_size: int):
    """The launcher's variables a process of `rank` sees (eight processes per node)."""
    per_node = min(8, world_size)
    values = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank % per_node, "LOCAL_WORLD_SIZE": per_node}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(value) for name, value in values.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _every_group_fake():
    """Groups asked for with a backend (the checkpoint manager's gloo group) are fake too: a real
    gloo group would wait for peers that do not exist."""
    new_group = dist.new_group
    dist.new_group = lambda *args, backend=None, **kwargs: new_group(*args, **kwargs)
    try:
        yield
    finally:
        dist.new_group = new_group


@contextlib.contextmanager
def _no_schedule_step():
    """Pipeline.step raises _ScheduleNotRun instead of starting a schedule the fake backend cannot run."""

    def refuse(self, micro_batches, tokens):
        raise _ScheduleNotRun()

    step = Pipeline.step
    Pipeline.step = refuse
    try:
        yield
    finally:
        Pipeline.step = step
