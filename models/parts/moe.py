"""The mixture-of-experts feed-forward (models/moe.py MoE), declared: a router (replicated over tp), E routed
SwiGLU experts as three stacks (split over ep; w1 and w3 column-wise, w2 row-wise where expert tensor parallelism
splits them), and shared experts every token passes (an MLP of n_shared_experts x expert_ffn_dim, column/row-wise
over tp). How tensor parallelism lays it out is the layout's choice (parallel.etp: the ROUTED style)."""

import dataclasses
import math
from dataclasses import dataclass

from trillion.errors import ConfigError
from trillion.models.args import ModelArgs
from trillion.models.parts import mlp
from trillion.models.parts.spec import COLUMN, REPLICATED, ROUTED, ROW, ExpertStack, Linear, Part, Routing
from trillion.models.presets import expert_presets

# Kernel launches an MoE layer adds besides its GEMMs, counted from models/moe.py (MoE.forward and
# Router.forward, one per aten op: the router's 9, the sort, bincount, cumsum and gathers, silu and the
# products, the scatter back, the weighting and sum, the load tally's 4 adds)
MOE_KERNELS = 26
# Group-limited routing's launches beyond MOE_KERNELS (Router.forward with n_groups > 1): the per-group top-2, its
# sum, the top groups, the mask's scatter and negation, the masked fill
GROUP_ROUTING_KERNELS = 6
COUNTS = ("n_experts", "top_k")  # MoESettings' counts, each applied when given (> 0)
BALANCING = ("aux_loss_coef", "seq_aux_loss_coef", "bias_update_rate", "capacity_factor")  # applied when >= 0


@dataclass(frozen=True)
class MoESettings:
    """The user's settings of the mixture of experts: its counts (model.n_experts, top_k; 0 keeps the preset's),
    its balancing (the moe section's coefficients; -1 keeps the preset's), the experts' kernels (kernels.grouped_gemm,
    kernels.permutation) and the per-rank capacity (moe.rank_capacity_factor, 0: dropless) over `capacity_ranks`,
    the expert-parallel degree: one process drops the tokens each ep rank would."""

    n_experts: int = 0
    top_k: int = 0
    aux_loss_coef: float = -1.0
    seq_aux_loss_coef: float = -1.0
    bias_update_rate: float = -1.0
    capacity_factor: float = -1.0
    experts_impl: str = "auto"
    permute_impl: str = "auto"
    rank_capacity_factor: float = 0.0
    capacity_ranks: int = 1


def reach_share(n_experts: int, top_k: int, held: int) -> float:
    """The chance that a token's top_k distinct experts, drawn evenly from n_experts, include one of `held` ones: the
    share of tokens a rank (or node) holding them receives under even routing."""
    return 1 - math.comb(n_experts - held, top_k) / math.comb(n_experts, top_k)


def member_reach(routing, held: int) -> float:
    """The chance that a token reaches a member (an ep rank, or a node of them) holding `held` consecutive experts
    of a Routing declaration. Group-limited routing (topk_groups of n_groups, DeepSeek-V3), the member inside a group:
    its group chosen, times its experts among the top_k / topk_groups the token takes in each chosen group (the
    router chooses groups by their best two, which spreads the choices over them: at DeepSeek-V3's shape this gives
    the per-rank dispatch's counted rows within 1%, experiments/bench/ep_dispatch.py); the member holding whole
    groups: one of its groups chosen; otherwise top_k drawn evenly."""
    experts, groups, chosen = routing.n_experts, routing.groups, routing.groups_chosen
    group = experts // groups
    if groups > 1 and group % held == 0:
        return chosen / groups * reach_share(group, max(1, round(routing.top_k / chosen)), held)
    if groups > 1 and held % group == 0:
        return 1 - math.comb(groups - held // group, chosen) / math.comb(groups, chosen)
    return reach_share(experts, routing.top_k, held)


def router_elements(moe) -> int:
    """Elements per token the router reads and writes besides its GEMM: softmax or sigmoid and top-k 3 E (read
    scores, write them, read for top-k), the loss-free bias 2 E (the add) and DeepSeek-V3's group-limited choice
    3 E (the per-group top-2 reads the scores, the mask of the other groups reads and writes them)."""
    bias = 2 if moe.bias_update_rate > 0 else 0
    groups = 3 if moe.n_groups > 1 else 0
    return (3 + bias + groups) * moe.n_experts


def declare(args: ModelArgs) -> Part:
    moe, h = args.moe, args.dim
    f, e = moe.expert_ffn_dim, moe.n_experts
    shared = mlp.declare(args, moe.n_shared_experts * f, prefix="feed_forward.shared_experts")
    stacks = (("w1", h, f, COLUMN), ("w3", h, f, COLUMN), ("w2", f, h, ROW))
    kernels = MOE_KERNELS + (GROUP_ROUTING_KERNELS if moe.n_groups > 1 else 0)
    return Part(
        module="feed_forward",
        linears=shared.linears,
        experts=tuple(ExpertStack(f"feed_forward.experts.{name}", e, i, o, split) for name, i, o, split in stacks),
        routing=Routing(
            Linear("feed_forward.router.gate", h, e, REPLICATED),
            e,
            moe.top_k,
            router_elements(moe),
            kernels,
            moe.n_groups,
            moe.topk_groups,
        ),
        saved=shared.saved,
        recomputed=shared.recomputed,  # the shared experts' SwiGLU under DeepSeek's recompute mode
        eager=shared.eager,
        compiled=shared.compiled,
        tp_style=ROUTED,
    )


def apply_settings(args: ModelArgs, settings: MoESettings, model_name: str) -> ModelArgs:
    """The preset's MoE block with the user's counts, balancing, kernels and per-rank capacity, checked (dense
    presets take none)."""
    overrides = {k: v for k in COUNTS if (v := getattr(settings, k)) > 0}
    overrides |= {k: v for k in BALANCING if (v := getattr(settings, k)) >= 0}
    if args.moe is None:
        if overrides:
            routed = ", ".join(expert_presets())
            raise ConfigError(
                f"{', '.join(sorted(overrides))} set, but model.name={model_name!r} is dense (no "
                f"experts). Use an MoE preset ({routed}) or drop the settings."
            )
        return args
    impls = {"experts_impl": settings.experts_impl, "permute_impl": settings.permute_impl}
    per_rank = {"rank_capacity_factor": settings.rank_capacity_factor}
    if settings.rank_capacity_factor > 0:  # the ranks whose capacity one process applies too
        per_rank["capacity_ranks"] = settings.capacity_ranks
    routing = dataclasses.replace(args.moe, **impls, **overrides, **per_rank)
    if routing.top_k > routing.n_experts:
        raise ConfigError(
            f"model.top_k={routing.top_k} is more than the model's {routing.n_experts} experts: each token picks "
            f"top_k distinct experts. Use --model.top_k={routing.n_experts} or less."
        )
    group_size = routing.n_experts // routing.n_groups
    if routing.n_experts % routing.n_groups or routing.topk_groups * group_size < routing.top_k:
        given = " and ".join(f"model.{k}={overrides[k]}" for k in COUNTS if k in overrides)
        raise ConfigError(
            f"{given}: the preset's {routing.n_groups} routing groups must split the {routing.n_experts} experts "
            f"evenly, and each token's top_k={routing.top_k} choices come from {routing.topk_groups} of them "
            f"({routing.topk_groups} x {group_size} experts at most). Keep model.n_experts a multiple of "
            f"{routing.n_groups} and model.top_k at most {routing.topk_groups} groups' experts."
        )
    return dataclasses.replace(args, moe=routing)
