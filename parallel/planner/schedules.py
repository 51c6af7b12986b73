"""Pipeline-schedule arithmetic for the planner: the bubble a schedule leaves, the micro-batches a rank holds in
flight at its peak, and which rank runs each virtual stage with how many layers. The schedules themselves, with
their rules and bubble weights, are the trainer's own table (parallel/modes.py)."""

from trillion.parallel.modes import Schedule


def in_flight_microbatches(schedule: Schedule, p: int, v: int, m: int) -> tuple[float, float]:
    """Micro-batches whose activations the first and the last rank hold at the peak, in units of
    one micro-batch through all of that rank's layers (Narayanan et al. 2021 for interleaving). A V
    schedule holds as many on every rank (ZB-V, Qi et al. 2024: its two chunks balance each rank's
    memory; `trillion estimate` replaying torch's ZBVZeroBubble order at pp 16 counted 2 x 16 chunks
    on ranks 1, 4, 8, 12 and 15, and DualPipeV's 2 x 16 + 1)."""
    if p == 1:
        return 1.0, 1.0
    rule = schedule.in_flight
    if rule == "all":
        return float(m), float(m)
    if rule == "interleaved":
        return min(m, p) * (1 + (p - 1) / (p * v)), 1.0 + (p - 1) / (p * v)
    extra = 1 if rule == "pipeline+1" else 0
    first = float(min(m, p + extra))
    return first, first if schedule.v_shape else 1.0 + extra


def bubble_slots(schedule: Schedule, p: int, joined: bool = False) -> tuple[float, float, float, float]:
    """Idle time of a step as multiples of one chunk's (F, R, Bi, Bw); clamp the sum at zero. `joined`: a split-backward
    schedule running its weight passes with their input passes (modes.joins_weight_passes: under checkpointing), which
    leaves none to fill the pipeline's ends: each idle slot a whole chunk's, as 1F1B's."""
    return tuple((p - 1) * w for w in ((1, 1, 1, 1) if joined else schedule.bubble_weights))


def stage_layers(n_layers: int, p: int, v: int, schedule: Schedule) -> list[list[int]]:
    """Layer counts of each rank's chunks: layers split as evenly as possible over the p*v virtual
    stages in order (earlier stages take the remainder)."""
    stages = p * v
    counts = [n_layers // stages + (1 if k < n_layers % stages else 0) for k in range(stages)]
    ranks: list[list[int]] = [[] for _ in range(p)]
    for k, count in enumerate(counts):
        ranks[rank_of_virtual_stage(k, p, schedule)].append(count)
    return ranks


def rank_of_virtual_stage(k: int, p: int, schedule: Schedule) -> int:
    """Looped placement runs virtual stage k on rank k mod p; V placement on k, then 2p-1-k."""
    return (k if k < p else 2 * p - 1 - k) if schedule.v_shape else k % p
