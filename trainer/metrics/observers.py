"""What watches a run: its throughput and MFU, its step log (metrics.jsonl, W&B, TensorBoard, the
console), the torch profiler and the pipeline schedule's timeline, built once the model is."""

import dataclasses
import functools
import logging
from pathlib import Path

from trillion.models.flops import count_params, hardware_flops_per_token, model_flops_per_token
from trillion.parallel.layout import Layout
from trillion.parallel.modes import recompute_fraction, stages_recompute_fraction
from trillion.parallel.pipeline import Pipeline, bubble_fraction
from trillion.trainer.config import Config
from trillion.trainer.metrics.meters import MetricsSink, Progress, StepLog, ThroughputMeter, device_peak_flops
from trillion.trainer.metrics.pipeline_timeline import PipelineTimeline
from trillion.trainer.metrics.profiling import StepProfiler

log = logging.getLogger("trillion")


def build_observers(config: Config, env, model_args, layout: Layout, pipeline: Pipeline | None, step: int, dtype):
    """(throughput meter, step log, profiler, pipeline timeline) of a run about to continue from `step`, on
    the process `env` (a trillion.trainer.launch.LaunchEnv) describes, in `layout`."""
    t, output_dir = config.training, Path(config.job.output_dir)
    mode = layout.activation_checkpoint  # each pipeline stage checkpoints its own blocks
    recompute = (
        recompute_fraction(mode, model_args.n_layers)
        if pipeline is None
        else stages_recompute_fraction(mode, pipeline.blocks_per_stage)
    )
    meter = ThroughputMeter(  # as functions of the attention share document masking leaves
        functools.partial(model_flops_per_token, model_args, t.seq_len),
        functools.partial(hardware_flops_per_token, model_args, t.seq_len, recompute),
        device_peak_flops(env.device, config.metrics.peak_tflops),
    )
    params = count_params(model_args)
    log.info(
        "model %s: %.1fM parameters (%.1fM without embeddings%s), %s on %s, %d micro-batches per step",
        config.model.name,
        params.total / 1e6,
        params.non_embedding / 1e6,
        f", {params.active / 1e6:.1f}M active per token" if params.inactive else "",
        dtype,
        env.device,
        layout.microbatches,
    )
    resumed = step > 0
    sink = (
        MetricsSink(output_dir, config.logging, {"config": dataclasses.asdict(config)}, resume=resumed)
        if env.is_logging_rank
        else None
    )
    progress = Progress(t.steps, step, config.logging.progress_bar) if env.is_logging_rank else None
    step_log = StepLog(config.metrics.log_freq, step + 1, t.steps, sink, progress)
    profiler = StepProfiler(config.profiling, output_dir, env.rank, env.device)
    timeline = (
        PipelineTimeline(
            pipeline,
            config.profiling,
            step + 1,
            env.device,
            output_dir / "profiles",
            bubble_fraction(pipeline.pp, pipeline.n_microbatches, pipeline.virtual),
        )
        if pipeline is not None and config.profiling.enabled
        else None
    )
    return meter, step_log, profiler, timeline
