"""Per-stage timeline of pipeline steps: when each stage ran a forward or a backward of which
micro-batch and when it waited, gathered over the pipeline ranks into one Chrome/Perfetto trace
(`profiles/pipeline-stepN.json`, one row per pipeline rank), with the measured idle share logged
next to the configured bubble (p-1)/(v m+p-1).

Recorded on the profiler's active steps only (profiling.enabled): every action then waits for the
device at both ends, so a bar is that action's compute and a gap is time spent waiting on the
neighbouring stages (the bubble plus point-to-point transfers)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trillion.trainer.config.schema import Profiling as ProfilingConfig

log = logging.getLogger("trillion")
ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")  # PipelineStage's, per micro-batch


def is_profiled_step(cfg: ProfilingConfig, step: int, first_step: int) -> bool:
    """The steps torch.profiler records as active: the schedule counts from the first step of this job."""
    if not cfg.enabled:
        return False
    cycle, position = divmod(step - first_step, cfg.wait + cfg.warmup + cfg.active)
    return (cfg.repeat == 0 or cycle < cfg.repeat) and position >= cfg.wait + cfg.warmup


def _action_name(method: str, kwargs: dict) -> str:
    if method == "forward_one_chunk":
        return "forward"
    if method == "backward_weight_one_chunk":
        return "backward (weights)"
    return "backward" if kwargs.get("full_backward", True) else "backward (inputs)"


class PipelineTimeline:
    """Times the actions of `pipeline.stages` (parallel.pipeline.Pipeline) on profiled steps."""

    def __init__(
        self, pipeline, cfg: ProfilingConfig, first_step: int, device: torch.device, trace_dir: Path, bubble: float
    ):
        self.pipeline, self.device, self.trace_dir, self.bubble = pipeline, device, trace_dir, bubble
        self.cfg, self.first_step = cfg, first_step
        self.events: list[tuple[str, int, int, float, float]] = []  # (action, stage, micro-batch, start, end)
        self.timing = False
        for stage in pipeline.stages:
            for method in ACTIONS:
                setattr(stage, method, self._timed(stage.stage_index, method, getattr(stage, method)))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timed(self, stage_index: int, method: str, action):
        def timed(micro_batch, *args, **kwargs):
            if not self.timing:
                return action(micro_batch, *args, **kwargs)
            self._sync()
            start = time.perf_counter()
            result = action(micro_batch, *args, **kwargs)
            self._sync()
            self.events.append((_action_name(method, kwargs), stage_index, micro_batch, start, time.perf_counter()))
            return result

        return timed

    @contextlib.contextmanager
    def recording(self, step: int):
        """Around a training step: records it if the profiler does (an error inside skips the write)."""
        profiled = is_profiled_step(self.cfg, step, self.first_step)
        if profiled:
            self.start()
        yield
        if profiled:
            self.finish(step)

    def start(self) -> None:
        dist.barrier(group=self.pipeline.pp_group)  # rank clocks differ; a common start aligns the rows
        self._sync()
        self.events, self.timing, self.step_start = [], True, time.perf_counter()

    def finish(self, step: int) -> dict | None:
        """After the step: gather every pipeline rank's actions; the first pipeline rank writes the trace.
        Returns {pipeline rank: idle fraction} there, None elsewhere."""
        self._sync()
        self.timing, wall = False, time.perf_counter() - self.step_start
        mine = {
            "rank": self.pipeline.pp_rank,
            "wall": wall,
            "events": [(a, s, m, t0 - self.step_start, t1 - self.step_start) for a, s, m, t0, t1 in self.events],
        }
        everyone = [None] * self.pipeline.pp
        dist.all_gather_object(everyone, mine, group=self.pipeline.pp_group)
        if self.pipeline.pp_rank != 0:
            return None
        idle = {r["rank"]: 1 - sum(t1 - t0 for *_, t0, t1 in r["events"]) / r["wall"] for r in everyone}
        self._write(step, everyone)
        log.info(
            "pipeline timeline step %d: idle %s (configured bubble %.1f%%); %s",
            step,
            ", ".join(f"pp rank {r} {100 * share:.1f}%" for r, share in sorted(idle.items())),
            100 * self.bubble,
            self.trace_dir / f"pipeline-step{step}.json",
        )
        return idle

    def _write(self, step: int, everyone: list[dict]) -> None:
        trace = []
        for record in everyone:
            trace.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": record["rank"],
                    "args": {"name": f"pipeline rank {record['rank']}"},
                }
            )
            trace += [
                {
                    "ph": "X",
                    "name": f"{action} {micro_batch}",
                    "cat": action,
                    "pid": record["rank"],
                    "tid": f"stage {stage}",
                    "ts": 1e6 * t0,
                    "dur": 1e6 * (t1 - t0),
                    "args": {"stage": stage, "micro_batch": micro_batch},
                }
                for action, stage, micro_batch, t0, t1 in record["events"]
            ]
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"pipeline-step{step}.json"
        staging = path.with_suffix(".json.tmp")
        staging.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
        staging.replace(path)
