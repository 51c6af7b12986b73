"""Step time of a layout on a machine: compute, pipeline bubble and imbalance, and the exposed
part of TP, PP and DP communication, and the optimizer step.

Compute per layer per micro-batch: each GEMM at the device's large-GEMM efficiency or, if slower,
at the memory bandwidth its operands need (the roofline), flash attention (causal: half of the
4 b s^2 h the FLOP formulas count, at the heads' own widths, which the kernels run unpadded for 64, 128 and
latent attention's 192/128; under document masking the share of it the corpus's document lengths leave,
assumptions.attention_share) at the device's attention efficiency, the element-wise
kernels work.py counts (eager or compiled) at the device's memory bandwidth, and a launch
overhead per kernel. GEMMs and attention keep the device's `sustained` share of those microbenchmark rates
through a step (devices.py; fitted per device family in trillion/fitted.toml where published runs show the gap,
1 elsewhere). Backward GEMMs split into the input gradient (Bi) and the weight gradient (Bw), which is what
zero-bubble schedules move around.

Communication (ring collectives, 2(n-1)/n of the bytes per all-reduce, half that for an
all-gather or reduce-scatter, on the slowest link the group spans, across nodes over as many NICs as the group
has ranks in a node (timing.collective_time); the mesh puts tp innermost, then dp_shard, dp_replicate, pp, as the
trainer's DeviceMesh does):
  TP: sequence-parallel, as parallel/tensor_parallel.py: per layer 2 all-gathers and 2
      reduce-scatters of the activation forward, as many backward, again when recomputing; the
      output an all-gather forward and a reduce-scatter backward, and loss parallelism 3
      all-reduces of one fp32 number per token; the replicated parameters' (norms') gradients
      one all-reduce per step without FSDP (parallel.tensor_parallel.reduce_partial_grads). Never
      overlapped (DTensor TP runs them on the compute stream). Each kind at the figures a
      calibrated profile measured for it (TP's collectives as the trainer issues them: DTensor
      redistributions), else at the all-reduce's. Plus DTensor's host work per block beyond its
      collectives, where a CPU's calibrated profile measured it (a fixed cost per op; on a GPU the
      host runs ahead of the kernels and GPU profiles leave it 0).
  PP: one activation per micro-batch per stage boundary; in steady state the sends overlap the
      next micro-batch, so only the fill and drain (2 (p v - 1) transfers) are exposed.
  Overlap needs something besides the compute units to move the bytes (a GPU's copy engines and
  NICs). On a CPU gloo's transfers run on the cores that compute, so a CPU's calibrated profile
  says `overlaps_collectives = false` and every PP and DP collective is charged in full.
  DP: per ZeRO mode (memory.py's docstring); collectives run on their own streams and FSDP2
      prefetches one block ahead, so they hide behind compute as long as it lasts, except the
      first all-gather and last reduce-scatter of each chunk of each micro-batch; per-step
      collectives hide behind one micro-batch's backward. FSDP2's copies into and out of the
      collective buffers are memory passes on the compute stream (work.py). FSDP's group is dp_shard x cp.
  CP: each rank computes s / cp tokens against the whole sequence (load-balanced causal attention:
      1/cp of its FLOPs); per layer an all-gather of K and V forward (again when recomputing) and a
      reduce-scatter of their gradients backward, on the cp group's links (cp sits just outside tp
      in the mesh), never overlapped (parallel/context_parallel.py gathers before attention).
  EP: an MoE layer (moe.py) is its attention and shared experts as a dense block, plus the router, the
      routed experts at their per-expert shapes and the dispatch and combine all-to-alls, forward and
      backward, never overlapped; with ep > 1 the experts' FSDP traffic runs over the efsdp ranks (Layout.efsdp).
Optimizer: AdamW and gradient clipping on the rank's shard, at memory bandwidth (work.py); with Muon
(assumptions.optimizer) also its Newton-Schulz on the stage's matrices spread over its ranks and its two all-to-alls,
unhidden (optimizer.py).

Float8 (layout.float8, `trillion plan --float8`; tensorwise scaling, as the trainer's default recipe and
torchao's Float8Linear): every linear of the blocks whose features on a TP rank are multiples of 16
(memory.tp_local_linears) runs its three GEMMs (output, input gradient, weight gradient) at the device's
dense fp8 peak times its fp8 large-GEMM plateau (devices.toml peak_tflops.fp8, fp8_gemm_efficiency), or
at the bandwidth its fp8 operands and bf16 output need if slower; the output projection and attention
stay bf16. Its casts are element-wise traffic at memory bandwidth, one launch each (work.py
FLOAT8_CAST_BYTES: the forward casts input and weight, Bi the output's gradient and the weight, Bw the
saved input). Under TP, torchao's float8 styles all-gather a converted sublayer's input and its output's
gradient in float8 (tp_gather_bytes); the reduce-scatters stay bf16.
With FSDP's float8 all-gather (layout.float8.fsdp_all_gather) the converted weights are gathered at 1 byte
instead of 2, and FSDP's copy out of the gather buffer moves 1-byte elements; gradients stay fp32.
Memory is not changed by float8 (the saved activations stay bf16; the gathered fp8 copies are not counted).

Other recipes (layout.float8.recipe, `--float8-recipe`; parallel/float8_recipes.py FLOAT8_RECIPES): the GEMMs run at the
recipe's format's peak and plateau (fp8; MXFP8, NVFP4 and MXFP4: peak_tflops.<format>, <format>_gemm_efficiency), a
block-scaled format's operands at its element bytes plus a scale per block (MXFP8: 1 + 1/32 bytes, NVFP4: 0.5 +
1/16), its casts likewise (work.cast_bytes), and recipes that quantise each dim apart (rowwise, MX) cast the weight
gradient's operands along the tokens again. Only tensorwise has torchao's float8 FSDP all-gather and TP styles: the
others gather in bf16, as torchao and torchtitan run them ("all distributed communication for MXFP8 training is
currently done in high precision", torchtitan's mxfp8.md). A linear converts where its local dims are multiples of
the recipe's dim_multiple (16; 32 for MX; 128 for NVFP4's kernels). A 4-bit recipe keeps its high_precision_tail of
the last blocks (and the MTP modules after them) in bf16. The routed experts follow a block-scaled linear recipe
(moe.py). Memory is priced as bf16's for every recipe: torchao's NVFP4 keeps its linears' saved inputs in FP4 codes
and scales, which this overstates.
"""

import dataclasses
import math
from dataclasses import dataclass, fields
from functools import lru_cache

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.parallel import modes
from trillion.parallel.float8_recipes import FLOAT8_RECIPES
from trillion.parallel.layout import Layout
from trillion.parallel.planner.assumptions import Assumptions
from trillion.parallel.planner.block_cost import block_passes, output_passes
from trillion.parallel.planner.deferred_weights import deferred_share, defers
from trillion.parallel.planner.hardware import HardwareProfile
from trillion.parallel.planner.memory import (
    RankParams,
    float8_numel,
    layers_from,
    pipeline_ranks,
    replicated_numel,
)
from trillion.parallel.planner.moe import expert_numel
from trillion.parallel.planner.optimizer import step_seconds as optimizer_step_seconds
from trillion.parallel.planner.schedules import bubble_slots
from trillion.parallel.planner.timing import (  # noqa: F401 (collective_time, Passes: the planner's names here)
    Passes,
    _gemm,
    _memory_bound,
    all_to_all_time,
    collective_time,
    float8_casts,
)
from trillion.parallel.planner.work import (
    FLOAT8_BYTES,
    FSDP_FLOAT8_GATHER_COPY_BYTES,
    FSDP_GATHER_COPY_BYTES,
    FSDP_REDUCE_COPY_BYTES,
)


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    imbalance: float
    tp_exposed: float
    pp_exposed: float
    dp_exposed: float
    optimizer: float
    cp_exposed: float = 0.0
    ep_exposed: float = 0.0  # expert parallelism's all-to-alls (moe.py)

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def shares(self) -> dict:
        return {f.name: getattr(self, f.name) / self.total for f in fields(self)}


@lru_cache(maxsize=65536)
def rank_passes(
    args: ModelArgs,
    hw: HardwareProfile,
    layout: Layout,
    seq_len: int,
    assumed: Assumptions,
    rank: RankParams,
    tail: int = 0,
) -> tuple[Passes, Passes]:
    """(passes of one micro-batch through all of the rank's layers and MTP modules, the recomputed forwards);
    `layout` is a pipeline_part (its data-parallel settings play no part, so the cache holds fewer entries); `tail`:
    the rank's layers its 4-bit recipe keeps in bf16 (the last layers', of the kind of the model's last layer)."""
    tail_routed = parts.routed_layer(args, args.n_layers - 1)
    kinds = [  # (layers, routed, kept in bf16)
        (rank.layers - rank.routed_layers - (0 if tail_routed else tail), False, False),
        (rank.routed_layers - (tail if tail_routed else 0), True, False),
        (tail, tail_routed, True),
    ]
    total = forward_sum = Passes()
    for count, routed, high_precision in kinds:
        if count:
            layer = block_passes(args, hw, layout, seq_len, assumed, routed=routed, high_precision=high_precision)
            total, forward_sum = total + layer * count, forward_sum + layer * count
    tokens, tp = layout.micro_batch_size * seq_len // layout.cp, layout.tp
    if rank.last:
        total = total + output_passes(args, hw, tokens, tp)
    if rank.ahead_modules:
        total = total + ahead_module_passes(args, hw, layout, seq_len, assumed) * rank.ahead_modules
    if modes.checkpoint_mode(layout.activation_checkpoint).sublayers:  # DeepSeek's: the up-projections again
        return total, Passes(forward=up_projection_seconds(args, hw, layout, seq_len) * rank.layers)
    mean = forward_sum * (1 / max(rank.layers, 1))  # a recomputed layer: the mean of the rank's layers
    recompute = Passes(  # its all-to-alls without the counts (the route is replayed)
        forward=mean.forward - mean.ep_forward + mean.ep_recompute,
        tp_forward=mean.tp_forward,
        cp_forward=mean.cp_forward,
        ep_forward=mean.ep_recompute,
    )
    return total, recompute * rank.checkpointed(layout.activation_checkpoint)


def up_projection_seconds(args: ModelArgs, hw: HardwareProfile, layout: Layout, seq_len: int) -> float:
    """One layer's recompute under DeepSeek's mode: the GEMMs of the up-projections its attention declares (models/parts
    Part.up_projections) at their tp split. Its element-wise recompute (the norms, rotary, SwiGLU's silu and product)
    is left out: memory passes over a few of the layer's activations, beside the up-projections' GEMMs."""
    tokens, tp = layout.micro_batch_size * seq_len // layout.cp, layout.tp
    linears = [x for part in parts.block(args).parts for x in part.linears if x.name in part.up_projections]
    return sum(_gemm(hw, tokens, x.in_features, x.out_features // (tp if x.tp_dim == 0 else 1)) for x in linears)


def ahead_module_passes(args: ModelArgs, hw: HardwareProfile, layout: Layout, seq_len: int, assumed) -> Passes:
    """One multi-token prediction module (models/parts/mtp.py): a block, its projection (whole on every tp rank), the
    output head again."""
    tokens, (_, ahead) = layout.micro_batch_size * seq_len // layout.cp, parts.ahead_modules(args)
    projection = sum(_gemm(hw, tokens, x.in_features, x.out_features) for x in ahead.linears)
    after_tail = bool(high_precision_tail(args, layout))  # a 4-bit recipe's bf16 tail holds what follows it
    routed = parts.routed_layer(args, args.n_layers)
    module = block_passes(args, hw, layout, seq_len, assumed, routed=routed, high_precision=after_tail)
    return module + output_passes(args, hw, tokens, layout.tp) + Passes(projection, projection, projection)


def high_precision_tail(args: ModelArgs, layout: Layout) -> int:
    """The last layers the layout's low-precision recipe keeps in bf16 (a 4-bit recipe's tail, rounded up as
    torchtitan's nvfp4_bf16_tail_fqns: 5 of Llama 3 8B's 32), 0 for the others."""
    if layout.float8 is None or not layout.float8.linears:
        return 0
    return math.ceil(args.n_layers * FLOAT8_RECIPES[layout.float8.recipe].high_precision_tail - 1e-9)


def float8_gathered(args: ModelArgs, layout: Layout, rank: RankParams) -> int:
    """Elements FSDP all-gathers in float8 on this rank (0 without float8 or its all-gather: tensorwise only, as
    resolve_float8 resolves it)."""
    if layout.float8 is None or not layout.float8.fsdp_all_gather:
        return 0
    return float8_numel(args, rank.layers, layout.tp, rank.routed_layers)


def fsdp_copies(hw: HardwareProfile, layout: Layout, tp_numel: int, fp8_numel: int = 0) -> float:
    """Seconds per step of FSDP2's copies out of all-gather and into reduce-scatter buffers; `fp8_numel`
    of the gathered elements arrive in float8."""
    if layout.dp_shard * layout.cp <= 1:
        return 0.0
    gather = FSDP_GATHER_COPY_BYTES * (tp_numel - fp8_numel) + FSDP_FLOAT8_GATHER_COPY_BYTES * fp8_numel
    reduce = FSDP_REDUCE_COPY_BYTES * tp_numel
    per_microbatch = {"zero3": 2 * gather + reduce, "zero2": reduce, "zero1": 0}[layout.dp_shard_mode]
    per_step = {"zero3": 0, "zero2": gather, "zero1": gather + reduce}[layout.dp_shard_mode]
    return _memory_bound(hw, layout.microbatches * per_microbatch + per_step)


def dp_comm(args: ModelArgs, hw: HardwareProfile, layout: Layout, rank: RankParams) -> tuple[float, float, float]:
    """(seconds per micro-batch, per-step seconds hidden by a backward, by a forward) of data parallelism."""
    d, r, tp, ep, etp = layout.dp_shard * layout.cp, layout.dp_replicate, layout.tp, layout.ep, layout.expert_tp
    tp_numel, shard_numel = rank.numel(args, tp, d, ep, etp)
    # with ep > 1 the routed experts' FSDP group is the efsdp ranks outside the ep group (moe.py), spanning d x tp
    experts = expert_numel(args, rank.routed_layers, etp, ep, layout.efsdp)[0] if ep > 1 else 0
    mode = layout.dp_shard_mode
    fp8 = float8_gathered(args, layout, rank)  # gathered at 1 byte instead of element_bytes
    gathered_bytes = hw.element_bytes * (tp_numel - experts - fp8) + FLOAT8_BYTES * fp8
    gather = collective_time(hw, gathered_bytes, d, tp * d, "all_gather")
    reduce = collective_time(hw, 4 * (tp_numel - experts), d, tp * d, "reduce_scatter")
    if experts:
        gather += collective_time(hw, hw.element_bytes * experts, layout.efsdp, tp * d, "all_gather")
        reduce += collective_time(hw, 4 * experts, layout.efsdp, tp * d, "reduce_scatter")
    per_microbatch = {"zero3": 2 * gather + reduce, "zero2": reduce, "zero1": 0.0}[mode]
    replicate = collective_time(hw, 4 * shard_numel, r, tp * d * r, "all_reduce")
    after_backward = replicate + (reduce if mode == "zero1" else 0.0)
    before_forward = gather if mode in ("zero1", "zero2") else 0.0
    return per_microbatch, after_backward, before_forward


def embedding_copy_sum(args: ModelArgs, hw: HardwareProfile, layout: Layout) -> float:
    """The all-reduce, after each step's backward, of the embedding's gradient shard between the first pipeline rank
    and the last, which holds a copy for multi-token prediction (parallel/pipeline_ahead.py); 0 without one."""
    if layout.pp == 1 or not parts.ahead_modules(args)[0]:
        return 0.0
    shard = sum(t.rows * t.dim for t in parts.model_root(args).tables) / layout.tp / (layout.dp_shard * layout.cp)
    inner = layout.tp * layout.cp * layout.dp  # the ranks between two pipeline stages in the mesh
    return collective_time(hw, 4 * shard, 2, inner * layout.pp, "all_reduce")


def pipeline_part(layout: Layout) -> Layout:
    """The layout with its data-parallel settings at one process's: what the pipeline's compute depends on."""
    float8 = layout.float8 and dataclasses.replace(layout.float8, fsdp_all_gather=True)
    microbatches = layout.microbatches if modes.pairs_across_stages(layout) else 1  # the paired share (moe.py)
    return dataclasses.replace(
        layout, dp_replicate=1, dp_shard=1, dp_shard_mode="zero3", microbatches=microbatches, float8=float8
    )


@lru_cache(maxsize=65536)
def _pipeline(args: ModelArgs, hw: HardwareProfile, layout: Layout, seq_len: int, assumed: Assumptions) -> tuple:
    """Per-micro-batch compute of the pipeline's ranks: (slowest rank index, its passes, its
    recompute, seconds of the slowest and of the mean rank, mean TP, CP and EP seconds).
    `layout` is a pipeline_part: this is independent of dp."""
    first_tail = args.n_layers - high_precision_tail(args, layout)
    tails = layers_from(args, layout, first_tail) if first_tail < args.n_layers else [0] * layout.pp
    ranks = pipeline_ranks(args, layout)
    timed = [rank_passes(args, hw, layout, seq_len, assumed, rank, tail) for rank, tail in zip(ranks, tails)]
    pp = layout.pp
    per_rank = [ps.forward + rc.forward + ps.input_grad + ps.weight_grad for ps, rc in timed]
    slowest = max(range(pp), key=per_rank.__getitem__)
    tp_mean = sum(ps.tp_forward + ps.tp_backward + rc.tp_forward for ps, rc in timed) / pp
    cp_mean = sum(ps.cp_forward + ps.cp_backward + rc.cp_forward for ps, rc in timed) / pp
    ep_mean = sum(ps.ep_forward + ps.ep_backward + rc.ep_forward for ps, rc in timed) / pp
    worst, mean = per_rank[slowest], sum(per_rank) / pp
    return slowest, timed[slowest][0], timed[slowest][1], worst, mean, tp_mean, cp_mean, ep_mean


def step_time(args: ModelArgs, hw: HardwareProfile, layout: Layout, seq_len: int, assumed: Assumptions) -> StepTime:
    """The step of `layout` under what the plan assumes (`assumed`: planner/assumptions.py)."""
    schedule = modes.schedule(layout.pp_schedule, "--pp-schedule")
    p, v, m = layout.pp, layout.virtual_stages, layout.microbatches
    slowest, passes, recompute, worst, mean, tp_mean, cp_mean, ep_mean = _pipeline(
        args, hw, pipeline_part(layout), seq_len, assumed
    )
    chunk = (passes.forward / v, recompute.forward / v, passes.input_grad / v, passes.weight_grad / v)
    if defers(layout):  # the W holds the deferred products' share; the rest runs in the input pass
        share = deferred_share(args, layout)
        chunk = (*chunk[:2], chunk[2] + (1 - share) * chunk[3], share * chunk[3])
    slots = bubble_slots(schedule, p, joined=modes.joins_weight_passes(layout))
    bubble = max(0.0, sum(s * c for s, c in zip(slots, chunk))) if p > 1 else 0.0

    boundary_bytes = (
        layout.micro_batch_size
        * seq_len
        // layout.cp
        * args.dim
        / (layout.tp if layout.sequence_parallel else 1)
        * hw.element_bytes
    )
    inner = layout.tp * layout.cp * layout.dp  # the ranks between two pipeline stages in the mesh
    crosses_nodes = inner >= hw.scale_up  # the next stage sits in another scale-up domain
    bandwidth, latency = hw.collective_link(min(hw.scale_up, 2 * inner), crosses_nodes)
    transfers = 2 * (p * v - 1) if hw.overlaps_collectives else 2 * m * v  # per stage boundary
    pp_exposed = transfers * (boundary_bytes / bandwidth + latency) if p > 1 else 0.0
    pp_exposed += embedding_copy_sum(args, hw, layout)

    rank = pipeline_ranks(args, layout)[slowest]
    per_mb, after_backward, before_forward = dp_comm(args, hw, layout, rank)
    unhidden = m * v * per_mb / max(rank.layers, 1)
    tp_numel, shard_numel = rank.numel(args, layout.tp, layout.dp_shard * layout.cp, layout.ep, layout.expert_tp)
    if hw.overlaps_collectives:
        dp_exposed = (
            max(0.0, m * per_mb - m * worst)
            + unhidden
            + max(0.0, after_backward - (passes.input_grad + passes.weight_grad))
            + max(0.0, before_forward - passes.forward)
        )
    else:
        dp_exposed = m * per_mb + after_backward + before_forward
    dp_exposed += fsdp_copies(hw, layout, tp_numel, float8_gathered(args, layout, rank))

    copy_back = 2 * tp_numel if layout.dp_shard_mode in ("zero1", "zero2") else 0
    optimizer = _memory_bound(hw, copy_back) + optimizer_step_seconds(
        args, hw, layout, assumed.optimizer, rank, shard_numel
    )

    replicated_grads = 0.0
    if layout.tp > 1 and layout.dp_shard * layout.cp * layout.dp_replicate == 1:  # without FSDP: once per step
        replicated_grads = collective_time(hw, 4 * replicated_numel(args, rank), layout.tp, layout.tp, "all_reduce")
    return StepTime(
        compute=m * (mean - tp_mean - cp_mean - ep_mean),
        bubble=bubble,
        imbalance=m * (worst - mean),
        tp_exposed=m * tp_mean + replicated_grads,
        pp_exposed=pp_exposed,
        dp_exposed=dp_exposed,
        optimizer=optimizer,
        cp_exposed=m * cp_mean,
        ep_exposed=m * ep_mean,
    )
