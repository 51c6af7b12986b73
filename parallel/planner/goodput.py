"""Goodput under failures: how often a job of N GPUs fails, the checkpoint interval that loses the least
(Young/Daly), and the share of wall time that trains with restart-from-checkpoint and with fault-tolerant
replica groups (torchft: a failure costs one group's restart, the others train on). No torch here.

Restart from a checkpoint follows Daly's complete model (J. T. Daly, "A higher order estimate of the optimum
checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006): with M the job's mean
time between failures, delta the time a save blocks training, R the restart time and tau the compute between
saves, the expected wall time per unit of work is M e^(R/M) (e^((tau + delta)/M) - 1) / tau, and the interval
that minimises it is sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta for delta < 2M (M
beyond). Young's first-order interval (Young, CACM 17(9), 1974) is sqrt(2 delta M).

Fault-tolerant groups: a failure kills the group holding the GPU; the step in progress is retried by the
others (one step lost), the failed group is away for its restart, during which the job trains at
(G - 1) / G of its throughput, and the peers wait while it copies the live state (heal). Checkpoints are still
written, at the same interval, for a cold restart."""

import math
from dataclasses import asdict, dataclass

# Llama 3 (Grattafiori et al., arXiv 2407.21783, sec. 3.3.4): 419 unexpected interruptions in a 54-day
# snapshot of pre-training on 16,384 H100 GPUs, so 16384 x 54 x 24 / 419 GPU-hours per failure.
MTBF_HOURS_PER_GPU = 16384 * 54 * 24 / 419  # 50,677 h
# Assumed, not measured at scale: a scheduler's requeue, process start-up, communicator set-up and a checkpoint
# load on thousands of GPUs take minutes. Give yours with --restart-s (the reliability report's "time to recover").
RESTART_S = 600.0
# Assumed: the rate at which one GPU's share of a checkpoint leaves training (the copy to host memory of an
# async save, or a synchronous write). Give the measured blocking time with --checkpoint-save-s: `trillion
# train` logs it as "training blocked X s" and records it in metrics.jsonl's time_checkpoint_s.
CHECKPOINT_GBS_PER_GPU = 1.0
HOUR = 3600.0


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 delta M) seconds of compute between saves."""
    return math.sqrt(2 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (seconds of compute between saves)."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2 * mtbf_s)
    return young_interval(save_s, mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s


def daly_goodput(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Useful compute over expected wall time in Daly's complete model, saving every `interval_s` of compute."""
    wall = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)
    return interval_s / wall


@dataclass(frozen=True)
class Goodput:
    """A job of `gpus` GPUs; `save_s` a save blocks training, `restart_s` a restart costs, `step_s` one step,
    `groups` fault-tolerant replica groups and `heal_s` a restarted group's live copy of its state."""

    gpus: int
    mtbf_hours_per_gpu: float
    save_s: float
    restart_s: float
    step_s: float
    groups: int
    heal_s: float

    @property
    def mtbf_s(self) -> float:
        return self.mtbf_hours_per_gpu * HOUR / self.gpus

    @property
    def failures_per_day(self) -> float:
        return 24 * HOUR / self.mtbf_s

    @property
    def interval_s(self) -> float:
        return daly_interval(self.save_s, self.mtbf_s)

    @property
    def restart_goodput(self) -> float:
        return daly_goodput(self.interval_s, self.save_s, self.restart_s, self.mtbf_s)

    @property
    def fault_tolerant_goodput(self) -> float:
        per_failure = self.step_s + self.heal_s + self.restart_s / self.groups
        saving = self.interval_s / (self.interval_s + self.save_s)
        return saving * max(0.0, 1 - per_failure / self.mtbf_s)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "failures_per_day": self.failures_per_day,
            "job_mtbf_hours": self.mtbf_s / HOUR,
            "young_interval_s": young_interval(self.save_s, self.mtbf_s),
            "checkpoint_interval_s": self.interval_s,
            "checkpoint_interval_steps": self.interval_s / self.step_s if self.step_s > 0 else None,
            "goodput_restart": self.restart_goodput,
            "goodput_fault_tolerant": self.fault_tolerant_goodput,
        }

    def lines(self) -> list[str]:
        """The figures for people, a few lines."""
        steps = f" = {self.interval_s / self.step_s:,.0f} steps" if self.step_s > 0 else ""
        return [
            f"failures: {self.failures_per_day:.2f} a day expected on {self.gpus:,} GPUs "
            f"(MTBF {self.mtbf_hours_per_gpu:,.0f} h per GPU: one every {self.mtbf_s / HOUR:.1f} h); "
            f"a save blocks training {self.save_s:.1f} s, a restart takes {self.restart_s:.0f} s",
            f"checkpoint interval (Young/Daly): every {self.interval_s / 60:.1f} min of training{steps} "
            f"(Young's sqrt(2 x save x MTBF): {young_interval(self.save_s, self.mtbf_s) / 60:.1f} min)",
            f"goodput: {self.restart_goodput:.1%} restarting from checkpoints; {self.fault_tolerant_goodput:.1%} with "
            f"{self.groups} fault-tolerant replica groups (a failure: one step retried, {self.heal_s:.1f} s of live "
            f"recovery, one group away {self.restart_s:.0f} s)",
        ]


def interval_advice(
    interval_steps: int, step_s: float, save_s: float, gpus: int, mtbf_hours_per_gpu: float, steps_left: int
) -> str | None:
    """A warning when checkpoint.interval (0: none) is more than twice off the Young/Daly optimum for this job,
    where the optimum falls inside the steps left (else no periodic checkpoint pays for itself); None otherwise."""
    if step_s <= 0 or save_s <= 0 or mtbf_hours_per_gpu <= 0:
        return None
    mtbf_s = mtbf_hours_per_gpu * HOUR / gpus
    best = max(1, round(daly_interval(save_s, mtbf_s) / step_s))
    if best >= steps_left or (interval_steps and best / 2 <= interval_steps <= 2 * best):
        return None
    now = f"checkpoint.interval={interval_steps}" + (" (no periodic checkpoints)" if not interval_steps else "")
    return (
        f"{now} is far from the Young/Daly optimum for this job: a save blocked training {save_s:.2f} s, a step takes "
        f"{step_s:.2f} s and {gpus} GPUs fail every {mtbf_s / HOUR:,.1f} h on average "
        f"(MTBF {mtbf_hours_per_gpu:,.0f} h per GPU, checkpoint.mtbf_hours_per_gpu), so saving "
        f"every {best} steps loses the least; use --checkpoint.interval={best}"
    )
