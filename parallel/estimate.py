"""Dry run at full scale: the real model, TP plan and FSDP2 on the meta device under PyTorch's fake
process group, one simulated rank at a time, and the bytes each rank would hold.

For each requested rank the fake group is (re)initialized with that rank, the config's layout is
built with the trainer's own `build_parallel_dims` and `parallelize`, and memory is read off what
that produced:

- parameters: the unique storages of the local shards (FSDP2 allocates each shard padded to the
  ceiling of torch.chunk; an empty shard still allocates the padded rows);
- gradients: FSDP2 reduce-scatters into padded shards in the reduce dtype (fp32); under zero1 with
  several micro-batches the unsharded (TP-local) gradients also accumulate in fp32;
- optimizer: AdamW's exp_avg and exp_avg_sq per local (unpadded) shard in the master dtype, plus
  its 4-byte `step` per parameter. Counted from the shapes, never from running the optimizer under
  fake tensors (foreach AdamW inflated that figure);
- activations (parallel/estimate_activations.py): one micro-batch forward + backward of the TP +
  activation-checkpointed model on meta tensors under `MemTracker` (FSDP does not change
  activations, so it is left out of that run; each weight gradient is dropped once accumulated, as
  FSDP's reduce-scatter frees it). The peak above parameters and buffers is the figure. If that run fails, the planner's analytic figure is
  used instead and labelled "predicted";
- buffers: FSDP's gathered parameters in the compute dtype (zero3: two blocks, the one in use and
  the prefetched one, plus the root, which is never resharded after forward; zero1/zero2: the
  whole model, kept through the step) and one block's unsharded fp32 gradient being
  reduce-scattered, from the TP-local shapes; plus the planner's 1 GB framework allowance.

Pipeline parallelism: each rank's `stage` is its pp coordinate; with pp == 1 every rank holds stage
0 of 1. The estimate refuses pp > 1 for now. The stage split slots into `_build_rank_model` (cut the
meta model to this rank's stage with parallel/pipeline.py's split before parallelize, keyed by the
rank's pp coordinate), `measure_stage_activations` (that stage's layers, times the schedule's
in-flight micro-batches of the stage) and `buffer_bytes` (the stage's send/receive buffers); the
activation figure is then per stage rather than shared by all ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from models import ModelArgs, Transformer
from parallel.activation_checkpoint import _parse
from parallel.dims import AXES, ParallelDims
from parallel.estimate_activations import local_tensor, measure_stage_activations
from parallel.parallelize import parallelize
from trainer.config import Config
from trainer.errors import ConfigError

log = logging.getLogger("trillion")

REDUCE_DTYPE = torch.float32  # parallel/fsdp.py: gradients are reduced (and kept) in fp32
ADAMW_STATES = 2  # exp_avg, exp_avg_sq
ADAMW_STEP_BYTES = 4  # the float32 `step` tensor per parameter
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class RankEstimate:
    """The bytes one rank holds at its peak, by kind; `activations_source` says how that figure was got."""
    rank: int
    coords: dict  # mesh axis -> this rank's coordinate (axes of size > 1)
    stage: int  # pipeline stage (0 while pp == 1)
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    activations_source: str  # "measured" (meta run under MemTracker) | "predicted" (planner's formula)
    buffers: int  # FSDP gathered parameters and reduce-scatter input
    framework: int  # context, workspaces (the planner's allowance, not measured)
    parameter_count: int  # local elements, unpadded
    capacity: float | None = None  # bytes of the device; None: unknown
    usable: float | None = None  # capacity x the planner's headroom
    planner: dict | None = None  # the planner's prediction for this layout (bytes by kind), None if it has none

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
        return {"model": self.config_model, "world_size": self.world_size, "layout": self.layout,
                "device": self.device, "seconds": round(self.seconds, 2), "notes": self.notes,
                "ranks": [r.as_dict() for r in self.ranks]}


# --- set-up ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as `rank` of a fake process group of `world_size` (collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("estimate needs a process without a process group (it simulates its own)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def target_device(config: Config) -> str:
    """The device the run is meant for: cpu only when the config says so."""
    return "cpu" if config.job.device == "cpu" else "cuda"


def compute_dtype(config: Config) -> torch.dtype:
    if config.training.dtype == "auto":
        return torch.bfloat16 if target_device(config) == "cuda" else torch.float32
    if config.training.dtype not in DTYPES:
        raise ConfigError(f"training.dtype={config.training.dtype!r} is not known. Use auto, bf16, fp16 or fp32.")
    return DTYPES[config.training.dtype]


def _layout(config: Config, world_size: int, model_args: ModelArgs):
    """ParallelDims checked against world, model and batch, exactly as `trillion train` checks them
    (its mesh is built later, per simulated rank)."""
    from trainer.launch import LaunchEnv
    from trainer.train import build_parallel_dims, validate_training

    env = LaunchEnv(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"))
    validate_training(dataclasses.replace(config, training=dataclasses.replace(
        config.training, dtype="bf16" if config.training.dtype == "fp16" else config.training.dtype)), env)
    with fake_world(0, world_size):
        dims = build_parallel_dims(config, env, model_args)
    dims.mesh = None
    return dims, env


def model_args_for(config: Config) -> ModelArgs:
    from trainer.train import build_model_args
    # The tokenizer is not built (it may need files that live on the cluster): the preset's vocabulary stands.
    return build_model_args(config, tokenizer_vocab=0)


def _coords(dims: ParallelDims, rank: int) -> dict:
    """Mesh coordinates of `rank` (tp innermost, pp outermost; see parallel/dims.py)."""
    coords, rest = {}, rank
    for name in reversed(AXES):
        size = getattr(dims, name)
        coords[name] = rest % size
        rest //= size
    return {name: coords[name] for name in AXES if getattr(dims, name) > 1}


def _new_dims(dims: ParallelDims) -> ParallelDims:
    return ParallelDims(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=dims.cp, tp=dims.tp,
                        world_size=dims.world_size)


def _build_rank_model(config: Config, model_args: ModelArgs, dims: ParallelDims, fsdp: bool) -> nn.Module:
    """This rank's model on meta, parallelized by the trainer's own path (its stage's part once pp
    lands). Without `fsdp`: the same TP plan and activation checkpointing, no FSDP, in the compute
    dtype (the activation run)."""
    with torch.device("meta"):
        model = Transformer(model_args)
    if not fsdp:
        model.to(compute_dtype(config))
    parallelize(model, dims if fsdp else _TPOnly(dims), dp_shard_mode=config.parallel.dp_shard_mode,
                activation_checkpoint=config.parallel.activation_checkpoint, compile=False,
                param_dtype=compute_dtype(config))
    return model


class _TPOnly:
    """The layout parallelize sees for the activation run: the same TP mesh, no FSDP."""

    def __init__(self, dims: ParallelDims):
        self.tp_enabled, self.tp_mesh, self.fsdp_enabled, self.fsdp_mesh = dims.tp_enabled, dims.tp_mesh, False, None


# --- bytes from the sharded model ----------------------------------------------------------------------
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


def state_bytes(model: nn.Module, mode: str, microbatches: int, tp_local_numel: int) -> tuple[int, int, int, int]:
    """(parameters, gradients, optimizer, local parameter count) of the sharded `model`."""
    params = [p for p in model.parameters()]
    parameters = storage_bytes(params)
    reduce_bytes = torch.tensor([], dtype=REDUCE_DTYPE).element_size()
    fsdp = any(hasattr(m, "_get_fsdp_state") for m in model.modules())
    grad_numel = sum(_padded_local_numel(p) if fsdp else local_tensor(p).numel() for p in params if p.requires_grad)
    gradients = grad_numel * (reduce_bytes if fsdp else params[0].element_size())
    if mode == "zero1" and microbatches > 1 and fsdp:
        gradients += tp_local_numel * reduce_bytes  # unsharded accumulation until the last micro-batch
    local_numel = sum(local_tensor(p).numel() for p in params)
    optimizer = sum(ADAMW_STATES * local_tensor(p).numel() * p.element_size() + ADAMW_STEP_BYTES
                    for p in params if p.requires_grad)
    return parameters, gradients, optimizer, local_numel


def _tp_local_numel(module: nn.Module) -> int:
    return sum(local_tensor(p).numel() for p in module.parameters())


def buffer_bytes(tp_model: nn.Module, dims: ParallelDims, mode: str, param_dtype: torch.dtype) -> int:
    """FSDP's gathered parameters (compute dtype) and one block's fp32 reduce-scatter input."""
    if not dims.fsdp_enabled:
        return 0
    blocks = list(tp_model.layers.values())
    block = max((_tp_local_numel(b) for b in blocks), default=0)
    total = _tp_local_numel(tp_model)
    root = total - sum(_tp_local_numel(b) for b in blocks)
    item = torch.tensor([], dtype=param_dtype).element_size()
    gathered = (min(2, len(blocks)) * block + root) if mode == "zero3" else total
    return gathered * item + block * torch.tensor([], dtype=REDUCE_DTYPE).element_size()



# --- the planner's prediction ------------------------------------------------------------------------------
def planner_prediction(config: Config, model_args: ModelArgs, dims: ParallelDims, micro_batch: int,
                       microbatches: int) -> dict | None:
    """The planner's per-GPU bytes for this layout (its fullest rank), or None where it has no model of it."""
    from parallel.planner_layout import Layout
    from parallel.planner_memory import layout_memory

    p = config.parallel
    layout = Layout(tp=dims.tp, pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard,
                    dp_shard_mode=p.dp_shard_mode, pp_schedule=p.pp_schedule, virtual_stages=1,
                    micro_batch_size=micro_batch, microbatches=microbatches, activation_checkpoint=p.activation_checkpoint)
    try:
        memory = layout_memory(model_args, layout, config.training.seq_len)
    except (KeyError, ConfigError):  # e.g. selective:op, which the planner does not model
        return None
    out = {k: float(getattr(memory, k)) for k in ("parameters", "gradients", "optimizer", "activations", "buffers")}
    out["total"] = float(memory.total)
    return out


# --- which ranks -------------------------------------------------------------------------------------------
def select_ranks(spec: str, world_size: int) -> list[int]:
    """first, last, max (the rank FSDP gives the ceiling shards: dp_shard coordinate 0, i.e. rank 0
    while pp == 1), all, or rank numbers, comma-separated."""
    if spec.strip() == "all":
        return list(range(world_size))
    ranks = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in ("first", "max"):
            rank = 0
        elif item == "last":
            rank = world_size - 1
        elif item.isdigit() and int(item) < world_size:
            rank = int(item)
        else:
            raise ConfigError(f"--ranks {spec!r}: {item!r} is not first, last, max, all or a rank below the world "
                              f"size {world_size}. E.g. --ranks first,last or --ranks 0,17,{world_size - 1}.")
        if rank not in ranks:
            ranks.append(rank)
    if not ranks:
        raise ConfigError("--ranks is empty; use e.g. --ranks first,last.")
    return ranks


def device_capacity(hardware: str | None) -> tuple[str | None, float | None]:
    """(device name, bytes) of --hardware's profile, else of this machine's GPU, else unknown."""
    from parallel.hardware import load_profile, lookup_device

    if hardware:
        spec = load_profile(hardware).device
        return spec.name, spec.memory_gb * 1e9
    if torch.cuda.is_available():
        spec = lookup_device(torch.cuda.get_device_name())
        if spec is not None:
            return spec.name, spec.memory_gb * 1e9
    return None, None


# --- the dry run ----------------------------------------------------------------------------------------------
def estimate(config: Config, world_size: int, ranks: str = "first,last", hardware: str | None = None,
             measure: bool = True, progress=None) -> Estimate:
    """Per-rank memory of `config`'s layout at `world_size`, simulating each selected rank in turn."""
    from parallel.planner_memory import FRAMEWORK_BYTES, MEMORY_HEADROOM

    start = time.perf_counter()
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size} must be a positive number of processes.")
    if config.parallel.pp > 1:
        raise ConfigError(f"parallel.pp={config.parallel.pp}: trillion estimate does not simulate pipeline stages yet "
                          "(no per-stage split or in-flight micro-batches), so it would report wrong figures. Use "
                          "--parallel.pp=1 and spread the model with dp_shard and tp, or `trillion plan` for a "
                          "pipeline layout's predicted memory.")
    model_args = model_args_for(config)
    dims, _ = _layout(config, world_size, model_args)  # raises ConfigError for bad degrees, model or batch
    t = config.training
    micro_batch = min(t.micro_batch_size, t.global_batch_size // dims.dp_size)
    microbatches = t.global_batch_size // (micro_batch * dims.dp_size)
    mode, dtype = config.parallel.dp_shard_mode, compute_dtype(config)
    device_name, capacity = device_capacity(hardware)
    prediction = planner_prediction(config, model_args, dims, micro_batch, microbatches)
    result = Estimate(config.model.name, world_size,
                      {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                       "tp": dims.tp, "dp_shard_mode": mode, "activation_checkpoint": config.parallel.activation_checkpoint,
                       "micro_batch_size": micro_batch, "microbatches": microbatches, "seq_len": t.seq_len,
                       "compute_dtype": str(dtype).removeprefix("torch.")}, device_name)
    activations = source = grad_elements = buffers = tp_local = None
    selected = select_ranks(ranks, world_size)
    for index, rank in enumerate(selected):
        with fake_world(rank, world_size):
            rank_dims = _new_dims(dims)
            rank_dims.build_mesh("cpu")
            if activations is None:  # the same on every rank of a stage: TP splits evenly (validated)
                tp_model = _build_rank_model(config, model_args, rank_dims, fsdp=False)
                tp_local = _tp_local_numel(tp_model)
                buffers = buffer_bytes(tp_model, rank_dims, mode, dtype)
                del tp_model
                activations, source, grad_elements = _activations(config, model_args, micro_batch, rank_dims,
                                                                  prediction, measure, result.notes)
            model = _build_rank_model(config, model_args, rank_dims, fsdp=True)
            parameters, gradients, optimizer, count = state_bytes(model, mode, microbatches, tp_local)
            if not rank_dims.fsdp_enabled and grad_elements is not None:  # autograd's gradients, as measured
                gradients = grad_elements * next(model.parameters()).element_size()
            del model
        result.ranks.append(RankEstimate(
            rank=rank, coords=_coords(dims, rank), stage=_coords(dims, rank).get("pp", 0), parameters=parameters,
            gradients=gradients, optimizer=optimizer, activations=activations, activations_source=source,
            buffers=buffers, framework=int(FRAMEWORK_BYTES) if target_device(config) == "cuda" else 0,
            parameter_count=count, capacity=capacity,
            usable=None if capacity is None else capacity * MEMORY_HEADROOM, planner=prediction))
        if progress is not None:
            progress(index + 1, len(selected), rank)
    result.seconds = time.perf_counter() - start
    return result


def _activations(config, model_args, micro_batch, dims, prediction, measure, notes) -> tuple[int, str, int | None]:
    if measure:
        try:
            period = _parse(config.parallel.activation_checkpoint)[1]
            build = lambda n: _build_rank_model(config, dataclasses.replace(model_args, n_layers=n), dims,  # noqa: E731
                                                fsdp=False)
            peak, grads = measure_stage_activations(build, model_args.n_layers, period, model_args.vocab_size,
                                                    micro_batch, config.training.seq_len, dims.tp_enabled)
            return peak, "measured", grads
        except Exception as error:  # a fake/meta run that cannot be trusted is not reported as measured
            notes.append(f"activation run on meta tensors failed ({type(error).__name__}: {str(error)[:200]}); "
                         "the activation figure is the planner's prediction")
            log.warning("estimate: %s", notes[-1])
    if prediction is None:
        raise ConfigError("The activation peak could not be measured and the planner has no model of "
                          "this layout's activation checkpointing; use --parallel.activation_checkpoint=none, "
                          "selective or full.")
    return int(prediction["activations"]), "predicted", None




# --- when it does not fit ------------------------------------------------------------------------------------
KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers", "framework")


def advice(rank: RankEstimate, layout: dict) -> str:
    """What dominates the rank's memory and which setting to change."""
    kind = max(KINDS, key=lambda k: getattr(rank, k))
    share = getattr(rank, kind) / rank.total
    if kind in ("parameters", "gradients", "optimizer"):
        fix = (f"shard the model states over more ranks: raise --parallel.dp_shard (now {layout['dp_shard']}, with "
               f"dp_replicate {layout['dp_replicate']}) or --parallel.tp (now {layout['tp']}), or launch more GPUs")
        if layout["dp_shard_mode"] != "zero3":
            fix += f"; --parallel.dp_shard_mode=zero3 (now {layout['dp_shard_mode']}) frees the gathered copy"
    elif kind == "activations":
        fix = (f"--parallel.activation_checkpoint=full (now {layout['activation_checkpoint']})"
               if layout["activation_checkpoint"] != "full" else "")
        fix = "; ".join(x for x in (fix, f"a smaller --training.micro_batch_size (now {layout['micro_batch_size']})",
                                    f"a larger --parallel.tp (now {layout['tp']})") if x)
    elif kind == "buffers":
        fix = (f"--parallel.dp_shard_mode=zero3 (now {layout['dp_shard_mode']}) keeps only two blocks gathered"
               if layout["dp_shard_mode"] != "zero3" else f"a larger --parallel.tp (now {layout['tp']}) shrinks each gathered block")
    else:
        fix = "a device with more memory"
    return f"{kind} dominate ({getattr(rank, kind) / 1e9:.1f} GB, {share:.0%}); to fit, {fix}"


def shortfall_message(result: Estimate) -> str | None:
    """One paragraph about the worst rank that does not fit, or None when all fit (or capacity is unknown)."""
    over = [r for r in result.ranks if r.fits is False]
    if not over:
        return None
    worst = max(over, key=lambda r: r.total - r.usable)
    where = ", ".join(f"{k} {v}" for k, v in worst.coords.items()) or "the only rank"
    return (f"rank {worst.rank} ({where}) of {result.world_size} needs {worst.total / 1e9:.1f} GB but a "
            f"{result.device} offers {worst.usable / 1e9:.1f} GB usable ({worst.capacity / 1e9:.0f} GB at the planner's "
            f"headroom): short by {(worst.total - worst.usable) / 1e9:.1f} GB"
            + (f" ({len(over)} of the {len(result.ranks)} simulated ranks do not fit)" if len(over) > 1 else "")
            + f". {advice(worst, result.layout)[0].upper()}{advice(worst, result.layout)[1:]}.")
