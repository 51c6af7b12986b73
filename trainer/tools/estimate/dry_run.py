"""Dry run at full scale: the real model, pipeline split, TP plan and FSDP2 on the meta device under
PyTorch's fake process group, one simulated rank at a time, and the bytes each rank would hold.

For each requested rank the fake group is (re)initialized with that rank, the config's layout is
built with the trainer's own `build_parallel_dims`, `Pipeline` and `parallelize`, and memory is read
off what that produced (trainer/tools/estimate/rank.py builds a rank, trainer/tools/estimate/activations.py
measures one micro-batch):

- parameters: the unique storages of the local shards (FSDP2 allocates each shard padded to the
  ceiling of torch.chunk; an empty shard still allocates the padded rows);
- gradients: FSDP2 reduce-scatters into padded shards in the reduce dtype (fp32). Under zero1
  with several micro-batches and under any pipeline schedule (which turns gradient sync off until
  the last micro-batch whatever the mode) the unsharded (TP-local) fp32 gradients accumulate through
  the step instead; they are reduce-scattered and freed group by group at its end, so the larger of
  the two is the peak (the reduce-scatter's own buffer is counted in buffers);
- optimizer: AdamW's exp_avg and exp_avg_sq per local (unpadded) shard in the master dtype, plus
  its 4-byte `step` per parameter. Counted from the shapes, never from running the optimizer under
  fake tensors (foreach AdamW inflated that figure);
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
import logging
import time
from dataclasses import dataclass, field

import torch

from trillion.errors import ConfigError
from trillion.models import ModelArgs
from trillion.parallel.dims import ParallelDims
from trillion.parallel.layout import Layout
from trillion.trainer.assemble import build_model_args, build_parallel_dims, validate_training
from trillion.trainer.config.schema import Config
from trillion.trainer.tools.estimate.activations import local_tensor
from trillion.trainer.tools.estimate.advice import KINDS, advice, shortfall_message
from trillion.trainer.tools.estimate.rank import (
    REDUCE_DTYPE,
    StagePlan,
    StageSource,
    coords_of,
    fake_world,
    gathered_and_reduce_bytes,
    hidden_state,
    in_flight_peak,
    item_bytes,
    meshed_dims,
    micro_batch_data,
    quiet,
    rank_parts,
    receive_bytes,
    schedule_of,
    stage_facts,
    state_bytes,
    storage_bytes,
    target_device,
    target_dtype,
    with_receives,
)

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
log = logging.getLogger("trillion")
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
def layout_dims(config: Config, world_size: int, model_args: ModelArgs) -> ParallelDims:
    """ParallelDims checked against world, model, batch and pipeline schedule, exactly as `trillion
    train` checks them (its mesh is built later, per simulated rank)."""
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
    with fake_world(0, world_size):
        dims = build_parallel_dims(config, env, model_args)
    dims.mesh = None
    return dims


def model_args_for(config: Config) -> ModelArgs:
    # The tokenizer is not built (it may need files that live on the cluster): the preset's vocabulary stands.
    return build_model_args(config, tokenizer_vocab=0)


# --- the simulated ranks ----------------------------------------------------------------------------
class _Simulation:
    """One layout's ranks, each built as `rank` of a fake world; what ranks of the same stage shapes
    (and dp_shard and cp coordinates, for the sharded states) share is built once."""

    def __init__(
        self,
        config: Config,
        model_args: ModelArgs,
        dims: ParallelDims,
        micro_batch: int,
        microbatches: int,
        measure: bool,
        prediction: dict | None,
        notes: list[str],
    ):
        self.config, self.dims, self.micro_batch, self.microbatches = config, dims, micro_batch, microbatches
        self.measure, self.prediction, self.notes = measure, prediction, notes
        moe = frozenset(i for i in range(model_args.n_layers) if model_args.is_moe_layer(i))
        self.plan = StagePlan(config, model_args.n_layers, dims.pp, moe)
        self.source = StageSource(model_args, dims.pp)
        self.states, self.facts = {}, {}  # (stage shapes, (dp_shard, cp) coordinates) -> States; StageShape -> ...
        self.hidden_bytes = None  # pp > 1: one micro-batch's residual stream between stages, local bytes
        self.schedule = None  # pp > 1: every pipeline rank's actions and how it holds receive buffers

    def _key(self, rank: int) -> tuple:
        coords = coords_of(self.dims, rank)
        # FSDP's torch.chunk shards follow the flattened dp_shard x cp coordinate (the routed experts' its efsdp part)
        return self.plan.rank_shapes(coords.get("pp", 0)), (coords.get("dp_shard", 0), coords.get("cp", 0))

    def _simulate(self, rank: int) -> None:
        """Build, as `rank` of a fake world, whatever `rank` needs that no earlier rank built."""
        key = self._key(rank)
        missing = [shape for shape in dict.fromkeys(key[0]) if shape not in self.facts]
        pipelined = self.dims.pp > 1
        if key in self.states and not missing and (self.schedule is not None or not pipelined):
            return
        with fake_world(rank, self.dims.world_size), quiet():
            dims = meshed_dims(self.dims)
            hidden = None  # a DTensor under TP, on this world's mesh: made again in every world that needs it
            if pipelined and (missing or self.hidden_bytes is None):
                hidden = hidden_state(self.config, self.source, dims, self.micro_batch)
                self.hidden_bytes = local_tensor(hidden).untyped_storage().nbytes()
            for shape in missing:
                self.facts[shape] = self._stage_facts(shape, dims, hidden)
            if key not in self.states or self.schedule is None and pipelined:
                parts, pipeline = rank_parts(self.config, self.source.whole(), dims, self.microbatches)
                assert [len(part.layers) for part in parts] == [shape.layers for shape in key[0]], "split diverged"
                self.states[key] = state_bytes(parts)
                if pipelined and self.schedule is None:
                    self.schedule = schedule_of(pipeline)

    def _stage_facts(self, shape, dims, hidden):
        index = self.plan.index_of(shape)
        inputs, target = micro_batch_data(self.config, shape, hidden, self.micro_batch, self.dims.cp)

        def run(measure):
            return stage_facts(self.config, self.source, dims, self.plan.ranges[index], shape, inputs, target, measure)

        if self.measure:
            try:
                return run(True)
            except Exception as error:  # a fake/meta run that cannot be trusted is not reported as measured
                self.measure = False
                self.notes.append(
                    f"activation run on meta tensors failed ({type(error).__name__}: "
                    f"{str(error)[:200]}); the activation figure is the planner's prediction"
                )
                log.warning("estimate: %s", self.notes[-1])
        return run(False)

    def most_parameters_rank(self) -> int:
        """The first rank of the pipeline rank whose stages hold the most parameters, at dp_shard
        coordinate 0 (FSDP's ceiling shards)."""
        per_stage = self.dims.world_size // self.dims.pp
        candidates = {}
        for pp_rank in range(self.dims.pp):
            candidates.setdefault(self.plan.rank_shapes(pp_rank), pp_rank * per_stage)
        for rank in candidates.values():
            self._simulate(rank)
        return max(candidates.values(), key=lambda r: (self.states[self._key(r)].parameters, -r))

    def rank(self, rank: int) -> dict:
        """The RankEstimate fields of `rank` (all but capacity and the planner's figures)."""
        self._simulate(rank)
        coords = coords_of(self.dims, rank)
        pp_rank, pipelined = coords.get("pp", 0), self.dims.pp > 1
        shapes, _ = key = self._key(rank)
        states, facts = self.states[key], [self.facts[shape] for shape in shapes]
        memory = {index: self.facts[self.plan.shape(index)].memory for index in self.plan.indices(pp_rank)}
        shards, accumulation = self._gradients(states, facts)
        activations, source, in_flight = self._activations(pp_rank, memory)
        gathered, reduce = (
            gathered_and_reduce_bytes(facts, pipelined, self.config.parallel.dp_shard_mode, target_dtype(self.config))
            if self.dims.fsdp_enabled
            else (0, 0)
        )
        receive = (
            receive_bytes(self.plan, pp_rank, self.microbatches, self.hidden_bytes)
            if pipelined and not self.schedule.receives_in_flight
            else 0
        )
        return dict(
            rank=rank,
            coords=coords,
            stage=pp_rank,
            parameters=states.parameters,
            gradients=max(shards, accumulation),
            optimizer=states.optimizer,
            activations=activations,
            activations_source=source,
            buffers=gathered + reduce + receive,
            parameter_count=states.count,
            detail={
                "stages": self.plan.indices(pp_rank),
                "tp_local_parameters": sum(f.numel for f in facts),
                "routed_expert_parameters": states.routed_experts,
                "gradient_shards": shards,
                "gradient_accumulation": accumulation,
                "fsdp_gathered": gathered,
                "reduce_scatter": reduce,
                "pipeline_receive": receive,
                "in_flight": in_flight,
            },
        )

    def _gradients(self, states, facts) -> tuple[int, int]:
        """(the gradients the optimizer steps on, the unsharded fp32 ones accumulated through the step)."""
        measured = all(f.memory is not None for f in facts)
        # autograd's gradients, as measured: under TP a vocabulary-parallel embedding's is the whole table
        elements = sum(f.memory.grad_elements for f in facts) if measured else sum(f.numel for f in facts)
        if not self.dims.fsdp_enabled:
            return (elements * states.gradient_item if measured else states.gradient_shards), 0
        accumulates = self.dims.pp > 1 or self.config.parallel.dp_shard_mode == "zero1" and self.microbatches > 1
        return states.gradient_shards, elements * item_bytes(REDUCE_DTYPE) if accumulates else 0

    def _activations(self, pp_rank: int, memory: dict) -> tuple[int, str, int | None]:
        """(peak, "measured" or "predicted", micro-batch chunks in flight)."""
        if None in memory.values():
            if self.prediction is None:
                raise ConfigError(
                    "The activation peak could not be measured and the planner has no model of "
                    "this layout's activation checkpointing; use --parallel.activation_checkpoint="
                    "none, selective or full."
                )
            return int(self.prediction["activations"]), "predicted", None
        if self.dims.pp == 1:
            return memory[0].peak, "measured", 1
        if self.schedule.receives_in_flight:
            memory = with_receives(memory, self.plan.last_index, self.hidden_bytes)
        peak, in_flight = in_flight_peak(self.schedule.order[pp_rank], memory)
        return peak, "measured", in_flight


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
    model_args = model_args_for(config)
    dims = layout_dims(config, world_size, model_args)  # raises ConfigError for bad degrees, model, batch or schedule
    t, layout = config.training, dims.layout
    micro_batch, microbatches = layout.micro_batch_size, layout.microbatches
    device_name, capacity = device_capacity(hardware)
    result = Estimate(config.model.name, world_size, {}, device_name)
    simulation = _Simulation(config, model_args, dims, micro_batch, microbatches, measure, None, result.notes)
    plan = simulation.plan
    simulation.prediction = prediction = planner_prediction(model_args, dims.layout, t.seq_len)
    result.layout = {
        "pp": dims.pp,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "cp": dims.cp,
        "tp": dims.tp,
        "ep": dims.ep,
        "efsdp": dims.efsdp,
        "dp_shard_mode": config.parallel.dp_shard_mode,
        "activation_checkpoint": config.parallel.activation_checkpoint,
        "micro_batch_size": micro_batch,
        "microbatches": microbatches,
        "seq_len": t.seq_len,
        "global_batch_size": t.global_batch_size,
        "compute_dtype": str(target_dtype(config)).removeprefix("torch."),
        "pp_schedule": plan.schedule if dims.pp > 1 else None,
        "pp_virtual_stages": plan.virtual,
        "stage_units": [[u.start, u.stop] for u in plan.ranges] if dims.pp > 1 else None,
    }
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


# --- the planner's prediction ------------------------------------------------------------------------------
def planner_prediction(model_args: ModelArgs, layout: Layout, seq_len: int) -> dict | None:
    """The planner's per-GPU bytes for this layout (its fullest rank), or None where it has no model of it."""
    from trillion.parallel.planner.memory import layout_memory

    try:
        memory = layout_memory(model_args, layout, seq_len)
    except (KeyError, ConfigError):  # e.g. selective:op, which the planner does not model
        return None
    out = {k: float(getattr(memory, k)) for k in ("parameters", "gradients", "optimizer", "activations", "buffers")}
    out["total"] = float(memory.total)
    return out


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
