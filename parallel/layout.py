"""A run's parallel layout as one frozen value: the degree of every axis and the shape of a step (ZeRO
mode, pipeline schedule and its chunks, micro-batches, activation checkpointing, compile, float8), and the
optimizer, whose state and step the planner costs.

The planner searches and costs layouts, the memory pre-flight and `trillion estimate` size the trainer's
own (trainer/layout.py builds it from a config), and ParallelDims (dims.py) builds the mesh of its
degrees. `check_degrees` is the one rule for which degrees make a world of ranks. No torch here: the
planner imports it and starts fast.
"""

from dataclasses import asdict, dataclass

from trillion.errors import ConfigError
from trillion.parallel.planner.moe import MOE_LOAD_IMBALANCE

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's axes, outermost first (dims.py)
# parallel.ep_dispatch: a token travels to each expert it chose (as torchtitan's standard dispatcher), once to each
# ep rank holding some of them, or once to each node and then on to the node's ranks (DeepSeek's DeepEP);
# "auto" resolves to "node" when the ep group spans nodes, else "rank" (parallel/expert_parallel.py)
EP_DISPATCH = ("expert", "rank", "node")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The defaults are one process: every degree 1, one micro-batch of one sequence, nothing recomputed."""

    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    dp_shard_mode: str = "zero3"
    pp_schedule: str = "1F1B"
    virtual_stages: int = 1  # pipeline chunks per rank (1 without a pipeline)
    micro_batch_size: int = 1  # sequences per micro-batch per data-parallel rank
    microbatches: int = 1  # per step per pipeline (gradient accumulation when pp == 1)
    activation_checkpoint: str = "none"
    compile: bool = False  # torch.compile of each block: fuses its element-wise kernels
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence; FSDP shards over dp_shard x cp
    float8: bool = False  # the blocks' linears compute in float8; the output projection stays bf16
    float8_all_gather: bool = True  # with float8 and FSDP: the converted weights are all-gathered in float8
    float8_experts: str = "auto"  # with float8: the routed experts' recipe (float8.experts), "off" keeps them bf16
    float8_dispatch: bool = False  # with float8 experts and ep > 1: the dispatch all-to-all carries float8 rows
    ep: int = 1  # expert parallelism: routed experts over ep of the dp_shard x cp ranks
    moe_load_imbalance: float = MOE_LOAD_IMBALANCE  # the busiest rank's routed tokens over the mean (planner)
    ep_dispatch: str = "rank"  # how tokens reach the experts: one row per expert, per rank or per node (EP_DISPATCH)
    ranks_per_node: int = 8  # the processes of one node (the per-node dispatch's two hops; the planner's node)
    ep_capacity: float = 0.0  # rows per destination rank as a multiple of the even share (0: dropless)
    ep_overlap: bool = False  # the dispatch's all-to-alls run beside the shared experts and the other micro-batch
    tp_overlap: int = 0  # chunks per rank of TP's all-gathers and reduce-scatters run beside their GEMMs (0: off)
    async_tp: bool = False  # torch's micro-pipelined TP: symmetric-memory collectives fused with the GEMMs (CUDA)
    optimizer: str = "adamw"  # adamw | muon: the optimizer's state and step work (planner/optimizer.py)
    attention_share: float = 1.0  # document masking: the attention work left (models/flops.py; planner)

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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in divisors(n) if d <= limit)


def check_degrees(world_size: int, *, pp=1, dp_replicate=1, dp_shard=-1, cp=1, tp=1, ep=1) -> int:
    """dp_shard (-1: what the world size leaves), once the degrees are known to make `world_size` ranks
    and ep to fit in dp_shard x cp; a ConfigError naming the setting and the fix otherwise."""
    degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
    for name in AXES:
        value = degrees[name]
        if value < 1 and not (name == "dp_shard" and value == -1):
            raise ConfigError(
                f"parallel.{name}={value} must be a positive degree"
                f"{' (or -1 to infer it)' if name == 'dp_shard' else ''}; use 1 to turn it off."
            )
    others = pp * dp_replicate * cp * tp
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"parallel.pp * dp_replicate * cp * tp = {others} does not divide the world size "
                f"{world_size}, so parallel.dp_shard=-1 cannot be inferred. "
                f"Pick degrees whose product divides {world_size} "
                f"(e.g. --parallel.tp={_largest_divisor_at_most(world_size, tp)})."
            )
        dp_shard = world_size // others
    product = others * dp_shard
    if product != world_size:
        raise ConfigError(
            f"parallel degrees pp={pp} x dp_replicate={dp_replicate} x dp_shard={dp_shard} x "
            f"cp={cp} x tp={tp} = {product}, but the world size is {world_size}. "
            "Make the product equal the number of processes, e.g. --parallel.dp_shard=-1 to infer it, "
            f"or launch {product} processes."
        )
    _check_ep(ep, dp_shard, cp)
    return dp_shard


def _check_ep(ep: int, dp_shard: int, cp: int) -> None:
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep} must be a positive degree; use 1 to turn it off.")
    region = dp_shard * cp
    if region % ep:
        valid = ", ".join(map(str, divisors(region)))
        raise ConfigError(
            f"parallel.ep={ep} does not divide parallel.dp_shard x cp = {dp_shard} x {cp} = "
            f"{region}: the expert-parallel ranks are taken from the sharded data-parallel ones (and the "
            f"context-parallel ones). Use an ep that divides {region} (valid: {valid}), or raise "
            "--parallel.dp_shard."
        )


def degrees_of(layout: Layout) -> dict:
    """The degrees `check_degrees` takes, from a layout."""
    return {name: getattr(layout, name) for name in (*AXES, "ep")}
