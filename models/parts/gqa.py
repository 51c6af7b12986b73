"""Grouped-query attention (models/transformer.py Attention), declared: q, k, v column-wise over the heads,
wo row-wise, optional per-head QK norms; flash attention keeps q, k, v and its output, which is also wo's input: the
output is laid out (batch, seq, heads, head_dim) in memory (kernels/flash_attention_op.py; aten's flash op alike), so
the reshape to wo's input is a view, one tensor kept once. A head's logit is its wq rows against its group's wk rows;
with QK norms the norms undo any scaling of those rows."""

from trillion.models.args import ModelArgs
from trillion.models.parts.counts import ROPE_COMPILED, ROPE_EAGER
from trillion.models.parts.spec import COLUMN, ROW, Divides, HeadRows, Heads, Linear, LogitTerm, Norm, Part, PerToken


def declare(args: ModelArgs) -> Part:
    h, d, bias = args.dim, args.head_dim, args.bias
    q, kv = args.n_heads * d, args.kv_heads * d
    rope = args.positions == "rope"
    return Part(
        module="attention",
        linears=(
            Linear("attention.wq", h, q, COLUMN, bias),
            Linear("attention.wk", h, kv, COLUMN, bias),
            Linear("attention.wv", h, kv, COLUMN, bias),
            Linear("attention.wo", q, h, ROW, bias),
        ),
        norms=tuple(Norm(f"attention.{n}", d) for n in ("q_norm", "k_norm")) if args.qk_norm else (),
        heads=Heads(args.n_heads, args.kv_heads, d, d),
        saved=PerToken(split=args.n_heads * 2 * d + 2 * args.kv_heads * d),  # q and the output; k and v
        eager=PerToken(split=ROPE_EAGER * (q + kv) if rope else 0),
        compiled=PerToken(split=ROPE_COMPILED * (q + kv) if rope else 0),
        tp_divides=(
            Divides("model.n_heads", args.n_heads, "query heads"),
            Divides("model.n_kv_heads", args.kv_heads, "key/value heads"),
        ),
        logit_terms=()
        if args.qk_norm
        else (LogitTerm(HeadRows("attention.wq", d, 0, d), HeadRows("attention.wk", d, 0, d)),),
        logit_terms_absent=(
            "its per-head QK norms normalise q and k after the projections, so scaling their rows changes no logit "
            "(the norms' own weights, shared by every head, bound them)"
            if args.qk_norm
            else ""
        ),
    )
