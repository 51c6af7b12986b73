"""What one simulated rank of the dry run builds and holds (trainer/tools/estimate/dry_run.py drives it).

A rank's stages come from the pipeline's own split (parallel/pp_layout.py `split_units` of the layout's
stage_layers, parallel/pipeline.py `stage_indices`; the trainer's `Pipeline` builds and parallelizes them), one
stage of everything without pipelining.
Stages of the same shape (embeddings or not, number of blocks, output or not) hold the same bytes,
so each shape is built and measured once, and each (shapes of a rank's stages, dp_shard and cp
coordinates) is sharded once: FSDP's torch.chunk shards differ along dp_shard x cp only (the routed
experts' along its efsdp part; ep splits them evenly, validated), TP splits evenly (validated) and
replicas are copies. MoE layers run with the rank's E / ep experts and a balanced route
(trainer/tools/estimate/activations.py).

Under a pipeline schedule FSDP reshards nothing between micro-batches (the stage's parameters stay
gathered and its gradients accumulate unsharded, as zero1 without pipelining); the schedule's receive
buffers and micro-batches in flight are trainer/tools/estimate/pipeline_schedule.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trillion.models import ModelArgs, Transformer
from trillion.models.moe import routed_expert_parameters
from trillion.parallel.dims import AXES, ParallelDims
from trillion.parallel.layout import Layout
from trillion.parallel.modes import checkpoint_mode
from trillion.parallel.pipeline import Pipeline, stage_indices, stage_module
from trillion.parallel.pp_layout import split_units
from trillion.trainer.assemble import build_model, compute_dtype, layout_fn
from trillion.trainer.config.schema import Config
from trillion.trainer.tools.estimate.activations import (
    MicroBatchMemory,
    local_tensor,
    measure_in_depth,
    measure_micro_batch,
)

REDUCE_DTYPE = torch.float32  # parallel/fsdp.py: gradients are reduced (and kept) in fp32
ADAMW_STATES = 2  # exp_avg, exp_avg_sq
ADAMW_STEP_BYTES = 4  # the float32 `step` tensor per parameter


# --- set-up --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as `rank` of a fake process group of `world_size` (collectives do nothing).

    On the way out DTensor's caches are cleared: they key on meshes, and a DeviceMesh compares equal
    whatever rank built it, so a later simulated rank would get specs holding an earlier rank's mesh
    (and coordinates): uneven shards then come out of distribute_tensor at the wrong size."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("estimate needs a process without a process group (it simulates its own)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()
        _gen_transform_infos.cache_clear()
        clear_redistribute_planner_cache()


@contextlib.contextmanager
def quiet():
    """The trainer's info lines (a pipeline's split, a step's loss, ...) once per simulated rank would
    bury the result."""
    log = logging.getLogger("trillion")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


def target_device(config: Config) -> str:
    """The device the run is meant for: cpu only when the config says so."""
    return "cpu" if config.job.device == "cpu" else "cuda"


def target_dtype(config: Config) -> torch.dtype:
    """The compute dtype on the device the run is meant for."""
    return compute_dtype(config.training.dtype, target_device(config))


def item_bytes(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def coords_of(dims: ParallelDims, rank: int) -> dict:
    """Mesh coordinates of `rank` (tp innermost, pp outermost; see parallel/dims.py), axes of size > 1."""
    coords, rest = {}, rank
    for name in reversed(AXES):
        size = getattr(dims, name)
        coords[name] = rest % size
        rest //= size
    return {name: coords[name] for name in AXES if getattr(dims, name) > 1}


def meshed_dims(dims: ParallelDims) -> ParallelDims:
    """A copy of `dims` with its mesh built in the current (fake) world, compile off (it changes no bytes held)."""
    copy = ParallelDims(dataclasses.replace(dims.layout, compile=False), dims.world_size)
    copy.build_mesh("cpu")
    return copy


def apply_layout(part: nn.Module, config: Config, dims: ParallelDims, fsdp: bool) -> nn.Module:
    """The trainer's layout (`dims` a meshed_dims: compile off). Without `fsdp`: the same TP, CP and EP
    plan and activation checkpointing, in the compute dtype, without FSDP2 (the activation run: the routed
    experts are this rank's E / ep, so their gradients and the dispatch are the run's)."""
    if not fsdp:
        part.to(target_dtype(config))
    return layout_fn(dims, target_dtype(config), fsdp=fsdp)(part)


# --- stages --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageShape:
    """What a stage holds; stages of the same shape hold the same bytes."""

    first: bool  # the embeddings
    layers: int
    last: bool  # the final norm and the output projection
    routed_layers: int = 0  # of its layers, those with routed experts (DeepSeek's first blocks are dense)


class StagePlan:
    """The split of the model into the layout's pp x v stages (the pipeline's, sized by its stage_layers), one
    stage without pipelining; `routed_layers` the indices of the layers with routed experts, `ahead_modules` the
    multi-token prediction modules (pp_layout's M)."""

    def __init__(self, layout: Layout, n_layers: int, routed_layers: frozenset = frozenset(), ahead_modules: int = 0):
        self.pp, self.n_layers, self.routed_layers = layout.pp, n_layers, routed_layers
        self.schedule, self.virtual = layout.pp_schedule, layout.virtual_stages
        self.ranges = split_units(n_layers, self.pp * self.virtual, layout.stage_layers, ahead_modules)

    @property
    def last_index(self) -> int:
        return len(self.ranges) - 1

    def indices(self, pp_rank: int) -> list[int]:
        return stage_indices(pp_rank, self.pp, self.virtual, self.schedule)

    def shape(self, index: int) -> StageShape:
        units = self.ranges[index]
        first, last = 0 in units, self.n_layers + 1 in units
        routed = sum(1 for unit in units if unit - 1 in self.routed_layers)  # unit u > 0 holds layer u - 1
        return StageShape(first, len(units) - first - last, last, routed)

    def rank_shapes(self, pp_rank: int) -> tuple[StageShape, ...]:
        return tuple(self.shape(i) for i in self.indices(pp_rank))

    def index_of(self, shape: StageShape) -> int:
        return next(i for i in range(len(self.ranges)) if self.shape(i) == shape)


def rank_parts(config: Config, model: nn.Module, dims: ParallelDims) -> tuple[list[nn.Module], Pipeline | None]:
    """This rank's parts (the model, parallelized in place, or its stages) and Pipeline, built by the
    trainer's own assemble.build_model (`dims` a meshed_dims: compile off)."""
    return build_model(dims, model, torch.device("cpu"), target_dtype(config))


class StageSource:
    """Unsharded meta models of a layout's stages. Without pipelining, a fresh model (parallelize
    works in place) of the stage's depth; with it, parallel/pipeline.py's stage_module of one shared
    model (it deep-copies, so the shared model stays whole for the next rank)."""

    def __init__(self, model_args: ModelArgs, pp: int):
        self.args, self.pp, self._shared = model_args, pp, None

    def _build(self, n_layers: int) -> nn.Module:
        with torch.device("meta"):
            return Transformer(dataclasses.replace(self.args, n_layers=n_layers))

    def whole(self) -> nn.Module:
        """The model trainer/train.py builds before splitting or parallelizing it."""
        if self.pp == 1:
            return self._build(self.args.n_layers)
        if self._shared is None:
            self._shared = self._build(self.args.n_layers)
        return self._shared

    def stage(self, units: range, blocks: int | None = None) -> nn.Module:
        """The stage of `units`, cut to its first `blocks` blocks (all when None)."""
        if self.pp == 1:
            return self._build(self.args.n_layers if blocks is None else blocks)
        part = stage_module(self.whole(), units)
        for key in list(part.layers.keys())[blocks:] if blocks is not None else []:
            del part.layers[key]
        return part


def hidden_state(config: Config, source: StageSource, dims: ParallelDims, micro_batch: int) -> torch.Tensor:
    """What a stage sends the next and receives from the previous: the residual stream as the
    embedding stage makes it on meta (shape, dtype, and DTensor layout under TP); blocks keep it."""
    probe = apply_layout(source.stage(range(0, 1)), config, dims, fsdp=False)
    with torch.no_grad():
        return probe(torch.zeros(micro_batch, config.training.seq_len // dims.cp, dtype=torch.long, device="meta"))


# --- bytes from the sharded parts ------------------------------------------------------------------------
def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    seen, total = set(), 0
    for tensor in tensors:
        local = local_tensor(tensor)
        storage = local.untyped_storage()
        key = (storage.device.type, storage.data_ptr()) if storage.device.type != "meta" else id(storage)
        if local.device.type == "meta":
            key = ("meta", id(tensor))  # meta storages have no addresses; FSDP2 gives each shard its own
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _padded_local_numel(param) -> int:
    local = local_tensor(param)
    return local.untyped_storage().nbytes() // local.element_size()


@dataclass(frozen=True)
class States:
    parameters: int
    gradient_shards: int  # the gradients the optimizer steps on (FSDP: padded fp32 shards)
    gradient_item: int  # bytes per gradient element
    optimizer: int
    count: int  # local parameter elements, unpadded
    routed_experts: int = 0  # of `parameters`, the routed experts' (MoE: E / ep experts, FSDP-sharded over efsdp)


def state_bytes(parts: list[nn.Module], muon: frozenset[str] = frozenset(), moment_bytes: int = 0) -> States:
    """Parameters, gradients and optimizer state of the sharded `parts`, from the local shard shapes: AdamW's (its
    moments `moment_bytes` an element, optimizer.state_dtype's; 0: the parameter's), or for the parameters named in
    `muon` (optimizer.name=muon: its hidden matrices) one momentum buffer."""
    named = [(n, p) for part in parts for n, p in part.named_parameters()]
    params = [p for _, p in named]
    experts = [p for part in parts for p in routed_expert_parameters(part)]
    fsdp = any(hasattr(m, "_get_fsdp_state") for part in parts for m in part.modules())
    grad_numel = sum(_padded_local_numel(p) if fsdp else local_tensor(p).numel() for p in params if p.requires_grad)
    grad_item = item_bytes(REDUCE_DTYPE) if fsdp else params[0].element_size()
    optimizer = sum(
        local_tensor(p).numel() * p.element_size()
        if n in muon
        else ADAMW_STATES * local_tensor(p).numel() * (moment_bytes or p.element_size()) + ADAMW_STEP_BYTES
        for n, p in named
        if p.requires_grad
    )
    return States(
        storage_bytes(params),
        grad_numel * grad_item,
        grad_item,
        optimizer,
        sum(local_tensor(p).numel() for p in params),
        storage_bytes(experts),
    )


def tp_local_numel(module: nn.Module) -> int:
    return sum(local_tensor(p).numel() for p in module.parameters())


@dataclass(frozen=True)
class StageFacts:
    """One stage shape, TP-sharded: its parameter elements, its largest block's, what one micro-batch costs."""

    numel: int
    block_numel: int
    blocks: int
    memory: MicroBatchMemory | None  # None: not measured


def stage_facts(
    config: Config,
    source: StageSource,
    dims: ParallelDims,
    units: range,
    shape: StageShape,
    inputs: torch.Tensor,
    target: torch.Tensor,
    measure: bool,
) -> StageFacts:
    """Element counts of the TP-only stage and (if `measure`) one micro-batch through it on meta."""
    part = apply_layout(source.stage(units), config, dims, fsdp=False)
    blocks = [tp_local_numel(b) for b in part.layers.values()]
    if not measure:
        return StageFacts(tp_local_numel(part), max(blocks, default=0), len(blocks), None)

    def run(n: int) -> MicroBatchMemory:
        cut = part if n == shape.layers else apply_layout(source.stage(units, n), config, dims, fsdp=False)
        gpu = target_device(config) == "cuda"
        return measure_micro_batch(cut, inputs, target, dims.tp_enabled, last=shape.last, gpu=gpu)

    period = checkpoint_mode(dims.layout.activation_checkpoint).period
    return StageFacts(
        tp_local_numel(part), max(blocks, default=0), len(blocks), measure_in_depth(run, shape.layers, period)
    )


def micro_batch_data(
    config: Config, shape: StageShape, hidden: torch.Tensor | None, micro_batch: int, cp: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, target) of one micro-batch on meta, this cp rank's share of the sequence: tokens or the
    received hidden state in; labels (last stage) or the gradient received for the output."""
    tokens = torch.zeros(micro_batch, config.training.seq_len // cp, dtype=torch.long, device="meta")
    inputs = tokens if shape.first else hidden.detach().requires_grad_()
    return inputs, tokens if shape.last else torch.empty_like(hidden)


def gathered_and_reduce_bytes(
    facts: list[StageFacts], pipelined: bool, mode: str, dtype: torch.dtype
) -> tuple[int, int]:
    """(FSDP's gathered parameters in the compute dtype, one block's fp32 reduce-scatter input).
    zero3 without pipelining: two blocks (the one in use and the prefetched one) plus the root, which
    is never resharded after forward; otherwise the whole of the rank's stages (see the module doc)."""
    block = max(f.block_numel for f in facts)
    gathered = sum(f.numel for f in facts)
    if mode == "zero3" and not pipelined:
        (stage,) = facts
        gathered = min(2, stage.blocks) * block + stage.numel - stage.blocks * stage.block_numel
    return gathered * item_bytes(dtype), block * item_bytes(REDUCE_DTYPE)
