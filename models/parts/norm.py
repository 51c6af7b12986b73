"""The block's two norms and residual adds (models/transformer.py build_norm, TransformerBlock), declared."""

from trillion.models.args import ModelArgs
from trillion.models.parts.counts import (
    LAYERNORM_EAGER,
    NORM_AND_RESIDUAL_COMPILED,
    RESIDUAL_EAGER,
    RMSNORM_EAGER,
)
from trillion.models.parts.spec import Norm, Part, PerToken

BLOCK_NORMS = ("attention_norm", "ffn_norm")
# Element-wise kernel launches of one block's forward, eager, besides its GEMMs and its attention kernel,
# counted on the whole block of each MLP kind (26 for a Llama block, 5 for a GPT block:
# tests/planner/test_work.py); kept as a block's figure until each part's own are counted.
BLOCK_EAGER_KERNELS = {"swiglu": 26, "gelu": 5}


def model_norm(args: ModelArgs, name: str) -> Norm:
    """A norm over the model's width: RMSNorm, or LayerNorm (with a bias when the model has biases)."""
    return Norm(name, args.dim, bias=args.norm == "layernorm" and args.bias)


def declare(args: ModelArgs) -> Part:
    """The block's norms (replicated, sequence-parallel under tp) and residual adds; its eager kernels."""
    h = args.dim
    eager = 2 * (RMSNORM_EAGER if args.norm == "rmsnorm" else LAYERNORM_EAGER) * h + 2 * RESIDUAL_EAGER * h
    return Part(
        module="",
        norms=tuple(model_norm(args, name) for name in BLOCK_NORMS),
        eager=PerToken(split=eager),
        compiled=PerToken(split=2 * NORM_AND_RESIDUAL_COMPILED * h),
        eager_kernels=BLOCK_EAGER_KERNELS[args.mlp],
    )
