"""What a step does besides GEMMs and attention, counted from the code that runs it: the
element-wise traffic and kernel launches of one transformer layer (eager and compiled), and the
memory passes of the optimizer and of FSDP's copies. The planner times them at the device's
memory bandwidth and launch overhead (cost.py).

Per token of one layer's forward, in elements read plus written (models/transformer.py; each part declares
its own in models/parts, with the counts of models/parts/counts.py; checked
against a count of every aten op of a real block, forward and backward, in
tests/planner/test_work.py):
  eager     RMSNorm as torch decomposes it (pow, mean, rsqrt, two multiplies) 8 h, LayerNorm's
            fused kernel 2 h, each; two residual adds 3 h each; rotary embedding on q and k
            (neg, cat, two multiplies, add) 10 (q + kv); SwiGLU (silu, multiply) 5 f, GELU 2 f.
  compiled  one fused kernel per chain reads its inputs and writes its outputs once: residual add
            + norm 4 h each, rotary 2 (q + kv), SwiGLU 3 f, GELU 2 f.
The backward pass of an element-wise op reads its saved input and the incoming gradient and writes
the outgoing one: twice the forward's traffic (the count gives 2.1).
"""

from trillion.models import parts
from trillion.models.args import ModelArgs

BACKWARD_ELEMENTWISE = 2.0
# element-wise kernels of one layer's forward besides the GEMMs and the attention kernel, compiled: one per chain
# (eager: as the block's parts declare them, models/parts/norm.py)
COMPILED_KERNELS = 5  # two residual+norm, rotary, the MLP activation, the attention output copy
# AdamW's fused kernel reads parameter, gradient and both moments and writes three of them
# (7 x 4 bytes), gradient clipping reads every gradient for the norm and scales it (3 x 4 bytes)
OPTIMIZER_BYTES_PER_PARAM = 40
# FSDP2 copies each all-gathered parameter out of the collective's buffer (read + write bf16, on
# the compute stream) and each gradient into the reduce-scatter buffer (read bf16, write fp32):
# torch.distributed.fsdp._fully_shard._fsdp_collectives
FSDP_GATHER_COPY_BYTES = 4
FSDP_REDUCE_COPY_BYTES = 6
# Float8 (`trillion plan --float8`): each cast to fp8 of a converted linear's operand reads it in bf16 and
# writes it in fp8, 3 bytes per element, one kernel. A simple model, an assumption rather than a count: the
# forward casts the input and the weight, the backward the output's gradient and again the saved input and
# weight (tensorwise scaling saves them in bf16 and casts them for the input- and weight-gradient GEMMs); the
# amax reduction that sets each scale is taken as fused into the cast or into the kernel that produced the
# operand, and is not charged. A block-scaled recipe (MXFP8, NVFP4, MXFP4) writes its elements and one scale per
# block instead (cast_bytes); recipes that quantise along each dim apart (rowwise, MX: torchao's mx_mm) cast the
# weight gradient's two operands along the tokens again (timing.float8_casts).
HIGH_PRECISION_READ_BYTES = 2  # a cast reads its bf16 operand
FLOAT8_CAST_BYTES = 3
# an fp8 GEMM reads its operands at 1 byte per element (the roofline in cost.py); FSDP's float8 all-gather
# gathers the converted weights at 1 byte and its copy out of the gather buffer reads and writes 1 byte each
FLOAT8_BYTES = 1
FSDP_FLOAT8_GATHER_COPY_BYTES = 2
# cross-entropy over the vocabulary, per logit: the bf16 logits read, an fp32 copy written and
# read by log-softmax, its output written and read by the loss, the gradient written (2+4+4+4+4+4)
CROSS_ENTROPY_BYTES_PER_LOGIT = 22


def cast_bytes(recipe) -> float:
    """Bytes one element's cast to `recipe`'s format moves (parallel/modes.py Float8Recipe): its bf16 read, its
    quantised write and its share of a block's scale; FLOAT8_CAST_BYTES for plain fp8."""
    return HIGH_PRECISION_READ_BYTES + recipe.quantised_bytes(1)


def elementwise_per_token(args: ModelArgs, tp: int, compiled: bool, routed: bool = False) -> float:
    """Elements read and written per token by one layer's forward on one of `tp` ranks, as its parts declare them
    (models/parts: the norms and residuals, sequence-parallel, are split over the ranks too; latent attention's
    latent norms are not); `routed`: an MoE layer's attention and shared experts (moe.py counts the routed experts)."""
    return parts.block(args, routed).elementwise_on_rank(tp, compiled)


def elementwise_kernels(args: ModelArgs, compiled: bool) -> int:
    """Element-wise kernel launches of one layer's forward."""
    return COMPILED_KERNELS if compiled else parts.block(args).eager_kernels
