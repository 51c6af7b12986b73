"""Assembling a run, in one place for `trillion train` and `trillion estimate`: the model's arguments
from the config sections, the checks made before any work, the parallel layout (ParallelDims), the
micro-batches per step and the model itself: the whole model or this rank's pipeline stages, each
parallelized, on the meta device. train.py materializes it and runs the loop; the estimate measures
it as simulated ranks of a fake world."""

import dataclasses
import logging
import os

import torch
from torch import nn

from trillion.errors import ConfigError
from trillion.kernels import ATTENTION_IMPLS, NORM_IMPLS
from trillion.models import ModelArgs, Transformer, get_preset, parts
from trillion.models.logit_probe import install_probes
from trillion.models.parts import apply_settings as apply_part_settings
from trillion.parallel import float8
from trillion.parallel.dims import ParallelDims
from trillion.parallel.ep_checks import resolve_dispatch
from trillion.parallel.expert_overlap import pairs_micro_batches
from trillion.parallel.float8_experts import check_experts
from trillion.parallel.forward_backward import MicroBatchLoop, Runner
from trillion.parallel.layout import Layout, check_degrees, degrees_of, resolve_etp
from trillion.parallel.modes import float8_dispatch
from trillion.parallel.muon.qk_clip import check_clippable
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline, StageLayers, validate_pipeline
from trillion.trainer.config.schema import Config, Training, divisor_near, validate_config
from trillion.trainer.launch.env import LaunchEnv

log = logging.getLogger("trillion")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(requested: str, device_type: str) -> torch.dtype:
    """training.dtype on the device type the run is for: auto is bf16 on GPUs, fp32 on CPU."""
    if requested == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return DTYPES[requested]


def batch_split(t: Training, dp_size: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) of each data-parallel rank: a micro-batch
    larger than a rank's share of the global batch shrinks to it."""
    micro_batch_size = min(t.micro_batch_size, t.global_batch_size // dp_size)
    return micro_batch_size, t.global_batch_size // (micro_batch_size * dp_size)


def build_model_args(config: Config, tokenizer_vocab: int) -> ModelArgs:
    """The preset with the config's overrides, checked against the tokenizer and sequence length."""
    cfg = config.model
    overrides = {
        k: v
        for k in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
        if (v := getattr(cfg, k)) > 0
    }
    on_gpu = config.job.device == "cuda" or (config.job.device == "auto" and torch.cuda.is_available())
    attention_impl = (
        config.kernels.attention if config.kernels.attention != "auto" else ("triton" if on_gpu else "sdpa")
    )
    # auto: PyTorch norms under tensor parallelism (the Triton norm kernels take no DTensor activations)
    norm_impl = (
        config.kernels.norm
        if config.kernels.norm != "auto"
        else ("triton" if on_gpu and config.parallel.tp == 1 else "torch")
    )
    args = dataclasses.replace(get_preset(cfg.name), attention_impl=attention_impl, norm_impl=norm_impl, **overrides)
    args = apply_part_settings(args, part_settings(config))
    if args.dim % args.n_heads:
        raise ConfigError(
            f"model.n_heads={args.n_heads} does not divide model.dim={args.dim}; "
            f"pick a head count that divides it (e.g. {divisor_near(args.dim, args.n_heads)})."
        )
    if args.n_heads % args.kv_heads:
        raise ConfigError(
            f"model.n_kv_heads={args.kv_heads} does not divide model.n_heads={args.n_heads}; "
            f"use a divisor of {args.n_heads} (e.g. {divisor_near(args.n_heads, args.kv_heads)})."
        )
    if args.positions == "rope" and args.head_dim % 2:
        raise ConfigError(f"Rotary positions need an even head size; model.dim / model.n_heads = {args.head_dim}.")
    if tokenizer_vocab > args.vocab_size:
        raise ConfigError(
            f"The tokenizer has {tokenizer_vocab} ids but model {cfg.name!r} only {args.vocab_size}; "
            f"set --model.vocab_size={-(-tokenizer_vocab // 64) * 64} or use a matching tokenizer."
        )
    if config.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len={config.training.seq_len} exceeds the max_seq_len {args.max_seq_len} of "
            f"model {cfg.name!r}; use --training.seq_len={args.max_seq_len} or less."
        )
    if attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(f"kernels.attention={attention_impl!r} is not known. Use auto, {', '.join(ATTENTION_IMPLS)}.")
    if norm_impl not in NORM_IMPLS:
        raise ConfigError(f"kernels.norm={norm_impl!r} is not known. Use auto, {', '.join(NORM_IMPLS)}.")
    if config.optimizer.qk_clip > 0:  # MuonClip needs each head's query and key rows declared
        check_clippable(args, f"optimizer.qk_clip={config.optimizer.qk_clip:g}")
    return args


def part_settings(config: Config) -> dict:
    """The user's settings the model's parts read ("section.field": value; models/parts apply_settings): the
    model section's and the moe section's fields, the experts' grouped GEMM and permutation backends and
    document masking."""
    settings = {f"model.{f.name}": getattr(config.model, f.name) for f in dataclasses.fields(config.model)}
    settings |= {f"moe.{f.name}": getattr(config.moe, f.name) for f in dataclasses.fields(config.moe)}
    return settings | {
        "kernels.grouped_gemm": config.kernels.grouped_gemm,
        "kernels.permutation": config.kernels.permutation,
        "data.document_mask": config.data.document_mask,
        # the ep degree: a per-rank capacity (moe.rank_capacity_factor) drops tokens per ep rank, in one process too
        "parallel.ep": config.parallel.ep,
    }


def check_whole_sequences(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse the layouts a part cannot train under (models/parts: an objective that needs whole sequences
    under cp, pp or tp); the planner asks the same question and never proposes them."""
    if refused := parts.layout_refusal(args, dims):
        raise ConfigError(refused)


def validate_training(config: Config, env: LaunchEnv) -> None:
    validate_config(config)  # a Config built in code has not been through load_config
    planned = config.job.world_size
    if planned and planned != env.world_size:
        raise ConfigError(
            f"job.world_size={planned} (the processes the layout is planned for) but the launcher started "
            f"{env.world_size}. Launch {planned} processes (torchrun --nproc-per-node / --nnodes, srun --ntasks), or "
            "give --job.world_size=0 and degrees for this world."
        )
    if env.world_size > 1 and config.training.dtype == "fp16":
        raise ConfigError(
            "training.dtype=fp16 (dynamic loss scaling) runs in one process only: the skipped-step "
            "decision is not agreed across ranks. Use --training.dtype=bf16 with parallel layouts."
        )
    if config.float8.enabled:  # the device first: on an A100 the answer is no whether torchao is there or not
        float8.check_device(env.device, config.float8.emulate)
        float8.require_torchao()
        check_experts(config.float8.experts, env.device, config.float8.emulate)
        float8_dispatch(config.float8.dispatch, True, config.float8.experts, config.parallel.ep)
        if not config.float8.emulate and not config.compile.enabled:
            log.info(
                "float8 without --compile.enabled=true: torchao's casts and scales run as separate kernels, which "
                "costs most of float8's speed-up (the published figures are compiled)"
            )


def float8_training(config: Config, fsdp: bool) -> float8.Float8Training | None:
    """float8.* as parallelize applies it (None: off); FSDP float8 all-gather only where FSDP shards."""
    f = config.float8
    return float8.resolve(f.recipe, f.emulate, f.fsdp_all_gather, fsdp, f.experts, f.dispatch) if f.enabled else None


def build_layout(config: Config, world_size: int, model_args: ModelArgs) -> Layout:
    """The run's one layout value (parallel/layout.py) from config.parallel, training, compile and float8 on
    `world_size` ranks, checked against the world (dp_shard=-1 resolved), the model, the batch and the pipeline
    schedule, in that order, before any work."""
    p, t, f = config.parallel, config.training, config.float8
    axes = {"pp": p.pp, "dp_replicate": p.dp_replicate, "cp": p.cp, "tp": p.tp}
    dp_shard = check_degrees(world_size, **axes, dp_shard=p.dp_shard)  # the world's degrees, before ep's
    etp, why = resolve_etp(p.etp, tp=p.tp, ep=p.ep, cp=p.cp, dp_shard=dp_shard)
    if p.ep > 1 and p.tp > 1:
        log.info("parallel.etp=%d: %s", etp, why)
    degrees = ParallelDims.of(world_size, **axes, dp_shard=dp_shard, ep=p.ep, etp=etp)  # no mesh: checked
    expert_dispatch = dispatch_layout(config, degrees, world_size)
    ParallelDims(dataclasses.replace(degrees.layout, **expert_dispatch), world_size).validate(model_args, t.seq_len)
    check_whole_sequences(model_args, degrees)
    dp_ranks = degrees.dp_size * config.fault_tolerance.groups  # fault-tolerant replica groups share each batch
    check_batch_split(t, dp_ranks)
    micro_batch_size, microbatches = batch_split(t, dp_ranks)
    experts_recomputed = degrees.ep > 1 and p.activation_checkpoint != "none"
    # schedule, stage sizes and micro-batches checked before any work (stage sizes without a pipeline refused)
    pp_schedule, virtual_stages = validate_pipeline(
        degrees.pp,
        p.pp_schedule,
        model_args.n_layers,
        microbatches,
        virtual=p.pp_virtual_stages,
        tie_embeddings=model_args.tie_embeddings,
        layers=StageLayers.from_config(p),
        compile=config.compile.enabled,
        experts_recomputed=experts_recomputed,
        output_end_reads=parts.ahead_modules(model_args)[0] > 0,  # multi-token prediction reads the embedding
    )
    gathers = f.enabled and float8.resolve(f.recipe, f.emulate, f.fsdp_all_gather, degrees.fsdp_enabled).fsdp_all_gather
    return Layout(
        **degrees_of(degrees.layout),
        dp_shard_mode=p.dp_shard_mode,
        pp_schedule=pp_schedule,
        virtual_stages=virtual_stages,
        micro_batch_size=micro_batch_size,
        microbatches=microbatches,
        activation_checkpoint=p.activation_checkpoint,
        compile=config.compile.enabled,
        float8=f.enabled,
        float8_all_gather=gathers,
        float8_experts=f.experts,
        float8_dispatch=f.dispatch,
        optimizer=config.optimizer.name,
        **expert_dispatch,
    )


def dispatch_layout(config: Config, degrees: ParallelDims, world_size: int) -> dict:
    """The expert dispatch's Layout fields: ranks per node (parallel.ranks_per_node, else the launcher's
    LOCAL_WORLD_SIZE, else job.hardware's node, else one node), the dispatch mode (auto resolved), the per-rank
    capacity and the overlap."""
    p = config.parallel
    ranks_per_node = p.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or hardware_node(config.job)
    ranks_per_node = ranks_per_node or world_size
    probe = ParallelDims(dataclasses.replace(degrees.layout, ranks_per_node=ranks_per_node), world_size)
    return {
        "ranks_per_node": ranks_per_node,
        "ep_dispatch": resolve_dispatch(p.ep_dispatch, probe.ep_nodes[0]),
        "ep_capacity": config.moe.rank_capacity_factor,
        "ep_overlap": p.ep_overlap,
    }


def hardware_node(job) -> int:
    """GPUs per node of job.hardware's profile (0: none given)."""
    if not job.hardware:
        return 0
    from trillion.parallel.planner.hardware import load_profile

    return load_profile(job.hardware).gpus_per_node


def check_batch_split(t: Training, dp_size: int) -> None:
    """Refuse a global batch that does not split into whole micro-batches over `dp_size` ranks (before batch_split)."""
    per_rank = t.global_batch_size // dp_size
    if t.global_batch_size % dp_size or per_rank % min(t.micro_batch_size, per_rank):
        fix = (
            f"--training.micro_batch_size={divisor_near(per_rank, t.micro_batch_size)}"
            if per_rank and t.global_batch_size % dp_size == 0
            else f"--training.global_batch_size={t.micro_batch_size * dp_size}"
        )
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} does not split into micro-batches of "
            f"training.micro_batch_size={t.micro_batch_size} over {dp_size} data-parallel ranks (dp_replicate x "
            f"dp_shard, x fault_tolerance.group_size with fault tolerance); each rank takes global / dp sequences. "
            f"Use e.g. {fix}."
        )


def build_parallel_dims(config: Config, env: LaunchEnv, model_args: ModelArgs) -> ParallelDims:
    """The run's layout (build_layout) on this world, with its mesh built."""
    dims = ParallelDims(build_layout(config, env.world_size, model_args), env.world_size)
    dims.build_mesh(env.device.type)
    return dims


def build_runner(
    config: Config,
    dims: ParallelDims,
    model_args: ModelArgs,
    n_microbatches: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Runner, Pipeline | None]:
    """(runner, its Pipeline or None): the model built on meta, parallelized (split into this rank's
    stages with pp > 1), then materialized on `device` with the seed's weights (the same values
    whatever the layout)."""
    with torch.device("meta"):
        model = Transformer(model_args)
    if config.optimizer.qk_clip > 0 and (unmeasured := install_probes(model)):  # MuonClip: per-head max logits
        raise ConfigError(
            f"optimizer.qk_clip={config.optimizer.qk_clip:g}: the attention modules {', '.join(unmeasured[:3])} run no "
            "`attend` callable (models/attention.py's seam) through which their logits could be measured. Use "
            "--optimizer.qk_clip=0 with this model, or give its attention kind an `attend`."
        )
    modules, pipeline = build_model(config, dims, model, n_microbatches, device, dtype)
    for part in modules:
        part.to_empty(device=device)
        part.init_weights(config.job.seed)
    if pipeline is not None:
        pipeline.build()
        return pipeline, pipeline
    # the look-ahead (multi-token prediction) depths and loss weight: 0 for a model without them (models/parts/mtp.py)
    depths, weight = parts.ahead_modules(model_args)[0], model_args.mtp_loss_weight
    paired = pairs_micro_batches(dims.layout, dims.fsdp_enabled)  # two micro-batches in flight (ep_overlap)
    return MicroBatchLoop(modules[0], dims.tp_enabled, config.parallel.dp_shard_mode, weight, depths, paired), None


def layout_fn(
    config: Config, dims: ParallelDims, dtype: torch.dtype, *, compile: bool | None = None, fsdp: bool = True
):
    """parallelize with the config's layout, as a function of the model or a pipeline stage; `fsdp=False`
    leaves FSDP2 out (the estimate's activation run: it changes no activation)."""
    p = config.parallel
    return lambda part: parallelize(
        part,
        dims,
        dp_shard_mode=p.dp_shard_mode,
        activation_checkpoint=p.activation_checkpoint,
        compile=config.compile.enabled if compile is None else compile,
        param_dtype=dtype,
        pp_schedule=p.pp_schedule,
        float8=float8_training(config, fsdp and dims.fsdp_enabled),
        fsdp=fsdp,
    )


def build_model(
    config: Config,
    dims: ParallelDims,
    model: nn.Module,
    n_microbatches: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    compile: bool | None = None,
) -> tuple[list[nn.Module], Pipeline | None]:
    """(this rank's parallelized parts, its Pipeline or None) from the whole `model` on meta: the model
    itself, or with pp > 1 this rank's stages (names stay global) under the configured schedule."""
    layout = layout_fn(config, dims, dtype, compile=compile)
    if dims.pp == 1:
        return [layout(model)], None
    pipeline = Pipeline(
        model,
        dims,
        config.parallel.pp_schedule,
        n_microbatches,
        device,
        virtual=config.parallel.pp_virtual_stages,
        parallelize_fn=layout,
        layers=StageLayers.from_config(config.parallel),
    )
    return pipeline.parts, pipeline
