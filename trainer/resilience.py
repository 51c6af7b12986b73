"""What keeps a long run alive and restartable: the counters a checkpoint carries, the guard
that skips updates with a non-finite loss or gradient norm, and the clean early stop
(`training.exit_interval`, `training.exit_after_minutes`, SIGTERM or SIGUSR1) for time-limited or
preempted jobs that chain."""

import logging
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from trillion.errors import Interrupted, RunAborted
from trillion.trainer.config.schema import Training as TrainingConfig

log = logging.getLogger("trillion")


class TrainingDiverged(RunAborted):
    """Too many non-finite steps in a row: continuing would only burn compute."""


@dataclass
class RunCounters:
    """Where the run stands; saved in every checkpoint and restored on resume."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, int(value))


class NonFiniteGuard:
    """Decides, once the gradients are clipped, whether this step may update the weights.

    Loss and gradient norm are already reduced over all ranks, so every rank takes the same
    decision without another collective. Under fp16 the GradScaler owns overflowing gradients
    (it skips and lowers the scale), so only a non-finite loss counts there."""

    def __init__(self, max_consecutive: int, counters: RunCounters):
        self.max_consecutive, self.counters = max_consecutive, counters
        self.last_skipped, self.last_reason = False, ""

    def allows_update(self, loss: torch.Tensor, grad_norm: torch.Tensor, scaler) -> bool:
        watched = loss if scaler.is_enabled() else torch.stack([loss.float(), grad_norm.float()])
        self.last_skipped = not bool(torch.isfinite(watched).all())  # the one host sync this guard adds
        if self.last_skipped:
            self.last_reason = "loss" if not math.isfinite(loss.item()) else "gradient norm"
            self.counters.skipped_steps += 1
            self.counters.consecutive_skips += 1
        else:
            self.counters.consecutive_skips = 0
        return not self.last_skipped or scaler.is_enabled()

    def check(self, step: int) -> None:
        """Log a skipped step; stop the run after too many in a row."""
        if not self.last_skipped:
            return
        run = self.counters.consecutive_skips
        log.warning(
            "step %d: non-finite %s, update skipped (%d in a row, %d in this run)",
            step,
            self.last_reason,
            run,
            self.counters.skipped_steps,
        )
        if self.max_consecutive > 0 and run >= self.max_consecutive:
            raise TrainingDiverged(
                f"Training diverged: {run} steps in a row up to step {step} had a non-finite {self.last_reason} "
                f"(training.max_nonfinite_skips={self.max_consecutive}). Resume from an earlier checkpoint with a "
                f"lower --optimizer.lr, a tighter --training.max_grad_norm or --training.dtype=bf16/fp32; raise "
                f"training.max_nonfinite_skips (0 = never stop) only if the spikes are known to pass."
            )


# a scheduler's kill, SLURM's warning (--signal=USR1@T) and Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopPolicy:
    """Where this job stops. The schedule always follows training.steps; an early stop only ends
    this job (after a checkpoint), so a chain of jobs equals one unbroken run.

    SIGTERM, SIGUSR1 and a first Ctrl-C (SIGINT) only set a flag: the step in progress finishes, every
    rank agrees to stop after the same step (one rank may be signalled before the others), the
    checkpoint is saved and the job exits (0, or 130 after Ctrl-C: `interrupted`). A second Ctrl-C
    stops at once (Interrupted, exit 130). `close` restores the previous handlers."""

    def __init__(self, cfg: TrainingConfig, first_step: int, device: torch.device, job_start: float):
        self.steps = cfg.steps
        self.last_step = min(cfg.steps, first_step + cfg.exit_interval) if cfg.exit_interval > 0 else cfg.steps
        self.budget_s = cfg.exit_after_minutes * 60
        self.device, self.start = device, job_start
        self.reason, self.signalled = "", ""
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            self.previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    @property
    def interrupted(self) -> bool:
        """Whether the user stopped this job with Ctrl-C."""
        return self.signalled == "SIGINT"

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.interrupted:
            raise Interrupted("interrupted again (Ctrl-C): stopped at once, without saving this step")
        self.signalled = signal.Signals(signum).name
        again = " (Ctrl-C again stops at once)" if self.interrupted else ""
        log.warning("%s received: saving a checkpoint after the current step, then exiting%s", self.signalled, again)

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def should_stop(self, step: int) -> bool:
        """True after the step that ends this job; `reason` says why when it is an early stop."""
        if step >= self.steps:
            return True
        if step >= self.last_step:
            self.reason = f"training.exit_interval reached at step {step} of {self.steps}"
            return True
        time_up, signalled = self._agree(
            self.budget_s > 0 and time.monotonic() - self.start >= self.budget_s, bool(self.signalled)
        )
        if signalled:
            self.reason = f"{self.signalled or 'a signal on another rank'} at step {step} of {self.steps}"
            return True
        if time_up:
            self.reason = f"training.exit_after_minutes reached at step {step} of {self.steps}"
            return True
        return False

    def _agree(self, time_up: bool, signalled: bool) -> tuple[bool, bool]:
        # Clocks drift and signals arrive at different moments: every rank must stop after the same step.
        if not dist.is_initialized():
            return time_up, signalled
        flags = torch.tensor([float(time_up), float(signalled)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        time_up, signalled = flags.tolist()
        return bool(time_up), bool(signalled)
