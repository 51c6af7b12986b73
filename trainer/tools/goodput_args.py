"""The failure settings `trillion plan` and `trillion estimate` share, and the goodput they print for a layout
(parallel/planner/goodput.py): the GPUs' mean time between failures, the time a save blocks training and the
time a restart takes, each a measured figure when you have one."""

import argparse

from trillion.errors import ConfigError
from trillion.parallel.planner.goodput import CHECKPOINT_GBS_PER_GPU, MTBF_HOURS_PER_GPU, RESTART_S, Goodput

# A checkpoint holds each rank's shard of the fp32 master weights (parallel/planner/memory.py), its optimizer state
# and, with optimizer.ema_decay, the parameters' float32 average (parallel/host_ema.py)
MASTER_BYTES = 4


def add_goodput_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("failures and checkpoints (goodput)")
    g.add_argument(
        "--mtbf-hours-per-gpu",
        type=float,
        default=MTBF_HOURS_PER_GPU,
        help=f"mean time between failures of one GPU, hours (default {MTBF_HOURS_PER_GPU:,.0f}: Llama 3's 419 "
        "unexpected interruptions in 54 days on 16,384 H100s, arXiv 2407.21783)",
    )
    g.add_argument(
        "--checkpoint-save-s",
        type=float,
        default=None,
        help="seconds a save blocks training, as `trillion train` logs it ('training blocked X s'; metrics.jsonl's "
        f"time_checkpoint_s); default: the checkpoint bytes per GPU at an assumed {CHECKPOINT_GBS_PER_GPU:g} GB/s",
    )
    g.add_argument(
        "--restart-s",
        type=float,
        default=RESTART_S,
        help=f"seconds from a failure to training again after a restart (default {RESTART_S:g}, assumed; "
        "experiments/reliability/REPORT.md measures it on a CPU)",
    )
    g.add_argument(
        "--ft-groups",
        type=int,
        default=2,
        help="fault-tolerant replica groups to price (fault_tolerance.group_size; default 2)",
    )


def check_goodput_arguments(ns: argparse.Namespace) -> list[str]:
    problems = []
    for flag, value in (("--mtbf-hours-per-gpu", ns.mtbf_hours_per_gpu), ("--restart-s", ns.restart_s)):
        if not value > 0:
            problems.append(f"{flag} {value:g} must be positive")
    if ns.checkpoint_save_s is not None and not ns.checkpoint_save_s > 0:
        problems.append(f"--checkpoint-save-s {ns.checkpoint_save_s:g} must be positive")
    if ns.ft_groups < 2:
        problems.append(f"--ft-groups {ns.ft_groups} must be at least 2 (one group alone cannot survive a failure)")
    return problems


def checkpoint_share(shard_numel: int, optimizer_bytes: float, average_bytes: float) -> float:
    """A rank's bytes in a checkpoint: its master weights' shard of `shard_numel` elements, its optimizer state and
    the parameters' average (0: none)."""
    return MASTER_BYTES * shard_numel + optimizer_bytes + average_bytes


def goodput(ns: argparse.Namespace, gpus: int, checkpoint_bytes: float, step_s: float, link_gbs: float) -> Goodput:
    """The goodput of a layout whose largest writer saves `checkpoint_bytes` (checkpoint_share) and steps in
    `step_s` (0: unknown), a restarted group copying its checkpoint's worth from a peer at `link_gbs` per GPU."""
    problems = check_goodput_arguments(ns)
    if problems:
        raise ConfigError("; ".join(problems) + ".")
    checkpoint_gb = checkpoint_bytes / 1e9
    save_s = ns.checkpoint_save_s if ns.checkpoint_save_s is not None else checkpoint_gb / CHECKPOINT_GBS_PER_GPU
    heal_s = checkpoint_gb / link_gbs if link_gbs > 0 else 0.0
    return Goodput(gpus, ns.mtbf_hours_per_gpu, save_s, ns.restart_s, step_s, ns.ft_groups, heal_s)
