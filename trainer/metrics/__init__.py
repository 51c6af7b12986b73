"""Metrics and profiling: per-step meters and where records go (meters.py: metrics.jsonl, W&B, TensorBoard,
the console), phase timers and the torch profiler (profiling.py), the pipeline schedule's timeline."""

from trillion.trainer.metrics.meters import MetricsSink, Progress, ThroughputMeter, device_peak_flops, peak_memory_gb

__all__ = ["MetricsSink", "Progress", "ThroughputMeter", "device_peak_flops", "peak_memory_gb"]
