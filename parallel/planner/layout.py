"""A parallel layout as the planner sees it, and what each pipeline schedule costs in bubble and
in micro-batches held in flight. The schedules, ZeRO modes and checkpointing modes, with their
rules and bubble weights, are the trainer's own tables (parallel/modes.py).
"""

from dataclasses import asdict, dataclass

from trillion.parallel.modes import CHECKPOINT_MODES, Schedule
from trillion.parallel.planner.moe import MOE_LOAD_IMBALANCE

# The checkpointing modes the search tries: selective:op keeps matmul outputs, which the memory
# model (memory.py) does not count yet; selective:N (every N-th block) is the trainer's only.
SEARCHED_CHECKPOINT_MODES = tuple(name for name, mode in CHECKPOINT_MODES.items() if not mode.op_level)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp_replicate: int
    dp_shard: int
    dp_shard_mode: str
    pp_schedule: str
    virtual_stages: int
    micro_batch_size: int
    microbatches: int  # per step per pipeline (gradient accumulation when pp == 1)
    activation_checkpoint: str
    compile: bool = False  # torch.compile of each block: fuses its element-wise kernels
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence; FSDP shards over dp_shard x cp
    float8: bool = False  # the blocks' linears compute in float8 (cost.py); the output projection stays bf16
    float8_all_gather: bool = True  # with float8 and FSDP: the converted weights are all-gathered in float8
    ep: int = 1  # expert parallelism: routed experts over ep of the dp_shard x cp ranks (moe.py)
    moe_load_imbalance: float = MOE_LOAD_IMBALANCE  # the busiest rank's routed tokens over the mean (moe.py)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1  # the trainer always pairs TP with sequence parallelism

    def as_dict(self) -> dict:
        return asdict(self)


def in_flight_microbatches(schedule: Schedule, p: int, v: int, m: int) -> tuple[float, float]:
    """Micro-batches whose activations the first and the last rank hold at the peak, in units of
    one micro-batch through all of that rank's layers (Narayanan et al. 2021 for interleaving)."""
    if p == 1:
        return 1.0, 1.0
    rule = schedule.in_flight
    if rule == "all":
        return float(m), float(m)
    if rule == "interleaved":
        return min(m, p) * (1 + (p - 1) / (p * v)), 1.0 + (p - 1) / (p * v)
    extra = 1 if rule == "pipeline+1" else 0
    return float(min(m, p + extra)), 1.0 + extra


def bubble_slots(schedule: Schedule, p: int) -> tuple[float, float, float, float]:
    """Idle time of a step as multiples of one chunk's (F, R, Bi, Bw); clamp the sum at zero."""
    return tuple((p - 1) * w for w in schedule.bubble_weights)


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
