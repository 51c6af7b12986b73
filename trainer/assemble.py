"""Assembling a run, in one place for `trillion train` and `trillion estimate`: the parallel layout resolved
from the config (`resolve_layout`, the one place a layout setting is read), the model's arguments with the parts'
settings (`part_settings`, likewise for theirs), the checks made before any work, ParallelDims (built once) and the
model itself: the whole model or this rank's pipeline stages, each parallelized, on the meta device. train.py
materializes it and runs the loop; the estimate measures it as simulated ranks of a fake world."""

import dataclasses
import logging
import os

import torch
from torch import nn

from trillion.errors import ConfigError
from trillion.kernels import ATTENTION_IMPLS, NORM_IMPLS
from trillion.models import ModelArgs, Transformer, get_preset, parts
from trillion.models.flops import unit_flops_per_token
from trillion.models.logit_probe import install_probes
from trillion.models.parts import AttentionSettings, PartSettings
from trillion.models.parts import apply_settings as apply_part_settings
from trillion.models.parts.moe import MoESettings
from trillion.models.parts.mtp import MTPSettings
from trillion.parallel import async_tp, float8, float8_mx
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.ep_checks import ep_nodes, resolve_dispatch, resolve_pairing_phase
from trillion.parallel.float8_experts import check_experts
from trillion.parallel.float8_recipes import check_block_scaled_layout, float8_dispatch, float8_recipe
from trillion.parallel.forward_backward import MicroBatchLoop, Runner
from trillion.parallel.layout import Layout, StageLayers, check_degrees, resolve_etp, resolve_float8
from trillion.parallel.modes import check_schedule, checkpoint_refusal, pairs_across_stages, pairs_in_a_v
from trillion.parallel.muon.qk_clip import check_clippable
from trillion.parallel.parallelize import parallelize
from trillion.parallel.pipeline import Pipeline, validate_pipeline
from trillion.parallel.pp_layout import resolve_auto, stage_ranks
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


def build_model_args(config: Config, tokenizer_vocab: int, layout: Layout) -> ModelArgs:
    """The preset with the config's overrides, checked against the tokenizer and sequence length; `layout` the run's
    (the norm kernels' auto and the experts' per-rank capacity follow its tp and ep)."""
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
        config.kernels.norm if config.kernels.norm != "auto" else ("triton" if on_gpu and layout.tp == 1 else "torch")
    )
    args = dataclasses.replace(get_preset(cfg.name), attention_impl=attention_impl, norm_impl=norm_impl, **overrides)
    args = apply_part_settings(args, part_settings(config, layout))
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


def part_settings(config: Config, layout: Layout) -> PartSettings:
    """The user's settings the model's parts apply (models/parts apply_settings): the model and moe sections' counts
    and balancing, the experts' kernels, the per-rank capacity over the layout's ep ranks (one process drops what
    each ep rank would), multi-token prediction and document masking."""
    m, moe, k = config.model, config.moe, config.kernels
    return PartSettings(
        model_name=m.name,
        attention=AttentionSettings(document_mask=config.data.document_mask, n_kv_heads=m.n_kv_heads),
        moe=MoESettings(
            n_experts=m.n_experts,
            top_k=m.top_k,
            aux_loss_coef=moe.aux_loss_coef,
            seq_aux_loss_coef=moe.seq_aux_loss_coef,
            bias_update_rate=moe.bias_update_rate,
            capacity_factor=moe.capacity_factor,
            experts_impl=k.grouped_gemm,
            permute_impl=k.permutation,
            rank_capacity_factor=layout.ep_capacity,
            capacity_ranks=layout.ep,
        ),
        mtp=MTPSettings(modules=m.mtp_modules, loss_weight=m.mtp_loss_weight),
    )


def check_model_layout(layout: Layout, model_args: ModelArgs, seq_len: int) -> None:
    """Refuse, before any work, a layout this model cannot train under: its degrees against the model's shape and
    the sequence (parallel/dims.py check_layout), what a part refuses (models/parts layout_refusal: an objective
    that needs whole sequences under cp, pp or tp; the planner asks the same and never proposes them), the
    activation checkpointing's (a recompute mode the model has no parts for), and the pipeline's schedule and stages
    against its layers."""
    check_layout(layout, model_args, seq_len)
    if refused := parts.layout_refusal(model_args, layout) or checkpoint_refusal(
        layout.activation_checkpoint, model_args
    ):
        raise ConfigError(refused)
    validate_pipeline(
        layout,
        model_args.n_layers,
        tie_embeddings=model_args.tie_embeddings,
        ahead_modules=parts.ahead_modules(model_args)[0],  # pp_layout's M
    )


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


def check_float8(layout: Layout, device: torch.device) -> None:
    """Refuse the layout's float8 where it cannot run on `device`, before any work: the device first (on an A100
    the answer is no whether torchao is there or not; a block-scaled recipe needs Blackwell), then torchao, then
    the routed experts' recipe."""
    f8 = layout.float8
    if f8 is None:
        return
    if float8_recipe(f8.recipe).block:  # torchao's MX training kernels
        float8_mx.check_device(device, f8.emulate)
    else:
        float8.check_device(device, f8.emulate)
    float8.require_torchao()
    check_experts(f8.experts, device, f8.emulate, f8.cache_activations)
    if not f8.emulate and not layout.compile:
        log.info(
            "float8 without --compile.enabled=true: torchao's casts and scales run as separate kernels, which "
            "costs most of float8's speed-up (the published figures are compiled)"
        )


def check_async_tp(layout: Layout, device: torch.device) -> None:
    """Refuse the layout's async TP where `device` has no symmetric memory (parallel/async_tp.py), before any work;
    what it needs of the layout itself is check_model_layout's (parallel/tp_checks.py)."""
    if layout.async_tp:
        async_tp.check_device(device)


def resolve_layout(config: Config, world_size: int, hardware_node: int = 0) -> Layout:
    """The run's one Layout on `world_size` ranks: the one place every layout setting is read from the config
    (parallel, training's batch split, compile, float8, moe.rank_capacity_factor) and resolved, checked as it goes
    (before any work): the degrees against the world (dp_shard=-1: what it leaves), the ranks per node
    (parallel.ranks_per_node, else the launcher's LOCAL_WORLD_SIZE, else `hardware_node`, the planned hardware's
    scale-up domain for `trillion estimate`, else one node), the expert dispatch (auto), the micro-batches, the
    pipeline schedule's stages per rank and float8 (its FSDP all-gather only where FSDP shards; a block-scaled
    recipe's limits). What the model must agree with is check_model_layout's."""
    p, t, f = config.parallel, config.training, config.float8
    degrees = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp, "tp": p.tp}
    degrees["dp_shard"] = check_degrees(world_size, **degrees)  # the world's degrees, before ep's
    etp, why = resolve_etp(p.etp, tp=p.tp, ep=p.ep, cp=p.cp, dp_shard=degrees["dp_shard"])
    if p.ep > 1 and p.tp > 1:
        log.info("parallel.etp=%d: %s", etp, why)
    degrees |= {"ep": p.ep, "etp": etp}
    check_degrees(world_size, **degrees)  # ep in the ranks etp lets it borrow
    ranks_per_node = p.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or hardware_node or world_size
    spread = Layout(**degrees, ranks_per_node=ranks_per_node)
    dp_ranks = spread.dp * config.fault_tolerance.groups  # fault-tolerant replica groups share each batch
    check_batch_split(t, dp_ranks)
    micro_batch_size, microbatches = batch_split(t, dp_ranks)
    schedule, virtual_stages = check_schedule(
        p.pp_schedule, p.pp, microbatches, p.pp_virtual_stages, config.compile.enabled
    )
    float8_training = None
    if f.enabled:  # the FSDP float8 all-gather only where FSDP shards
        float8_dispatch(f.dispatch, True, f.experts, p.ep)
        if float8_recipe(f.recipe).block:  # torchao's MX linear: no TP, whole 32-token blocks
            check_block_scaled_layout(p.tp if f.linears else 1, micro_batch_size * t.seq_len // p.cp)
        float8_training = resolve_float8(
            f.recipe,
            fsdp_enabled=spread.fsdp_enabled,
            fsdp_all_gather=f.fsdp_all_gather,
            emulate=f.emulate,
            experts=f.experts,
            dispatch=f.dispatch,
            linears=f.linears,
            cache_activations=f.cache_activations,
            combine_gradient=f.combine_gradient,
        )
    return dataclasses.replace(
        spread,
        dp_shard_mode=p.dp_shard_mode,
        pp_schedule=schedule.name,
        virtual_stages=virtual_stages,
        stage_layers=StageLayers(
            p.pp_layers_per_stage, p.pp_first_stage_layers, p.pp_last_stage_layers, written=p.pp_layout
        ),
        micro_batch_size=micro_batch_size,
        microbatches=microbatches,
        activation_checkpoint=p.activation_checkpoint,
        compile=config.compile.enabled,
        float8=float8_training,
        ep_dispatch=resolve_dispatch(p.ep_dispatch, ep_nodes(spread)[0]),
        ep_capacity=config.moe.rank_capacity_factor,
        ep_overlap=p.ep_overlap,
        ep_pairing_phase=p.ep_pairing_phase,  # auto (-1) once the model is known: resolve_with_model
        defer_weight_grads=p.defer_weight_grads,
        tp_overlap=p.tp_overlap,
        async_tp=p.async_tp,
    )


def resolve_with_model(layout: Layout, model_args: ModelArgs, seq_len: int) -> Layout:
    """`layout` with what waits for the model resolved, once: the stages (resolve_stage_split) and
    parallel.ep_pairing_phase=auto (ep_checks.resolve_pairing_phase: the attention's FLOPs against the shared
    experts')."""
    layout = resolve_stage_split(layout, model_args, seq_len)
    phase = resolve_pairing_phase(layout, layout.ep_pairing_phase, model_args, seq_len)
    if layout.ep_pairing_phase < 0 and pairs_across_stages(layout):
        log.info("parallel.ep_pairing_phase=auto: %d (parallel.ep_dispatch=%s)", phase, layout.ep_dispatch)
    return dataclasses.replace(layout, ep_pairing_phase=phase)


def resolve_stage_split(layout: Layout, model_args: ModelArgs, seq_len: int) -> Layout:
    """`layout` with parallel.pp_layout=auto written out once the model is known: the split whose busiest pipeline
    rank is least busy by each unit's forward and backward FLOPs (models/flops.py; parallel/pp_layout.py balance, or
    balance_paired under DualPipeV's pairing)."""
    if layout.pp == 1:
        return layout
    stages = resolve_auto(
        layout.stage_layers,
        model_args.n_layers,
        unit_flops_per_token(model_args, seq_len),
        stage_ranks(layout.pp, layout.virtual_stages, layout.pp_schedule),
        parts.ahead_modules(model_args)[0],
        paired=pairs_in_a_v(layout),
    )
    return dataclasses.replace(layout, stage_layers=stages)


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


def build_parallel_dims(layout: Layout, model_args: ModelArgs, seq_len: int, env: LaunchEnv) -> ParallelDims:
    """The run's ParallelDims, built once: `layout` checked against the model (check_model_layout), its stage split
    and pairing phase resolved (resolve_with_model), then its mesh over this world."""
    check_model_layout(layout, model_args, seq_len)
    dims = ParallelDims(resolve_with_model(layout, model_args, seq_len), env.world_size)
    dims.build_mesh(env.device.type)
    return dims


def build_runner(
    config: Config, dims: ParallelDims, model_args: ModelArgs, device: torch.device, dtype: torch.dtype
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
    modules, pipeline = build_model(dims, model, device, dtype)
    for part in modules:
        part.to_empty(device=device)
        part.init_weights(config.job.seed)
    if pipeline is not None:
        pipeline.build()
        return pipeline, pipeline
    # the look-ahead (multi-token prediction) depths and loss weight: 0 for a model without them (models/parts/mtp.py)
    depths, weight = parts.ahead_modules(model_args)[0], model_args.mtp_loss_weight
    return MicroBatchLoop(modules[0], dims.layout, weight, depths), None


def layout_fn(dims: ParallelDims, dtype: torch.dtype, *, fsdp: bool = True):
    """parallelize with `dims`' layout, as a function of the model or a pipeline stage; `fsdp=False` leaves FSDP2
    out (the estimate's activation run: it changes no activation)."""
    return lambda part: parallelize(part, dims, param_dtype=dtype, fsdp=fsdp)


def build_model(
    dims: ParallelDims, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> tuple[list[nn.Module], Pipeline | None]:
    """(this rank's parallelized parts, its Pipeline or None) from the whole `model` on meta: the model
    itself, or with pp > 1 this rank's stages (names stay global) under the layout's schedule."""
    layout = layout_fn(dims, dtype)
    if dims.pp == 1:
        return [layout(model)], None
    pipeline = Pipeline(model, dims, device, parallelize_fn=layout)
    return pipeline.parts, pipeline
