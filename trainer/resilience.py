"""What keeps a long run alive and restartable: the counters a checkpoint carries, the guard
that skips updates with a non-finite loss or gradient norm, and the clean early stop
(`training.exit_interval`, `training.exit_after_minutes`, SIGTERM or SIGUSR1) for time-limited or
preempted jobs that chain, and the advice on checkpoint.interval once a save was timed."""

import logging
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from trillion.errors import Interrupted, RunAborted
from trillion.parallel.planner.goodput import interval_advice
from trillion.trainer.config.schema import Checkpoint as CheckpointConfig
from trillion.trainer.config.schema import Training as TrainingConfig
from trillion.trainer.launch.env import STOP_REPORT_ENV

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
    """Keeps a step whose loss or gradient norm is not finite from changing anything, without the host.

    `flag` turns the step's (already all-reduced, so equal on every rank) loss and gradient norm into
    a flag on the device; the optimizer step is masked by it (fused AdamW's found_inf, as GradScaler
    does: no weight, no optimizer state, no optimizer step count moves). The flags pile up on the
    device and `check` reads them at the next logging step or save, in one read: it counts the
    skipped steps, logs which they were, and stops the run once training.max_nonfinite_skips came in
    a row. Under fp16 the GradScaler owns overflowing gradients (it skips and lowers the scale), so
    only a non-finite loss counts there."""

    def __init__(self, max_consecutive: int, counters: RunCounters):
        self.max_consecutive, self.counters = max_consecutive, counters
        self.pending: list[torch.Tensor] = []  # per step since the last check: (loss bad, norm bad)

    def flag(self, loss: torch.Tensor, grad_norm: torch.Tensor, scaler) -> torch.Tensor:
        """1.0 on the device if this step must not update (0.0 otherwise); remembered for `check`."""
        norm_bad = torch.zeros_like(grad_norm, dtype=torch.float32) if scaler.is_enabled() else grad_norm
        bad = ~torch.isfinite(torch.stack([loss.float(), norm_bad.float()]))
        self.pending.append(bad)
        return bad.any().float()

    def check(self, step: int) -> None:
        """Read the flags of the steps up to `step` (one host read), count and log the skipped ones,
        stop the run after too many in a row."""
        if not self.pending:
            return
        first, flags = step - len(self.pending) + 1, torch.stack(self.pending).tolist()
        self.pending = []
        skipped = []
        for at, (loss_bad, norm_bad) in enumerate(flags, start=first):
            if not (loss_bad or norm_bad):
                self.counters.consecutive_skips = 0
                continue
            reason = "loss" if loss_bad else "gradient norm"
            skipped.append(f"{at} ({reason})")
            self.counters.skipped_steps += 1
            self.counters.consecutive_skips += 1
            run = self.counters.consecutive_skips
            if self.max_consecutive > 0 and run >= self.max_consecutive:
                raise TrainingDiverged(
                    f"Training diverged: {run} steps in a row up to step {at} had a non-finite {reason} "
                    f"(training.max_nonfinite_skips={self.max_consecutive}). No checkpoint is saved while steps are "
                    f"skipped, so the ones before are kept: resume from the newest (the same command) or an earlier "
                    f"one (--checkpoint.load_step=STEP) with a lower --optimizer.lr, a tighter "
                    f"--training.max_grad_norm or --training.dtype=bf16/fp32; raise training.max_nonfinite_skips "
                    f"(0 = never stop) only if the spikes are known to pass."
                )
        if skipped:
            log.warning(
                "non-finite step%s, update skipped: %s (%d in a row, %d in this run)",
                "s" if len(skipped) > 1 else "",
                ", ".join(skipped),
                self.counters.consecutive_skips,
                self.counters.skipped_steps,
            )


# The stop flags live in host memory (a gloo group): reading them never waits for a device. Read through
# the method as torch defines it, so metrics.profiling.HostReadCounter (which wraps it) counts device reads.
READ_HOST_TENSOR = torch.Tensor.tolist
# a scheduler's kill, SLURM's warning (--signal=USR1@T) and Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopPolicy:
    """Where this job stops. The schedule always follows training.steps; an early stop only ends
    this job (after a checkpoint), so a chain of jobs equals one unbroken run.

    SIGTERM, SIGUSR1 and a first Ctrl-C (SIGINT) only set a flag: the step in progress finishes, every
    rank agrees to stop after the same step (one rank may be signalled before the others), the
    checkpoint is saved and the job exits (0, or 130 after Ctrl-C: `interrupted`). A second Ctrl-C
    stops at once (Interrupted, exit 130). `close` restores the previous handlers."""

    def __init__(self, cfg: TrainingConfig, first_step: int, job_start: float):
        self.steps = cfg.steps
        self.last_step = min(cfg.steps, first_step + cfg.exit_interval) if cfg.exit_interval > 0 else cfg.steps
        self.budget_s = cfg.exit_after_minutes * 60
        self.start = job_start
        self.reason, self.signalled, self.by_signal = "", "", False
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.in_flight = None  # (flags, work) of the all-reduce started at the last step
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
        if self.signalled and signum != signal.SIGINT:  # the launcher and the scheduler may both send it
            return
        self.signalled = signal.Signals(signum).name
        again = " (Ctrl-C again stops at once)" if self.interrupted else ""
        log.warning("%s received: saving a checkpoint after the current step, then exiting%s", self.signalled, again)

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
        if self.in_flight is not None:  # no collective left running when the group goes
            self.in_flight[1].wait()
            self.in_flight = None

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
            self.by_signal = True
            return True
        if time_up:
            self.reason = f"training.exit_after_minutes reached at step {step} of {self.steps}"
            return True
        return False

    def report_saved(self, checkpoint) -> None:
        """After a stop on a signal whose checkpoint is saved: one line for `trillion torchrun` (STOP_REPORT_ENV),
        which then exits 0 saying so where torchrun alone would exit 1 after the signal."""
        report = os.environ.get(STOP_REPORT_ENV)
        if report and self.by_signal and not self.interrupted:
            with open(report, "a") as lines:  # one short append per rank: whole lines, whatever the order
                lines.write(f"preempted, saved: {self.reason}, checkpoint {checkpoint}\n")

    def _agree(self, time_up: bool, signalled: bool) -> tuple[bool, bool]:
        # Clocks drift and signals arrive at different moments: every rank must stop after the same step.
        # This step's flags are all-reduced in the background on a gloo group (host values: no device
        # work, no wait); the flags acted on are the previous step's, so a distributed job stops one
        # step after the signal or the deadline.
        if self.group is None:
            return time_up, signalled
        agreed, self.in_flight = self.in_flight, None
        flags = torch.tensor([float(time_up), float(signalled)])
        self.in_flight = (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        if agreed is None:
            return False, False
        flags, work = agreed
        work.wait()
        time_up, signalled = READ_HOST_TENSOR(flags)
        return bool(time_up), bool(signalled)


class CheckpointAdvice:
    """After the job's first save before its last step: one warning when checkpoint.interval is more than twice
    off the Young/Daly optimum for this job's GPUs (all replica groups'), measured save time and step time
    (parallel/planner/goodput.py; checkpoint.mtbf_hours_per_gpu=0 turns it off)."""

    def __init__(self, cfg: CheckpointConfig, gpus: int, steps: int, is_logging_rank: bool):
        self.cfg, self.gpus, self.steps, self.pending = cfg, gpus, steps, is_logging_rank

    def after_save(self, step: int, save_s: float, step_s: float) -> None:
        if not self.pending or step >= self.steps:
            return
        self.pending = False
        message = interval_advice(
            self.cfg.interval, step_s, save_s, self.gpus, self.cfg.mtbf_hours_per_gpu, self.steps - step
        )
        if message:
            log.warning(message)
