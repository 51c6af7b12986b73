"""parallel.defer_weight_grads as the planner prices it (parallel/deferred_weight_grads.py runs it): which share of a
chunk's weight-gradient pass the schedule's W then holds, and what a chunk keeps from its input pass to its W.

The share: a GEMM's weight gradient costs its rows x in x out multiply-adds, so a block's deferred share is that of
its deferrable GEMMs: every linear of a block (tp is 1 under deferral, modes.py), and the routed experts unless a
torchao grouped product runs them (float8.experts rowwise or mxfp8, which own their backward). The router's gate,
the norms and the embeddings are left to the input pass and are too small to count.

The bytes a chunk's input pass leaves queued, per token of a block, each from what the queue's products keep
(deferred_weight_grads.py, kernels/float8_grouped_gemm.py):
- a high-precision linear: its output's gradient, and its input, once for the linears that read the same tensor
  (the attention's projections of the normed input; an MLP's w1 and w3; an MoE block's shared experts and router);
- a float8 linear: its input and output gradient as cast for the weight GEMM, a byte an element each, per linear;
- the routed experts, per routed row: w1's and w3's input (once; a byte an element with float8.cache_activations),
  their two output gradients and w2's (in bf16), and w2's input (bf16; float8 with the cache; under DeepSeek's
  recompute with the cache, the float8 inputs of SwiGLU it is rebuilt from).
A multi-token prediction module adds its block and its projection's. Scales (float32 per 128) are left out: under
1% of a float8 operand. Checked against what `trillion estimate` measures a stage's queue holding
(tests/planner/test_deferred_weights.py).
"""

from functools import lru_cache

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.parallel import modes
from trillion.parallel.planner.activations import ACTIVATION_BYTES
from trillion.parallel.planner.float8_experts import float8_expert_recipe
from trillion.parallel.planner.moe import effective_imbalance, expert_width, routed_block, routed_tokens
from trillion.parallel.planner.schedules import leaf_actions

DEFERRING_EXPERT_RECIPES = (None, "blockwise")  # bf16, or the project's own float8 product (not torchao's)
FLOAT8_LINEAR_MULTIPLE = 16  # the dims torchao's float8 linears need (memory.py FLOAT8_DIM_MULTIPLE's rule)


def defers(layout) -> bool:
    """Whether the layout runs parallel.defer_weight_grads' queue: the setting, where a schedule has weight passes."""
    return layout.defer_weight_grads and layout.pp > 1 and modes.schedule(layout.pp_schedule).split_backward


def _float8_linears(layout) -> bool:
    return layout.float8 is not None and layout.float8.linears


def _experts_defer(layout) -> bool:
    return float8_expert_recipe(layout.float8) in DEFERRING_EXPERT_RECIPES


def deferred_share(args: ModelArgs, layout) -> float:
    """The share of a chunk's weight-gradient multiply-adds the W holds under deferral (the module docstring), an
    MoE block's where the model has them, else a dense block's."""
    routed = bool(parts.routed_experts(args))
    linears = sum(linear.in_features * linear.out_features for linear in parts.block(args, routed).linears)
    if not routed:
        return 1.0
    block = routed_block(args)
    k, f = block.routing.top_k, expert_width(block)
    experts = k * 3 * args.dim * f * effective_imbalance(layout.ep, 1.0)
    return (linears + (experts if _experts_defer(layout) else 0)) / (linears + experts)


@lru_cache(maxsize=4096)
def _linear_bytes(args: ModelArgs, routed: bool, float8: bool) -> float:
    """A block's linears' deferred bytes per token (the module docstring)."""
    linears = parts.block(args, routed).linears
    if float8:
        kept = lambda x: x.in_features % FLOAT8_LINEAR_MULTIPLE == 0 and x.out_features % FLOAT8_LINEAR_MULTIPLE == 0  # noqa: E731
        return sum((x.in_features + x.out_features) * (1 if kept(x) else ACTIVATION_BYTES) for x in linears)
    inputs = {(x.name.split(".")[0], x.in_features) for x in linears}  # one tensor per sublayer and width
    router = routed_block(args).routing.n_experts if routed else 0  # its input the shared experts' (above)
    return (sum(x.out_features for x in linears) + sum(width for _, width in inputs) + router) * ACTIVATION_BYTES


def _expert_bytes_per_row(args: ModelArgs, layout) -> float:
    f8 = layout.float8
    cache = f8 is not None and f8.cache_activations and float8_expert_recipe(f8) is not None
    recompute = modes.checkpoint_mode(layout.activation_checkpoint).sublayers
    f, dim = expert_width(routed_block(args)), args.dim
    gradients = (2 * f + dim) * ACTIVATION_BYTES
    w1_input = dim * (1 if cache else ACTIVATION_BYTES)
    w2_input = (2 * f if recompute else f) if cache else f * ACTIVATION_BYTES
    return gradients + w1_input + w2_input


def layer_deferred_bytes(args: ModelArgs, layout, tokens: int) -> tuple[float, float]:
    """(a dense block's, an MoE block's) bytes queued from a chunk's input pass to its W for `tokens` of a
    micro-batch (the module docstring)."""
    float8 = _float8_linears(layout)
    dense = tokens * _linear_bytes(args, False, float8)
    if not parts.routed_experts(args):
        return dense, 0.0
    moe = tokens * _linear_bytes(args, True, float8)
    if _experts_defer(layout):
        rows = routed_tokens(tokens, layout) * routed_block(args).routing.top_k
        moe += rows * effective_imbalance(layout.ep, 1.0) * _expert_bytes_per_row(args, layout)
    return dense, moe


def chunk_deferred_bytes(args: ModelArgs, layout, seq_len: int, rank) -> tuple[float, ...]:
    """What each of a rank's pipeline chunks (memory.py RankParams) keeps queued between its input pass and its W,
    its multi-token prediction modules on the model's last stage included (each a block and its projection)."""
    tokens = layout.micro_batch_size * seq_len // layout.cp
    dense, moe = layer_deferred_bytes(args, layout, tokens)
    held = [r * moe + (n - r) * dense for n, r in zip(rank.chunks, rank.chunk_routed)]
    if rank.ahead_modules:
        block = moe if parts.routed_layer(args, args.n_layers) else dense
        projection = tokens * 3 * args.dim * ACTIVATION_BYTES  # its 2 dim input and dim output's gradient
        held[-1] += rank.ahead_modules * (block + projection)
    return tuple(held)


def queued_in_flight(layout, index: int, held: tuple, queued: tuple) -> tuple[float, tuple]:
    """(micro-batches in flight on pipeline rank `index` at its peak, in units of one through all its layers; each
    chunk's forward count then) under deferral: a chunk holds `held` bytes of a micro-batch (memory.py _chunk_bytes)
    from its forward to its input pass, then `queued` (chunk_deferred_bytes) until its W, in the order torch's
    schedule runs them on the rank."""
    counts = _counts(layout.pp_schedule, layout.pp, layout.virtual_stages, layout.microbatches, index)
    weigh = lambda point: sum(n * b for n, b in zip(point, (*held, *queued)))  # noqa: E731
    peak = max(counts, key=weigh)
    return weigh(peak) / max(sum(held), 1.0), peak[: len(held)]


def rank_order(schedule: str, p: int, v: int, m: int, rank: int) -> list:
    """The action list torch's schedule class builds for pipeline rank `rank` of `p` (v chunks a rank, m micro-
    batches), from the fields its builder reads (no process group, no stages)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(schedule)
    order = cls.__new__(cls)
    order.pp_group_size, order._n_microbatches, order.n_local_stages = p, m, v
    order._num_stages = order.num_stages = v * p
    order.microbatches_per_round = p
    return order._calculate_single_rank_operations(rank)


@lru_cache(maxsize=1024)
def _counts(schedule: str, p: int, v: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """After each action of the rank's list: (micro-batches each of its v chunks holds forward, then awaiting W)."""
    stages = [rank, 2 * p - 1 - rank] if modes.schedule(schedule).v_shape else [rank + k * p for k in range(v)]
    live, waiting, points = [0] * v, [0] * v, set()
    for action in leaf_actions(rank_order(schedule, p, v, m, rank)):
        chunk, kind = stages.index(action.stage_index), action.computation_type.value
        live[chunk] += (kind == "F") - (kind in ("B", "I"))
        waiting[chunk] += (kind == "I") - (kind == "W")
        points.add((*live, *waiting))
    return tuple(points)
