"""The optimizer: AdamW with weight decay on matrices only, or Muon for the hidden matrices and AdamW for the rest
(parallel/muon/: which matrices, the distributed step, MuonClip), and the learning-rate schedules."""

import math

import torch
from torch import nn

from trillion.errors import ConfigError
from trillion.parallel.adamw_states import STATE_DTYPES, StateDtypeAdamW
from trillion.parallel.dims import ParallelDims
from trillion.parallel.float8 import register_scale_precompute
from trillion.parallel.muon.distributed import stage_group
from trillion.parallel.muon.matrices import hidden_matrices
from trillion.parallel.muon.newton_schulz import working_dtype
from trillion.parallel.muon.optimizer import Muon
from trillion.parallel.muon.qk_clip import QKClip
from trillion.trainer.config.schema import LRSchedule as LRScheduleConfig
from trillion.trainer.config.schema import Optimizer as OptimizerConfig


def parameter_groups(model: nn.Module, weight_decay: float, skip: set[int] = frozenset()) -> list[dict]:
    """Decay the weights of linear layers; never norms, biases or embedding tables. `skip`: ids of parameters
    another optimizer steps (Muon's hidden matrices)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad or id(param) in skip:
            continue
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device_type: str, *, model_args=None, dims=None
) -> torch.optim.Optimizer:
    """AdamW, or (optimizer.name=muon) Muon for the hidden matrices the parts declare (`model_args`: the model's,
    default `model.args`) and AdamW for the rest, distributed over the ranks of `dims` (default: one process)."""
    if cfg.name not in ("adamw", "muon"):
        raise ConfigError(f"optimizer.name={cfg.name!r} is not supported. Use adamw or muon.")
    implementation = cfg.implementation
    if implementation == "auto":  # fused: a non-finite step is masked on the device (no host read per step)
        implementation = "fused" if device_type in ("cuda", "cpu") else "foreach"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    if implementation not in flags:
        raise ConfigError(
            f"optimizer.implementation={cfg.implementation!r} is not known. Use auto, fused, foreach or for-loop."
        )
    matrices = hidden_matrices(model_args or model.args) if cfg.name == "muon" else {}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = parameter_groups(model, cfg.weight_decay, skip={id(p) for n, p in named if n in matrices})
    hyper = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    if cfg.state_dtype == "float32":
        adamw = torch.optim.AdamW(groups, **hyper, **flags[implementation])
    elif cfg.implementation == "fused":
        raise ConfigError(
            f"optimizer.state_dtype={cfg.state_dtype} with optimizer.implementation=fused: torch's fused AdamW keeps "
            "its moments in the parameters' dtype. Use --optimizer.implementation=auto (the step that keeps them in "
            f"{cfg.state_dtype}), or --optimizer.state_dtype=float32."
        )
    else:
        adamw = StateDtypeAdamW(groups, **hyper, state_dtype=STATE_DTYPES[cfg.state_dtype])
    optimizer = adamw if cfg.name == "adamw" else build_muon(model, cfg, named, matrices, adamw, model_args, dims)
    register_scale_precompute(optimizer, model)  # FSDP float8 all-gather: the next step's weight scales, per step
    return optimizer


def build_muon(model, cfg: OptimizerConfig, named, matrices, adamw, model_args, dims) -> Muon:
    """Muon over the hidden matrices of `named` (with MuonClip's clip when optimizer.qk_clip is set)."""
    dims = dims or ParallelDims(world_size=1)
    chosen = [(p, matrices[n]) for n, p in named if n in matrices]
    state_dtype = chosen[0][0].dtype if chosen else torch.float32
    device_type = chosen[0][0].device.type if chosen else "cpu"
    clip = QKClip(model, model_args or model.args, cfg.qk_clip, dims) if cfg.qk_clip > 0 else None
    return Muon(
        chosen,
        adamw,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        steps=cfg.newton_schulz_steps,
        dtype=working_dtype(cfg.newton_schulz_dtype, state_dtype, device_type),
        group=stage_group(dims),
        clip=clip,
    )


def lr_multiplier(step: int, total_steps: int, cfg: LRScheduleConfig) -> float:
    """Fraction of the peak LR used for the update of `step` (0-based)."""
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    floor = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "wsd":
        decay_steps = max(1, round(cfg.decay_ratio * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - 1 - decay_start))
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))  # the last update uses the floor
    if cfg.name == "linear":
        return 1.0 - (1.0 - floor) * progress
    if cfg.name == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ConfigError(f"lr_schedule.name={cfg.name!r} is not known. Use cosine, linear, wsd or constant.")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduleConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
