"""torch.profiler traces per rank on a wait/warmup/active schedule, CUDA memory snapshots (at a
step, and when a step runs out of memory), and the time of each phase of a step."""

import contextlib
import functools
import logging
import pickle
import time
import warnings
from pathlib import Path

import torch

from trillion.trainer.config.schema import Profiling as ProfilingConfig

log = logging.getLogger("trillion")


class StepProfiler:
    """Call `step()` after every training step; a no-op when profiling is off."""

    def __init__(self, cfg: ProfilingConfig, output_dir: Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_dir = output_dir / "profiles"
        self.profiler = None
        self.snapshots = cfg.memory_snapshot and device.type == "cuda"
        if cfg.enabled:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(
                    wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat
                ),
                on_trace_ready=self._write_trace,
                record_shapes=True,
                profile_memory=True,
                with_stack=False,
            )
            self.profiler.start()
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _write_trace(self, profiler) -> None:
        path = self.trace_dir / f"trace-rank{self.rank}-step{profiler.step_num}.json"
        profiler.export_chrome_trace(str(path))
        log.info("wrote profiler trace %s", path)

    def step(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.step()
        if self.snapshots and step == self.cfg.memory_snapshot_step:
            self.dump_memory_snapshot(f"step{step}")

    def dump_memory_snapshot(self, tag: str) -> None:
        """A pickle that https://pytorch.org/memory_viz opens: every live allocation with its stack."""
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"memory-rank{self.rank}-{tag}.pickle"
        with open(path, "wb") as file:
            pickle.dump(torch.cuda.memory._snapshot(), file)
        log.info("wrote memory snapshot %s", path)

    @contextlib.contextmanager
    def snapshot_on_oom(self):
        """Around a step: on CUDA out-of-memory, write what was allocated, then re-raise."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.snapshots:
                self.dump_memory_snapshot("oom")
            raise

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)


class PhaseTimer:
    """Seconds of each phase of one step (data, forward_backward, optimizer, ...), by host clock.

    With `sync`, each boundary waits for the device so a phase is charged its own GPU work; the
    loop turns that on only for logged steps, which wait for the device anyway.
    """

    def __init__(self, device: torch.device, sync: bool):
        self.device, self.sync = device, sync
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to `phase`."""
        if self.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


# The Tensor methods through which the host reads a value; on a GPU each one waits for the device.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


class HostReadCounter:
    """Counts the host's reads of tensor values in each loop iteration of a run, for tests and benchmarks:
    pass `counter.iteration` as RunHooks.iteration; `reads` maps step -> count. On a CPU it wraps the
    Tensor methods that read values (HOST_READS); with `cuda` it counts the synchronisations
    torch.cuda.set_sync_debug_mode("warn") reports instead."""

    def __init__(self, cuda: bool = False):
        self.cuda, self.reads = cuda, {}

    @contextlib.contextmanager
    def iteration(self, step: int):
        counted = [0]
        if self.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counted[0] = sum("synchroniz" in str(w.message) for w in caught)
        else:
            originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
            for name, method in originals.items():
                setattr(torch.Tensor, name, _counting(method, counted))
            try:
                yield
            finally:
                for name, method in originals.items():
                    setattr(torch.Tensor, name, method)
        self.reads[step] = counted[0]


def _counting(method, counted: list):
    @functools.wraps(method)
    def counting(*args, **kwargs):
        counted[0] += 1
        return method(*args, **kwargs)

    return counting
