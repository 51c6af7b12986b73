"""Activations a layer keeps for backward, per micro-batch, as the planner counts them (memory.py adds them up per
rank): from what each part declares it keeps (models/parts `saved`), by checkpointing mode.

Activations follow Korthikanti et al. 2022 without dropout and with flash attention (no s^2 terms): 32 s b h bytes
per GPT layer in bf16 (their 34 less the two dropout masks) and flash attention's fp32 log-sum-exp. With sequence
parallelism the norm inputs are split over TP ranks, but DTensor saves the all-gathered inputs of the column-parallel
linears whole, so those stay s b h each. A checkpointed layer keeps only its input.

DeepSeek's recompute mode (parallel.activation_checkpoint=deepseek, parallel/activation_checkpoint.py; DeepSeek-V3
section 3.2.3) replays no block: a layer keeps what it keeps without checkpointing less what the mode recomputes from
what it keeps, each from a declaration: the attention norm's output (and a dense block's feed-forward norm's; an MoE
block's feeds its dispatch, which runs once, so it stays), what each part declares `recomputed` (latent attention's
up-projections' outputs and what they make, from the kept latents; an MLP's activation outputs, silu's and the
product, the shared experts' too), and of the routed experts w2's input, the product (moe.py moe_activation_bytes
`recompute_swiglu`, as models/moe.py RoutedExperts.recompute_swiglu).
"""

from functools import lru_cache

from trillion.models import parts
from trillion.models.args import ModelArgs
from trillion.parallel.modes import checkpointed_blocks
from trillion.parallel.planner.moe import FLOAT8_CACHE_BLOCK, effective_imbalance, expert_width, routed_block

ACTIVATION_BYTES = 2  # bf16


def layer_activation_bytes(
    args: ModelArgs,
    tokens: int,
    tp: int,
    sequence_parallel: bool,
    checkpointed: bool,
    dtype_bytes: int = ACTIVATION_BYTES,
    routed: bool = False,
    recomputes_sublayers: bool = False,
) -> float:
    """Bytes one layer keeps for backward for `tokens` (= micro-batch size x sequence length).

    Replicated over TP ranks (split by sequence parallelism): the two norm inputs. Always whole:
    the two norm outputs, which the column-parallel linears save (all-gathered under SP).
    Split by TP: q, k, v and the attention output (kept by flash attention; the output projection's
    input is a view of it, models/parts/gqa.py), the MLP's hidden activations (GELU: input and output;
    SwiGLU: w1 and w3 outputs, silu output, product). Flash attention adds an fp32 log-sum-exp per head.
    Latent attention adds its latents, whole on every TP rank. Each part declares what it keeps
    (models/parts, `saved`).
    `routed`: an MoE layer's (its attention and shared experts; its routed experts moe.moe_activation_bytes
    counts). `recomputes_sublayers`: DeepSeek's recompute mode (the module docstring).
    """
    h, block = args.dim, parts.block(args, routed)
    split = tp if sequence_parallel else 1
    if checkpointed:
        return tokens * h / split * dtype_bytes
    norm_inputs = sum(n.features for n in block.norms)
    replicated = norm_inputs / split
    whole = norm_inputs + sum(p.saved.whole for p in block.parts)
    sharded = sum(p.saved.split / tp for p in block.parts)
    if recomputes_sublayers:
        recomputed_norms = block.norms[:1] if routed else block.norms  # an MoE block keeps its dispatch's input
        whole -= sum(n.features for n in recomputed_norms) + sum(p.recomputed.whole for p in block.parts)
        sharded -= sum(p.recomputed.split / tp for p in block.parts)
    logsumexp = 4 * block.heads.heads / tp
    return tokens * ((replicated + whole + sharded) * dtype_bytes + logsumexp)


def output_activation_bytes(
    args: ModelArgs, tokens: int, tp: int, sequence_parallel: bool, dtype_bytes: int = ACTIVATION_BYTES
) -> float:
    """Final norm input and output, and the fp32 log-softmax the cross-entropy keeps."""
    split = tp if sequence_parallel else 1
    return tokens * ((args.dim / split + args.dim) * dtype_bytes + 4 * args.vocab_size / tp)


# The loss backward's transient above the kept fp32 log-softmax, bytes per logit element on a rank, as `trillion
# estimate` measures it (tests/estimate/test_estimate_tp_activations.py). Without TP: nll_loss_backward's fp32 gradient
# and log_softmax's backward output (4 + 4). Under loss_parallel (tp > 1): torch/distributed/tensor/parallel/loss.py
# _nll_loss_and_log_softmax_backward holds zeros_like(x), exp(x) and their sum, each fp32, at once (4 + 4 + 4).
LOSS_BACKWARD_BYTES = 8
LOSS_PARALLEL_BACKWARD_BYTES = 12


def loss_backward_bytes(args: ModelArgs, tokens: int, tp: int) -> float:
    """The peak the cross-entropy's backward adds on the last stage for one output's logits (the constants above)."""
    per_element = LOSS_PARALLEL_BACKWARD_BYTES if tp > 1 else LOSS_BACKWARD_BYTES
    return per_element * tokens * args.vocab_size / tp


def checkpointed_layers(mode: str, n_layers: int) -> int:
    """How many of a stage module's layers are checkpointed (the trainer applies the mode to each
    stage module's own blocks: selective checkpoints every second one, starting with the first)."""
    return len(checkpointed_blocks(mode, n_layers))


@lru_cache(maxsize=65536)
def layer_bytes(
    args: ModelArgs,
    tokens: int,
    tp: int,
    sp: bool,
    ep: int,
    imbalance: float,
    etp: int,
    routed: int,
    recomputes_sublayers: bool = False,
    float8_cache: bool = False,
) -> tuple[float, float, float]:
    """(a dense layer's, an MoE layer's activations kept for backward, a checkpointed layer's input); an MoE layer's
    routed part for the `routed` tokens the rank routes (moe.py routed_tokens) and its experts' etp slices;
    `recomputes_sublayers`: under DeepSeek's recompute mode; `float8_cache`: the experts' in float8
    (float8.cache_activations)."""
    dense = layer_activation_bytes(args, tokens, tp, sp, False, recomputes_sublayers=recomputes_sublayers)
    kept = layer_activation_bytes(args, tokens, tp, sp, checkpointed=True)
    if not parts.routed_experts(args):
        return dense, 0.0, kept
    attention = layer_activation_bytes(
        args, tokens, tp, sp, False, routed=True, recomputes_sublayers=recomputes_sublayers
    )
    experts = moe_activation_bytes(
        args, routed, etp, ep, imbalance, ACTIVATION_BYTES, float8_cache, recompute_swiglu=recomputes_sublayers
    )
    return dense, attention + experts, kept


def moe_activation_bytes(
    args: ModelArgs,
    tokens: int,
    etp: int,
    ep: int,
    imbalance: float,
    dtype_bytes: int,
    float8_cache: bool = False,
    recompute_swiglu: bool = False,
) -> float:
    """Bytes an MoE layer keeps for backward beyond its attention and shared experts, for `tokens` routed by the rank
    and experts split over `etp` (the module docstring): the router's float32 scores, the permuted tokens k h, and of
    the experts' k f / etp wide activations w1's and w3's outputs (kernels/swiglu.py keeps them, recomputing SwiGLU's
    output and the routing weights' product in backward) and w2's input; nothing of the experts' outputs, which
    return summed, their routing weights applied before w2 (models/expert_rows.py), whatever the ep.
    `float8_cache` (float8.cache_activations, models/moe.py RoutedExperts): the permuted tokens and the three expert
    activations in float8, a byte an element and a float32 scale per 128 (checked against the measured bytes:
    tests/float8/test_activation_cache.py). `recompute_swiglu` (DeepSeek's recompute mode): w2's input is recomputed
    too (models/moe.py RoutedExperts.recompute_swiglu; with the cache, from SwiGLU's float8 inputs)."""
    block = routed_block(args)
    k, f, imb = block.routing.top_k, expert_width(block), effective_imbalance(ep, imbalance)
    hidden = 2 if recompute_swiglu else 3  # w1's and w3's outputs (and w2's input)
    if float8_cache:
        float8 = (k * args.dim + hidden * k * f / etp) * (1 + 4 / FLOAT8_CACHE_BLOCK)
        return tokens * (4 * block.routing.n_experts + float8 * imb)
    return tokens * (4 * block.routing.n_experts + (k * args.dim + hidden * k * f / etp) * imb * dtype_bytes)


def ahead_module_bytes(args: ModelArgs, tokens: int, dense_layer: float, moe_layer: float) -> float:
    """An MTP module's activations per micro-batch (models/parts), not checkpointed: its block, its projection's input
    (its output is counted as the root's)."""
    block = moe_layer if parts.routed_layer(args, args.n_layers) else dense_layer
    return block + 2 * tokens * args.dim * ACTIVATION_BYTES
