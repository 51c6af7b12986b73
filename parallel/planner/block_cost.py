"""One block's and the output head's passes on one rank (cost.py's docstring: compute, TP and CP per layer),
from the parts each block declares (models/parts): their linears' GEMMs at their tp splits, the attention at
its heads' widths, their element-wise work, and their sublayers' TP collectives."""

import dataclasses
from functools import lru_cache

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.models.parts.spec import COLUMN, DTENSOR_HEADS, HEADS, ROUTED, ROW
from trillion.parallel.float8_recipes import FLOAT8_RECIPES
from trillion.parallel.layout import Layout
from trillion.parallel.planner.assumptions import Assumptions
from trillion.parallel.planner.hardware import HardwareProfile
from trillion.parallel.planner.memory import tp_local_linears
from trillion.parallel.planner.moe import moe_passes
from trillion.parallel.planner.timing import Passes, _gemm, _memory_bound, collective_time, float8_casts
from trillion.parallel.planner.tp_hiding import Hiding, SublayerTP, hiding_of
from trillion.parallel.planner.work import (
    BACKWARD_ELEMENTWISE,
    CROSS_ENTROPY_BYTES_PER_LOGIT,
    elementwise_kernels,
    elementwise_per_token,
)

# loss_parallel's cross-entropy all-reduces one fp32 number per token 3 times: the logits' max and
# the sum of exponentials in log-softmax, the target's log-probability in nll_loss (a profiled tp 2 step)
LOSS_PARALLEL_ALL_REDUCES = 3


def attention_flops(args: ModelArgs, tokens: int, seq_len: int, tp: int, attention_share: float = 1.0) -> float:
    """Forward FLOPs of causal attention for `tokens` against `seq_len` keys, on one of `tp` ranks: per head
    QK^T at the query/key width and PV at the value width, half of the full square; under document masking
    the share of it the documents leave (models/flops.py)."""
    heads = parts.block(args).heads
    return tokens * seq_len * heads.heads * (heads.qk_head_dim + heads.v_head_dim) / tp * attention_share


@lru_cache(maxsize=8192)
def layer_passes(
    args: ModelArgs,
    hw: HardwareProfile,
    batch: int,
    seq_len: int,
    tp: int,
    compiled: bool,
    cp: int = 1,
    float8: str = "",
    routed: bool = False,
    attention_share: float = 1.0,
    hiding: Hiding | None = None,
    folded: bool = False,
) -> Passes:
    """One transformer layer, one micro-batch of `batch` sequences, on one of `tp` tensor-parallel GPUs
    holding 1/cp of each sequence; with a `float8` recipe (parallel/float8_recipes.py FLOAT8_RECIPES; "" for none), its
    converted linears in that recipe's format (cost.py's docstring); `routed`: an MoE layer's attention and shared
    experts (moe.py adds the rest), `folded` with ep over the tp ranks (its tokens gathered over tp only for its
    shared experts, if any); `attention_share`: document masking's (models/flops.py); `hiding`: how its TP
    collectives run beside its GEMMs (tp_hiding.py; None: exposed)."""
    tokens = batch * seq_len // cp
    recipe = FLOAT8_RECIPES[float8] if float8 else None
    multiple = recipe.dim_multiple if recipe else 1
    # (k, n, in the recipe's format) of each linear on this rank: the GEMM is tokens x k x n
    shapes = [(k, n, recipe if converted else None) for k, n, converted in tp_local_linears(args, tp, routed, multiple)]
    gemm = sum(_gemm(hw, tokens, k, n, quantised) for k, n, quantised in shapes)
    casts = [float8_casts(hw, tokens, k, n, quantised) for k, n, quantised in shapes if quantised]
    cast_forward, cast_input_grad, cast_weight_grad = (sum(c[i] for c in casts) for i in range(3))
    peak_attention = hw.device.peak_tflops_bf16 * 1e12 * hw.device.attention_efficiency * hw.device.sustained
    attention = attention_flops(args, tokens, seq_len, tp, attention_share) / peak_attention
    elementwise = _memory_bound(hw, tokens * elementwise_per_token(args, tp, compiled, routed) * hw.element_bytes)
    launches = (1 + elementwise_kernels(args, compiled)) * hw.device.kernel_overhead_us * 1e-6
    tp_comm_forward, tp_comm_backward = sublayers_tp(args, hw, tokens, tp, float8, routed, shapes, hiding, folded)
    host_forward, host_backward = hw.tp_layer_host_s if tp > 1 else (0.0, 0.0)
    kv_bytes = batch * seq_len * parts.block(args).heads.kv_width / tp * hw.element_bytes  # the sequence's K and V
    cp_gather = collective_time(hw, kv_bytes, cp, tp * cp, "all_gather")
    cp_reduce = collective_time(hw, kv_bytes, cp, tp * cp, "reduce_scatter")
    return Passes(
        forward=gemm + attention + elementwise + launches + tp_comm_forward + host_forward + cp_gather + cast_forward,
        input_grad=gemm
        + 2.5 * attention
        + BACKWARD_ELEMENTWISE * (elementwise + launches)
        + tp_comm_backward
        + host_backward
        + cp_reduce
        + cast_input_grad,
        weight_grad=gemm + cast_weight_grad,
        tp_forward=tp_comm_forward + host_forward,
        tp_backward=tp_comm_backward + host_backward,
        cp_forward=cp_gather,
        cp_backward=cp_reduce,
    )


def sublayers_tp(
    args: ModelArgs, hw: HardwareProfile, tokens: int, tp: int, float8: str, routed: bool, shapes, hiding, folded=False
) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's exposed TP collectives: per sublayer its input's all-gather (and its
    output gradient's, backward) and its reduce-scatter, of the tokens x dim activation, each exposed as DTensor
    runs it, or for a HEADS part under `hiding` what the schedule beside its GEMMs leaves (tp_hiding.py). `shapes`:
    the layer's linears on a rank, in the parts' order (memory.tp_local_linears). Folded (ep over the tp ranks,
    parallel/expert_tensor_parallel.py) an MoE sublayer's routed tokens stay sequence-parallel: only its shared
    experts' linears, if any, gather."""
    stream, local = tokens * args.dim, iter(shapes)
    pieces = hiding.pieces if hiding is not None else 1
    gathers = tp_gather_bytes(args, tp, float8, routed, hw.element_bytes)
    forward = backward = 0.0
    for part, (gather_forward, gather_backward) in zip(parts.block(args, routed).sublayers, gathers):
        if folded and part.tp_style == ROUTED and not part.linears:
            continue
        transfers = {}
        for name, nbytes, kind in (
            ("gather_forward", gather_forward, "all_gather"),
            ("gather_backward", gather_backward, "all_gather"),
            ("scatter", hw.element_bytes, "reduce_scatter"),
        ):
            transfers[name] = collective_time(hw, stream * nbytes, tp, tp, kind)
            transfers[f"piece_{name}"] = collective_time(hw, stream * nbytes / pieces, tp, tp, kind)
        mine = [next(local) for _ in part.linears]
        columns = [shape for shape, x in zip(mine, part.linears) if x.split == COLUMN]
        row = [shape for shape, x in zip(mine, part.linears) if x.split == ROW]
        hidden = hiding if part.tp_style == HEADS else None
        f, b = SublayerTP(**transfers).exposed(hw, hidden, tp, tokens, columns, row)
        forward, backward = forward + f, backward + b
    return forward, backward


def tp_gather_bytes(
    args: ModelArgs, tp: int, float8: str, routed: bool, element_bytes: int
) -> tuple[tuple[int, int], ...]:
    """Per sublayer (attention, MLP): the bytes per element of TP's forward all-gather of its input and of its
    backward all-gather of its output's gradient. torchao's float8 TP styles (parallel/float8.py tp_styles, the
    trainer's under tensorwise float8) cast the input to float8 before the all-gather when the sublayer's
    columnwise linears are converted (Float8ColwiseParallel, PrepareFloat8ModuleInput), and the output's gradient
    to float8 before the all-gather that is its reduce-scatter's backward when the rowwise linear is
    (Float8RowwiseParallel: NoopFwToFloat8BwDynamic); reduce-scatters stay in the compute dtype. A part whose
    tensors stay DTensors (latent attention: its input gathered for replicated down projections) has no float8
    style to prepare it: its gathers stay in that dtype. A recipe without torchao's float8 styles (rowwise, the MX and
    NV formats: their TP communication stays in high precision) gathers in the compute dtype."""
    declared = parts.block(args, routed).sublayers
    if not float8 or not FLOAT8_RECIPES[float8].float8_tp:
        return ((element_bytes, element_bytes),) * len(declared)
    converted = iter(fp8 for _, _, fp8 in tp_local_linears(args, tp, routed, FLOAT8_RECIPES[float8].dim_multiple))
    sublayers = []
    for part in declared:
        group = [(linear.split, next(converted)) for linear in part.linears]
        if part.tp_style == DTENSOR_HEADS:
            group = []
        columnwise = [fp8 for split, fp8 in group if split == COLUMN]
        rowwise = [fp8 for split, fp8 in group if split == ROW]
        sublayers.append(
            (1 if columnwise and all(columnwise) else element_bytes, 1 if rowwise and all(rowwise) else element_bytes)
        )
    return tuple(sublayers)


def block_passes(
    args: ModelArgs,
    hw: HardwareProfile,
    layout: Layout,
    seq_len: int,
    assumed: Assumptions,
    *,
    routed: bool,
    high_precision: bool = False,
) -> Passes:
    """One dense block, or one MoE block (its attention and shared experts, then moe.py's routed experts),
    of one micro-batch at `layout`'s micro-batch size, tp, cp, ep, compile, float8 recipe and TP hiding, and the
    attention share and load imbalance the plan assumes; `high_precision`: a block the recipe keeps in bf16 (a 4-bit
    recipe's tail)."""
    f8 = layout.float8
    recipe = f8.recipe if f8 is not None and f8.linears and not high_precision else ""
    shape = (args, hw, layout.micro_batch_size, seq_len, layout.tp, layout.compile, layout.cp, recipe)
    hiding = hiding_of(layout)
    if not routed:
        return layer_passes(*shape, attention_share=assumed.attention_share, hiding=hiding)
    tokens = layout.micro_batch_size * seq_len // layout.cp
    # attention and shared experts: what a paired micro-batch computes beside this one's all-to-alls
    around = layer_passes(*shape, True, assumed.attention_share, hiding, layout.folded)
    if high_precision:
        layout = dataclasses.replace(layout, float8=None)
    return around + moe_passes(args, hw, tokens, layout, assumed.moe_load_imbalance, around)


@lru_cache(maxsize=8192)
def output_passes(args: ModelArgs, hw: HardwareProfile, tokens: int, tp: int) -> Passes:
    """Final norm, output projection (vocabulary-parallel) and cross-entropy."""
    gemm = _gemm(hw, tokens, args.dim, args.vocab_size // tp)
    loss = _memory_bound(hw, tokens * args.vocab_size / tp * CROSS_ENTROPY_BYTES_PER_LOGIT * hw.element_bytes / 2)
    gather = collective_time(
        hw, tokens * args.dim * hw.element_bytes, tp, tp, "all_gather"
    ) + LOSS_PARALLEL_ALL_REDUCES * collective_time(hw, tokens * 4, tp, tp, "all_reduce")
    scatter = collective_time(hw, tokens * args.dim * hw.element_bytes, tp, tp, "reduce_scatter")
    return Passes(
        forward=gemm + loss + gather,
        input_grad=gemm + loss + scatter,
        weight_grad=gemm,
        tp_forward=gather,
        tp_backward=scatter,
    )
