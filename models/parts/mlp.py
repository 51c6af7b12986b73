"""The dense feed-forward (models/transformer.py FeedForward), declared: SwiGLU (w1, w3 column-wise, w2
row-wise; keeps w1's and w3's outputs, silu's and the product) or GELU (w1, w2; keeps its input and output).
DeepSeek's recompute mode keeps the linears' outputs and recomputes the activation's: silu's and the product (SwiGLU),
GELU's output."""

from trillion.models.args import ModelArgs
from trillion.models.parts.spec import COLUMN, ROW, Divides, Linear, Part, PerToken

# elements per hidden feature: (kept for backward, eager element-wise, compiled element-wise, of the kept the
# activation's outputs, which DeepSeek's recompute mode recomputes)
KINDS = {"swiglu": (4, 5, 3, 2), "gelu": (2, 2, 2, 1)}


def linears(args: ModelArgs, hidden: int, prefix: str) -> tuple[Linear, ...]:
    """`hidden` wide, named under `prefix` ("feed_forward", or an MoE layer's shared experts)."""
    h, bias = args.dim, args.bias
    up = (Linear(f"{prefix}.w1", h, hidden, COLUMN, bias), Linear(f"{prefix}.w2", hidden, h, ROW, bias))
    return up + ((Linear(f"{prefix}.w3", h, hidden, COLUMN, bias),) if args.mlp == "swiglu" else ())


def declare(args: ModelArgs, hidden: int | None = None, module: str = "feed_forward", prefix: str = "") -> Part:
    """The MLP `hidden` wide (default args.ffn_hidden; 0: none, an MoE layer without shared experts)."""
    hidden = args.ffn_hidden if hidden is None else hidden
    saved, eager, compiled, recomputed = KINDS[args.mlp]
    return Part(
        module=module,
        linears=linears(args, hidden, prefix or module) if hidden else (),
        saved=PerToken(split=saved * hidden),
        eager=PerToken(split=eager * hidden),
        compiled=PerToken(split=compiled * hidden),
        recomputed=PerToken(split=recomputed * hidden),
        tp_divides=(Divides("model.ffn_dim", args.ffn_hidden, "feed-forward width"),),
    )
