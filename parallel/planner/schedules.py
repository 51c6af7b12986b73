"""Pipeline-schedule arithmetic for the planner: the bubble a schedule leaves, the micro-batches a rank holds in
flight at its peak, and which rank runs each virtual stage. The schedules themselves, with
their rules and bubble weights, are the trainer's own table (parallel/modes.py)."""

from functools import lru_cache

from trillion.parallel.modes import INTERLEAVED_EXTRA_WARMUP, Schedule, pairs_across_stages, pairs_interleaved


def in_flight_microbatches(schedule: Schedule, p: int, m: int) -> tuple[float, float]:
    """Micro-batches whose activations the first and the last rank hold at the peak, in units of one micro-batch
    through all of that rank's layers (1F1B's p - r; Interleaved1F1B and DualPipeV count each chunk apart:
    interleaved_in_flight, dualpipe_in_flight). ZBVZeroBubble's V holds as many on every rank (ZB-V, Qi et al. 2024:
    its two chunks balance each rank's memory; `trillion estimate` replaying torch's order at pp 16 counted 2 x 16
    chunks on ranks 1, 4, 8, 12 and 15)."""
    if p == 1:
        return 1.0, 1.0
    if schedule.in_flight == "all":
        return float(m), float(m)
    extra = 1 if schedule.in_flight == "pipeline+1" else 0
    first = float(min(m, p + extra))
    return first, first if schedule.v_shape else 1.0 + extra


def bubble_slots(schedule: Schedule, p: int, joined: bool = False) -> tuple[float, float, float, float]:
    """Idle time of a step as multiples of one chunk's (F, R, Bi, Bw); clamp the sum at zero. `joined`: a split-backward
    schedule running its weight passes with their input passes (modes.joins_weight_passes: under checkpointing), which
    leaves none to fill the pipeline's ends: each idle slot a whole chunk's, as 1F1B's."""
    return tuple((p - 1) * w for w in ((1, 1, 1, 1) if joined else schedule.bubble_weights))


def rank_of_virtual_stage(k: int, p: int, schedule: Schedule) -> int:
    """Looped placement runs virtual stage k on rank k mod p; V placement on k, then 2p-1-k."""
    return (k if k < p else 2 * p - 1 - k) if schedule.v_shape else k % p


def paired_share(layout) -> float:
    """The share of a rank's chunk forwards and backwards that run paired (pipeline_pairing.py; 0 where none pair), the
    mean over the ranks. DualPipeV: torch's ScheduleDualPipeV emits 2m - 3p + r + 1 OVERLAP_F_B actions on rank r of
    p (one fewer on the last) among its 2m forwards and 2m backwards; Interleaved1F1B: every forward after the
    rank's warm-up, the v m - w_r of its v m (interleaved_warmup); both counted in the schedules' own action lists by
    tests/planner/test_dualpipe_plan.py."""
    if not pairs_across_stages(layout):
        return 0.0
    p, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    if pairs_interleaved(layout):
        return sum(v * m - interleaved_warmup(p, v, m, r) for r in range(p)) / (p * v * m)
    return min(1.0, max(0.0, (2 * m - 3 * p + 1 + (p - 1) / 2 - 1 / p) / (2 * m)))


def interleaved_warmup(p: int, v: int, m: int, rank: int, extra: int = INTERLEAVED_EXTRA_WARMUP) -> int:
    """Forwards rank `rank` runs before its first backward under Interleaved1F1B: torch's warm-up ((v - 1)
    micro-batches a round, two more a rank before the last; torch.distributed.pipelining.schedules._get_warmup_ops)
    and `extra` (the paired schedule's INTERLEAVED_EXTRA_WARMUP), at most all v m."""
    per_round = m // max(1, m // p)
    return min((v - 1) * per_round + 2 * (p - 1 - rank) + extra, v * m)


@lru_cache(maxsize=65536)
def interleaved_in_flight(p: int, v: int, m: int, rank: int, chunks: tuple, extra: int = 0) -> tuple[float, tuple]:
    """(micro-batches in flight on Interleaved1F1B's pipeline rank `rank` at its peak, in units of one micro-batch
    through all its layers; each chunk's count then), given what each of its v chunks keeps of one micro-batch
    (`chunks`). torch's order (ScheduleInterleaved1F1B): the warm-up's w forwards (interleaved_warmup, `extra` the
    paired schedule's), then each forward followed by a backward; forward i runs the rank's chunk (i // per_round) mod
    v, backward j chunk v - 1 - (j // per_round) mod v. The peak follows a forward: the warm-up's last, or the k-th
    steady one (w + k + 1 forwards, k backwards), whose counts repeat every v per_round. With equal chunks the first
    rank holds Narayanan et al. 2021's p (1 + (p - 1) / (p v)) micro-batches, the last ((v - 1) p + 1) / v."""
    per_round, total = m // max(1, m // p), v * m
    warmup = interleaved_warmup(p, v, m, rank, extra)

    def runs(n: int, chunk: int) -> int:  # of the first n passes, those on chunk `chunk` (forward order)
        cycles, rest = divmod(n, per_round * v)
        return cycles * per_round + min(max(rest - chunk * per_round, 0), per_round)

    peak, at_peak = -1.0, ()
    for k in range(min(total - warmup, per_round * v) if warmup < total else 1):
        forwards, backwards = min(warmup + k + 1, total), k
        counts = tuple(runs(forwards, c) - runs(backwards, v - 1 - c) for c in range(v))
        held = sum(count * size for count, size in zip(counts, chunks))
        if held > peak:
            peak, at_peak = held, counts
    whole = sum(chunks)
    return (peak / whole if whole else sum(at_peak) / v), at_peak


def dualpipe_in_flight(p: int, m: int, rank: int, chunks: list[float]) -> float:
    """Micro-batches in flight on DualPipeV's pipeline rank `rank`, in units of one micro-batch through all its layers,
    given what each of its two chunks keeps of one micro-batch (`chunks`: its layers' bytes): torch's
    ScheduleDualPipeV runs 2 (p - r - 1) forwards of the rank's first stage, then r + 1 of each, before its first
    backward, so the first chunk holds 2 p - r - 1 and the second the rest of the 2 p + 1 chunks `trillion estimate`
    counts on every rank (r + 2)."""
    first, second = dualpipe_chunks_in_flight(p, m, rank)
    held = sum(chunks)
    return (first * chunks[0] + second * chunks[1]) / held if held and len(chunks) == 2 else float(first)


def dualpipe_chunks_in_flight(p: int, m: int, rank: int) -> tuple[int, int]:
    """Micro-batches DualPipeV's pipeline rank `rank` holds in flight in its first and in its second chunk at its peak
    (dualpipe_in_flight)."""
    return min(m, 2 * p - rank - 1), min(m, rank + 2)


def held_receives(received: float, chunks: int, last: bool) -> float:
    """Hidden states a rank's pipeline receive buffers hold at its peak (parallel/pipeline_stage.py): `received`, one
    for each micro-batch its stages hold in flight from the previous stage, and the gradient for its output during
    one backward (none where its only stage is the model's last)."""
    return received + (1 if chunks > last else 0)


def leaf_actions(actions: list):
    """The forwards and backwards of a rank's action list in order, overlapped pairs (DualPipeV's OVERLAP_F_B)
    unpacked, the schedule's idle slots (None) skipped."""
    for action in actions:
        if action is not None and action.sub_actions:
            yield from leaf_actions(list(action.sub_actions))
        elif action is not None:
            yield action
