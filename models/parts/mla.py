"""Multi-head latent attention (models/mla.py MLAttention; DeepSeek-V2, arXiv 2405.04434 section 2.1), declared.

queries      q_lora_rank > 0: wq_a (dim -> q_lora_rank), its RMSNorm q_norm, wq_b (q_lora_rank -> heads x
             qk_head_dim); else one wq (dim -> heads x qk_head_dim)
keys, values wkv_a (dim -> kv_lora_rank + qk_rope_head_dim): the latent and the rotary key part all heads share;
             the latent's RMSNorm kv_norm; wkv_b (kv_lora_rank -> heads x (qk_nope_head_dim + v_head_dim))
output       wo (heads x v_head_dim -> dim)
logits       a head's logit is its no-position query rows (of wq_b or wq) against its key rows of wkv_b, plus its
             rotary query rows against the rotary key all heads share (from wkv_a, which QK-clip leaves alone: the
             Kimi K2 report, arXiv 2507.20534, on MuonClip)
TP           splits heads (wq_b or wq and wkv_b column-wise, wo row-wise); the down projections and the latent
             norms stay whole on every tp rank, as torchtitan's DeepSeek-V3 plan keeps them (NoParallel), so each
             tp rank runs them on the whole gathered sequence; its tensors stay DTensors up to `attend`.
attention    per head QK^T at qk_head_dim and PV at v_head_dim; every head reads its own expanded key and value.
saved        beyond the block's norms: the query latent before and after its norm (q_lora_rank each) and the
             key/value latent before and after its norm (kv_lora_rank each) with the rotary key part, all whole;
             per head q and k at qk_head_dim, v, the attention output and wo's input at v_head_dim. DeepSeek's
             recompute mode recomputes the up-projections wq_b and wkv_b (and the normed latents, q, k, v and wo's
             input from them) and keeps the latents and the attention's output.
element-wise (eager, per token) the two latent norms as RMSNorm decomposes, rotary on the query's and the
             shared key's rotary parts, and q and k assembled from their no-position and rotary parts (read and
             write heads x qk_head_dim each); compiled: each chain once (per latent feature, per element of q, k).
"""

from trillion.errors import ConfigError
from trillion.models.args import ModelArgs
from trillion.models.parts.counts import RMSNORM_COMPILED, RMSNORM_EAGER, ROPE_COMPILED, ROPE_EAGER
from trillion.models.parts.settings import PartSettings
from trillion.models.parts.spec import (
    COLUMN,
    DTENSOR_HEADS,
    REPLICATED,
    ROW,
    Divides,
    HeadRows,
    Heads,
    Linear,
    LogitTerm,
    Norm,
    Part,
    PerToken,
)


def _linears(args: ModelArgs) -> tuple[Linear, ...]:
    mla, h, heads = args.mla, args.dim, args.n_heads
    queries = (
        (
            Linear("attention.wq_a", h, mla.q_lora_rank, REPLICATED),
            Linear("attention.wq_b", mla.q_lora_rank, heads * mla.qk_head_dim, COLUMN),
        )
        if mla.q_lora_rank
        else (Linear("attention.wq", h, heads * mla.qk_head_dim, COLUMN),)
    )
    return queries + (
        Linear("attention.wkv_a", h, mla.kv_lora_rank + mla.qk_rope_head_dim, REPLICATED),
        Linear("attention.wkv_b", mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), COLUMN),
        Linear("attention.wo", heads * mla.v_head_dim, h, ROW),
    )


def _norms(args: ModelArgs) -> tuple[Norm, ...]:
    mla = args.mla
    query = (Norm("attention.q_norm", mla.q_lora_rank),) if mla.q_lora_rank else ()
    return query + (Norm("attention.kv_norm", mla.kv_lora_rank),)


def _logit_terms(args: ModelArgs) -> tuple[LogitTerm, ...]:
    mla = args.mla
    query = "attention.wq_b" if mla.q_lora_rank else "attention.wq"
    nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    key = HeadRows("attention.wkv_b", nope + mla.v_head_dim, 0, nope)
    return (
        LogitTerm(HeadRows(query, mla.qk_head_dim, 0, nope), key),
        LogitTerm(HeadRows(query, mla.qk_head_dim, nope, rope), None),
    )


def declare(args: ModelArgs) -> Part:
    mla, heads = args.mla, args.n_heads
    qk, v = mla.qk_head_dim, mla.v_head_dim
    latents = mla.q_lora_rank + mla.kv_lora_rank
    return Part(
        module="attention",
        linears=_linears(args),
        norms=_norms(args),
        heads=Heads(heads, heads, qk, v),
        saved=PerToken(heads * (2 * qk + 3 * v), float(2 * latents + mla.qk_rope_head_dim)),
        eager=PerToken(
            ROPE_EAGER * heads * mla.qk_rope_head_dim + 2 * 2 * heads * qk,
            RMSNORM_EAGER * latents + ROPE_EAGER * mla.qk_rope_head_dim,
        ),
        compiled=PerToken(ROPE_COMPILED * 2 * heads * qk, RMSNORM_COMPILED * latents),
        tp_style=DTENSOR_HEADS,
        tp_divides=(Divides("model.n_heads", heads, "query heads"),),
        logit_terms=_logit_terms(args),
        up_projections=("attention.wq_b", "attention.wkv_b") if mla.q_lora_rank else ("attention.wkv_b",),
        # recomputed from the kept latents: the normed latents, q (from wq_b), k and v (from wkv_b) and wo's input
        # (the attention's output, transposed); kept: the latents, the rotary key part, the attention's output
        recomputed=PerToken(heads * ((2 if mla.q_lora_rank else 1) * qk + 2 * v), float(latents)),
    )


def check_settings(args: ModelArgs, settings: PartSettings) -> ModelArgs:
    """model.n_kv_heads has no meaning for latent attention: refused."""
    if args.mla is not None and settings.attention.n_kv_heads > 0:
        raise ConfigError(
            f"model.n_kv_heads={settings.attention.n_kv_heads} does not apply to {settings.model_name!r}: its latent "
            "attention gives every query head its own key and value, expanded from one shared latent. Drop "
            "--model.n_kv_heads."
        )
    return args
