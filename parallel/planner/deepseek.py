"""DeepSeek's blocks as the planner sees them (DeepSeek-V3, Kimi K2, Moonlight, DeepSeek-V2-Lite): multi-head
latent attention in place of grouped-query attention, and multi-token prediction; their routed experts are
moe.py's (sigmoid, group-limited routing included).

MLA (DeepSeek-V2, arXiv 2405.04434 section 2.1; the shapes of each preset's config.json), per block:
  queries      q_lora_rank > 0: wq_a (dim -> q_lora_rank), its RMSNorm q_norm, wq_b (q_lora_rank -> heads x
               qk_head_dim); else one wq (dim -> heads x qk_head_dim)
  keys, values wkv_a (dim -> kv_lora_rank + qk_rope_head_dim): the latent and the rotary key part all heads share;
               the latent's RMSNorm kv_norm; wkv_b (kv_lora_rank -> heads x (qk_nope_head_dim + v_head_dim))
  output       wo (heads x v_head_dim -> dim)
  TP           splits heads (wq_b or wq and wkv_b column-parallel, wo row-parallel); the down projections and the
               latent norms stay whole on every tp rank, as torchtitan's DeepSeek-V3 plan keeps them (NoParallel),
               so each tp rank runs them on the whole gathered sequence.
  attention    per head QK^T at qk_head_dim and PV at v_head_dim: the causal forward is tokens x seq x heads x
               (qk + v) FLOPs (half of the 2 s^2 (qk + v) per head a full square costs).
  memory       kept for backward beyond the block's norms: the query latent before and after its norm (q_lora_rank
               each) and the key/value latent before and after its norm (kv_lora_rank each) with the rotary key
               part, all whole; per head q and k at qk_head_dim, v, the attention output and wo's input at v_head_dim.
  element-wise (eager, per token) the two latent norms as RMSNorm decomposes (work.py: 8 elements per feature),
               rotary on the query's and the shared key's rotary parts (10 per element, work.py), and q and k
               assembled from their no-position and rotary parts (read and write heads x qk_head_dim each);
               compiled: each chain once (2 per latent feature, 2 per element of q and k).

MTP (DeepSeek-V3, arXiv 2412.19437 section 2.2): each of `mtp_modules` modules normalises the last hidden state and
the embedding of the token one further ahead (two RMSNorms), projects their concatenation (2 dim -> dim, one
linear), runs one more transformer block (an MoE block when the main model's next index would be one) and the
shared final norm's own copy, then the shared output head and its cross-entropy. The planner puts them on the last
pipeline rank beside the output head they share; their projection is replicated over tp (no TP plan names it).
"""

from trillion.models.args import ModelArgs

RMSNORM_EAGER, RMSNORM_COMPILED = 8, 2  # elements per feature (work.py's counts)
ROPE_EAGER, ROPE_COMPILED = 10, 2


def head_dims(args: ModelArgs) -> tuple[int, int]:
    """(query/key, value) width of one attention head."""
    if args.mla:
        return args.mla.qk_head_dim, args.mla.v_head_dim
    return args.head_dim, args.head_dim


def attention_flops(args: ModelArgs, tokens: int, seq_len: int, tp: int) -> float:
    """Forward FLOPs of causal attention for `tokens` against `seq_len` keys, on one of `tp` ranks."""
    qk, v = head_dims(args)
    return tokens * seq_len * args.n_heads * (qk + v) / tp


def kv_width(args: ModelArgs) -> int:
    """Elements per token of the keys and values attention reads (what context parallelism gathers)."""
    qk, v = head_dims(args)
    return args.n_heads * (qk + v) if args.mla else args.kv_heads * (qk + v)


def mla_linears(args: ModelArgs) -> list[tuple[str, int, int, int | None]]:
    """(name, out_features, in_features, dimension TP splits or None) of MLA's linears."""
    mla, h, heads = args.mla, args.dim, args.n_heads
    queries = (
        [("attention.wq_a", mla.q_lora_rank, h, None), ("attention.wq_b", heads * mla.qk_head_dim, mla.q_lora_rank, 0)]
        if mla.q_lora_rank
        else [("attention.wq", heads * mla.qk_head_dim, h, 0)]
    )
    return queries + [
        ("attention.wkv_a", mla.kv_lora_rank + mla.qk_rope_head_dim, h, None),
        ("attention.wkv_b", heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank, 0),
        ("attention.wo", h, heads * mla.v_head_dim, 1),
    ]


def latent_norms(args: ModelArgs) -> list[tuple[str, int]]:
    """(name, features) of MLA's latent RMSNorms (replicated over tp); none without MLA."""
    if not args.mla:
        return []
    return ([("attention.q_norm", args.mla.q_lora_rank)] if args.mla.q_lora_rank else []) + [
        ("attention.kv_norm", args.mla.kv_lora_rank)
    ]


def mla_elementwise_per_token(args: ModelArgs, compiled: bool) -> tuple[float, float]:
    """(what tp splits, what every tp rank does whole) of the elements one MLA forward reads and writes per token
    beyond the block's norms and residuals (the module docstring)."""
    mla, heads = args.mla, args.n_heads
    latents = mla.q_lora_rank + mla.kv_lora_rank
    if compiled:
        return ROPE_COMPILED * 2 * heads * mla.qk_head_dim, RMSNORM_COMPILED * latents
    split = ROPE_EAGER * heads * mla.qk_rope_head_dim + 2 * 2 * heads * mla.qk_head_dim
    return split, RMSNORM_EAGER * latents + ROPE_EAGER * mla.qk_rope_head_dim


def attention_activation_elements(args: ModelArgs, tp: int) -> tuple[float, float]:
    """(split over tp, whole) elements per token attention keeps for backward beyond the block's norm outputs:
    q, k, v, attention output and the output projection's input, and MLA's latents."""
    qk, v = head_dims(args)
    if not args.mla:
        return (args.n_heads * (qk + 2 * v) + 2 * args.kv_heads * qk) / tp, 0.0
    mla = args.mla
    latents = 2 * mla.q_lora_rank + 2 * mla.kv_lora_rank + mla.qk_rope_head_dim
    return args.n_heads * (2 * qk + 3 * v) / tp, float(latents)


def mtp_linears(args: ModelArgs) -> list[tuple[str, int, int, int | None]]:
    """The one linear an MTP module adds besides its block: the projection of [hidden; embedding] to dim."""
    return [("eh_proj", args.dim, 2 * args.dim, None)]


def mtp_norms() -> list[str]:
    """An MTP module's own RMSNorms (dim each): hidden, embedding, and its copy of the final norm."""
    return ["hnorm", "enorm", "norm"]


def mtp_is_moe(args: ModelArgs) -> bool:
    """An MTP block is an MoE block where the main model's next layer would be (DeepSeek-V3: layer 61)."""
    return args.is_moe_layer(args.n_layers)


def whole_sequence_refusal(args: ModelArgs, layout) -> str:
    """Why the trainer refuses the layout for an objective that needs whole sequences, or "" (trainer/assemble.py
    check_whole_sequences; tests/planner/test_deepseek_plan.py checks the two agree): DeepSeek-V3's sequence-wise
    balance loss under cp, multi-token prediction under pp, cp or tp."""
    if args.moe is not None and args.moe.seq_aux_loss_coef > 0 and layout.cp > 1:
        return (
            f"DeepSeek-V3's sequence-wise balance loss (seq_aux_loss_coef={args.moe.seq_aux_loss_coef:g}) counts "
            f"each whole sequence's expert choices, and this layout splits them over cp {layout.cp}. Plan with --cp 1."
        )
    parallel = [f"{axis} {getattr(layout, axis)}" for axis in ("pp", "cp", "tp") if getattr(layout, axis) > 1]
    if not (args.mtp_modules and parallel):
        return ""
    return (
        f"multi-token prediction (mtp_modules={args.mtp_modules}) runs only without pp, cp and tp, and this "
        f"layout has {', '.join(parallel)}. Plan it without MTP: --mtp-modules 0."
    )
