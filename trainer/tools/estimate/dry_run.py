"""Dry run at full scale: the real model, pipeline split, TP plan and FSDP2 on the meta device under
PyTorch's fake process group, one simulated rank at a time, and the bytes each rank would hold.

For each requested rank the fake group is (re)initialized with that rank, the config's layout is
built with the trainer's own `build_parallel_dims`, `Pipeline` and `parallelize`, and memory is read
off what that produced (trainer/tools/estimate/simulation.py drives the ranks, rank.py builds one,
activations.py measures one micro-batch, pipeline_schedule.py replays the schedule):

- parameters: the unique storages of the local shards (FSDP2 allocates each shard padded to the
  ceiling of torch.chunk; an empty shard still allocates the padded rows);
- gradients: FSDP2 reduce-scatters into padded shards in the reduce dtype (fp32). Under zero1
  with several micro-batches and under any pipeline schedule (which turns gradient sync off until
  the last micro-batch whatever the mode) the unsharded (TP-local) fp32 gradients accumulate through
  the step instead; they are reduce-scattered and freed group by group at its end, so the larger of
  the two is the peak (the reduce-scatter's own buffer is counted in buffers);
- optimizer: AdamW's exp_avg and exp_avg_sq per local (unpadded) shard in the master dtype, plus
  its 4-byte `step` per parameter; with optimizer.name=muon one momentum buffer per hidden-matrix shard
  instead (parallel/muon/matrices.py; its step's buffers are the planner's figure). Counted from the
  shapes, never from running the optimizer under fake tensors (foreach AdamW inflated that figure);
- activations: one micro-batch forward + backward of each of the rank's stages, TP-sharded and
  activation-checkpointed, on meta tensors under `MemTracker` (FSDP does not change activations, so
  it is left out of that run; each weight gradient is dropped once accumulated, as FSDP's
  reduce-scatter frees it). Without pipelining the peak is the figure; with it, the schedule's own
  action list places those bytes in time (micro-batches in flight).
  If the run fails, the planner's analytic figure is used instead and labelled "predicted";
- buffers: FSDP's gathered parameters in the compute dtype (zero3 without pipelining: two blocks,
  the one in use and the prefetched one, plus the root, which is never resharded after forward;
  otherwise the whole of the rank's stages, kept through the step) and one block's unsharded fp32
  gradient being reduce-scattered, from the TP-local shapes; the pipeline's receive buffers (two
  hidden states per micro-batch of the step on a middle stage); plus the planner's 1 GB framework
  allowance. `detail` breaks gradients and buffers down.

Ranks that hold the same stages at the same dp_shard and cp coordinates hold the same bytes, so `--ranks
all` builds each such group once (trainer/tools/estimate/rank.py says why).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from trillion.errors import ConfigError
from trillion.models import ModelArgs
from trillion.parallel.dims import ParallelDims
from trillion.parallel.layout import Layout
from trillion.trainer.assemble import (
    build_model_args,
    check_float8,
    check_model_layout,
    resolve_layout,
    resolve_with_model,
    validate_training,
)
from trillion.trainer.config.schema import Config
from trillion.trainer.preflight import check_planned_format
from trillion.trainer.tools.estimate.advice import KINDS, advice, shortfall_message
from trillion.trainer.tools.estimate.rank import StagePlan, storage_bytes, target_device, target_dtype
from trillion.trainer.tools.estimate.simulation import Simulation

__all__ = [
    "Estimate",
    "RankEstimate",
    "estimate",
    "select_ranks",
    "shortfall_message",
    "advice",
    "storage_bytes",
    "KINDS",
    "DEFAULT_RANKS",
]
# second: with the embedding a unit of the trainer's stage split, the first stage holds fewer blocks than the next,
# which holds the most micro-batches in flight after it: the fullest rank of kimi-k2's and deepseek-v3-671b's plans
# (experiments/frontier/KIMI_K2.md)
DEFAULT_RANKS = "first,second,middle,last,max"


@dataclass
class RankEstimate:
    """The bytes one rank holds at its peak, by kind; `activations_source` says how that figure was got."""

    rank: int
    coords: dict  # mesh axis -> this rank's coordinate (axes of size > 1)
    stage: int  # pipeline rank, its pp coordinate (0 while pp == 1)
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    activations_source: str  # "measured" (meta run under MemTracker) | "predicted" (planner's formula)
    buffers: int  # FSDP gathered parameters and reduce-scatter input, pipeline receive buffers
    framework: int  # context, workspaces (the planner's allowance, not measured)
    parameter_count: int  # local elements, unpadded
    capacity: float | None = None  # bytes of the device; None: unknown
    usable: float | None = None  # capacity x the planner's headroom
    planner: dict | None = None  # the planner's prediction for this layout (bytes by kind), None if it has none
    detail: dict = field(default_factory=dict)  # the parts of gradients and buffers, stages, micro-batches in flight

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers + self.framework

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.total <= self.usable

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(total=self.total, fits=self.fits)
        return out


@dataclass
class Estimate:
    config_model: str
    world_size: int
    layout: dict
    device: str | None  # the device whose capacity is compared (None: unknown)
    ranks: list[RankEstimate] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "model": self.config_model,
            "world_size": self.world_size,
            "layout": self.layout,
            "device": self.device,
            "seconds": round(self.seconds, 2),
            "notes": self.notes,
            "ranks": [r.as_dict() for r in self.ranks],
        }


# --- set-up ----------------------------------------------------------------------------------------
def layout_dims(config: Config, world_size: int) -> tuple[ParallelDims, ModelArgs]:
    """(ParallelDims, the model's arguments): the layout resolved and checked against world, model, batch and
    pipeline schedule exactly as `trillion train` does (ranks per node, without a launcher, from job.hardware's
    nodes); the mesh is built later, per simulated rank."""
    from trillion.trainer.launch.env import LaunchEnv

    env = LaunchEnv(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"))
    validate_training(
        dataclasses.replace(
            config,
            training=dataclasses.replace(
                config.training, dtype="bf16" if config.training.dtype == "fp16" else config.training.dtype
            ),
        ),
        env,
    )
    layout = resolve_layout(config, world_size, hardware_node(config.job.hardware))
    check_float8(layout, env.device)
    check_planned_format(layout, config.job.hardware)
    model_args = model_args_for(config, layout)
    check_model_layout(layout, model_args, config.training.seq_len)
    return ParallelDims(resolve_with_model(layout, model_args, config.training.seq_len), world_size), model_args


def hardware_node(hardware: str) -> int:
    """GPUs of one scale-up domain of the hardware profile job.hardware names (a node, or an NVL72 rack's 72; 0:
    none named): the expert dispatch's node, as the planner's."""
    from trillion.parallel.planner.hardware import load_profile

    return load_profile(hardware).scale_up if hardware else 0


def model_args_for(config: Config, layout: Layout) -> ModelArgs:
    # The tokenizer is not built (it may need files that live on the cluster): the preset's vocabulary stands. The
    # kernels are those the run picks on its target device, not this host's (kernels.norm=auto: the fused norm on a
    # GPU, whose saved set the measurement takes: activations.py _norm_on_meta)
    on_target = dataclasses.replace(config, job=dataclasses.replace(config.job, device=target_device(config)))
    return build_model_args(on_target, 0, layout)


def runnable_here(config: Config) -> tuple[Config, list[str]]:
    """The config as the dry run can run it on this CPU, with the note of what that changes: float8 emulated where the
    target has float8 units (this CPU has none; the same bytes); async TP, a pass of compile over CUDA's symmetric
    memory, neither of which runs here, sized as DTensor TP, its placements."""
    if config.float8.enabled and target_device(config) == "cuda":
        config = dataclasses.replace(config, float8=dataclasses.replace(config.float8, emulate=True))
    if not config.parallel.async_tp:
        return config, []
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, async_tp=False))
    return config, ["async TP: sized as DTensor TP, its placements (its symmetric-memory workspace is not counted)"]


# --- the dry run ----------------------------------------------------------------------------------------------
def estimate(
    config: Config,
    world_size: int,
    ranks: str = DEFAULT_RANKS,
    hardware: str | None = None,
    measure: bool = True,
    progress=None,
) -> Estimate:
    """Per-rank memory of `config`'s layout at `world_size`, simulating each selected rank in turn."""
    from trillion.parallel.planner.memory import FRAMEWORK_BYTES, MEMORY_HEADROOM

    start = time.perf_counter()
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size} must be a positive number of processes.")
    config, notes = runnable_here(config)
    dims, model_args = layout_dims(config, world_size)  # raises ConfigError for bad degrees, model, batch or schedule
    device_name, capacity = device_capacity(hardware)
    result = Estimate(config.model.name, world_size, {}, device_name)
    result.notes += notes
    simulation = Simulation(config, model_args, dims, measure, None, result.notes)
    assumed = planner_assumptions(config)
    simulation.prediction = prediction = planner_prediction(model_args, dims.layout, config.training.seq_len, assumed)
    result.layout = layout_summary(config, dims, simulation.plan)
    selected = select_ranks(ranks, world_size, dims.pp, simulation.most_parameters_rank)
    framework = int(FRAMEWORK_BYTES) if target_device(config) == "cuda" else 0
    for index, rank in enumerate(selected):
        result.ranks.append(
            RankEstimate(
                **simulation.rank(rank),
                framework=framework,
                capacity=capacity,
                usable=None if capacity is None else capacity * MEMORY_HEADROOM,
                planner=prediction,
            )
        )
        if progress is not None:
            progress(index + 1, len(selected), rank)
    if simulation.schedule is not None:
        result.layout["pp_receive_buffers"] = "in flight" if simulation.schedule.receives_in_flight else "step"
    result.seconds = time.perf_counter() - start
    return result


def layout_summary(config: Config, dims: ParallelDims, plan: StagePlan) -> dict:
    """The layout as the estimate reports it: degrees, the step's shape, the pipeline's stages."""
    layout, t, pipelined = dims.layout, config.training, dims.pp > 1
    return {
        **{axis: getattr(layout, axis) for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")},
        "etp": layout.expert_tp,
        "efsdp": dims.efsdp,
        "dp_shard_mode": layout.dp_shard_mode,
        "activation_checkpoint": layout.activation_checkpoint,
        "micro_batch_size": layout.micro_batch_size,
        "microbatches": layout.microbatches,
        "seq_len": t.seq_len,
        "global_batch_size": t.global_batch_size,
        "compute_dtype": str(target_dtype(config)).removeprefix("torch."),
        "pp_schedule": layout.pp_schedule if pipelined else None,
        "pp_virtual_stages": layout.virtual_stages,
        "stage_units": [[u.start, u.stop] for u in plan.ranges] if pipelined else None,
    }


# --- the planner's prediction ------------------------------------------------------------------------------
def planner_prediction(model_args: ModelArgs, layout: Layout, seq_len: int, assumed) -> dict | None:
    """The planner's per-GPU bytes for this layout (its fullest rank), or None where it has no model of it."""
    from trillion.parallel.planner.memory import layout_memory

    try:
        memory = layout_memory(model_args, layout, seq_len, assumed)
    except (KeyError, ConfigError):  # e.g. selective:op, which the planner does not model
        return None
    out = {k: float(getattr(memory, k)) for k in ("parameters", "gradients", "optimizer", "activations", "buffers")}
    out["total"] = float(memory.total)
    return out


def planner_assumptions(config: Config):
    """What the planner assumes of this run beyond its layout: the config's optimizer, its moments' dtype and its
    parameters' average, the planner's defaults else."""
    from trillion.parallel.planner.assumptions import Assumptions

    optimizer = config.optimizer
    return Assumptions(
        optimizer=optimizer.name, optimizer_state_dtype=optimizer.state_dtype, ema_decay=optimizer.ema_decay
    )


# --- which ranks -------------------------------------------------------------------------------------------
def select_ranks(spec: str, world_size: int, pp: int = 1, most_parameters=lambda: 0) -> list[int]:
    """first, second (the first rank of pipeline rank 1), middle (of pipeline rank pp // 2), last, max (the rank with
    the most parameters: `most_parameters()`), all, or rank numbers, comma-separated; duplicates dropped."""
    if spec.strip() == "all":
        return list(range(world_size))
    named = {
        "first": lambda: 0,
        "second": lambda: min(1, pp - 1) * (world_size // pp),
        "middle": lambda: pp // 2 * (world_size // pp),
        "last": lambda: world_size - 1,
        "max": most_parameters,
    }
    ranks = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in named:
            rank = named[item]()
        elif item.isdigit() and int(item) < world_size:
            rank = int(item)
        else:
            raise ConfigError(
                f"--ranks {spec!r}: {item!r} is not first, second, middle, last, max, all or a rank below the "
                f"world size {world_size}. E.g. --ranks first,last or --ranks 0,17,{world_size - 1}."
            )
        if rank not in ranks:
            ranks.append(rank)
    if not ranks:
        raise ConfigError("--ranks is empty; use e.g. --ranks first,last.")
    return ranks


def device_capacity(hardware: str | None) -> tuple[str | None, float | None]:
    """(device name, bytes) of --hardware's profile, else of this machine's GPU, else unknown."""
    from trillion.devices import lookup_device
    from trillion.parallel.planner.hardware import load_profile

    if hardware:
        spec = load_profile(hardware).device
        return spec.name, spec.memory_gb * 1e9
    if torch.cuda.is_available():
        spec = lookup_device(torch.cuda.get_device_name())
        if spec is not None:
            return spec.name, spec.memory_gb * 1e9
    return None, None
