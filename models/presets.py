"""Model presets by name. GPT shapes are the Frontier study's (experiments/frontier/PAPER.md: GPT-2 BPE vocabulary
padded to 50,688, LayerNorm, GELU 4h, learned positions, untied output); Llama shapes are
Meta's published Llama 3 configurations; the mixtures of experts are their publishers' Hugging Face
config.json files (mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1, Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B,
meta-llama/Llama-4-Scout-17B-16E), and so are DeepSeek's family (deepseek-ai/DeepSeek-V2-Lite, DeepSeek-V3;
moonshotai/Moonlight-16B-A3B, Kimi-K2-Instruct)."""

import dataclasses

from trillion.errors import ConfigError
from trillion.models.args import MLAArgs, ModelArgs, MoEArgs, YaRNArgs

GPT_VOCAB = 50688
LLAMA3_VOCAB = 128256


def _gpt(n_layers: int, dim: int, n_heads: int, max_seq_len: int = 2048, vocab_size: int = GPT_VOCAB) -> ModelArgs:
    return ModelArgs(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        norm="layernorm",
        mlp="gelu",
        positions="learned",
        bias=True,
    )


def _llama(
    n_layers: int,
    dim: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int = LLAMA3_VOCAB,
    max_seq_len: int = 8192,
) -> ModelArgs:
    return ModelArgs(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        norm="rmsnorm",
        norm_eps=1e-5,
        mlp="swiglu",
        positions="rope",
        rope_theta=500000.0,
    )


def _mixtral(n_layers: int, dim: int, n_heads: int, ffn_dim: int, vocab_size: int, max_seq_len: int) -> ModelArgs:
    """Mistral's MoE: 8 SwiGLU experts of the dense width, top-2, softmax renormalised over the two."""
    llama = _llama(n_layers, dim, n_heads, 8, ffn_dim, vocab_size=vocab_size, max_seq_len=max_seq_len)
    return dataclasses.replace(llama, rope_theta=1e6, moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=ffn_dim))


def _qwen3_moe(n_layers: int, dim: int, n_heads: int, expert_ffn_dim: int) -> ModelArgs:
    """Qwen3's MoE: 128 experts, top-8 renormalised, no shared expert; 4 KV heads of 128, QK-norm."""
    llama = _llama(n_layers, dim, n_heads, 4, 3 * dim, vocab_size=151936, max_seq_len=40960)
    return dataclasses.replace(
        llama,
        rope_theta=1e6,
        norm_eps=1e-6,
        explicit_head_dim=128,
        qk_norm=True,
        moe=MoEArgs(n_experts=128, top_k=8, expert_ffn_dim=expert_ffn_dim),
    )


MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's weight of the multi-token prediction loss for its first 10T tokens


def _deepseek(
    n_layers: int,
    dim: int,
    n_heads: int,
    ffn_dim: int,
    vocab_size: int,
    max_seq_len: int,
    rope_theta: float,
    mla: MLAArgs,
    moe: MoEArgs,
    yarn: YaRNArgs | None = None,
    mtp_modules: int = 0,
    norm_eps: float = 1e-6,
) -> ModelArgs:
    """DeepSeek's block: multi-head latent attention, the first moe.n_dense_layers blocks a dense SwiGLU of
    ffn_dim, the rest routed experts plus shared ones; RMSNorm, no biases, untied output. No n_kv_heads: every
    head has its own key and value (from the latent), so overriding model.n_heads keeps them in step."""
    llama = _llama(n_layers, dim, n_heads, n_heads, ffn_dim, vocab_size=vocab_size, max_seq_len=max_seq_len)
    return dataclasses.replace(
        llama,
        n_kv_heads=None,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        mla=mla,
        moe=moe,
        yarn=yarn,
        mtp_modules=mtp_modules,
        mtp_loss_weight=MTP_LOSS_WEIGHT if mtp_modules else 0.0,
    )


# The published 16B pair: DeepSeek-V2-Lite (softmax scores, top-6 not renormalised, YaRN as released) and
# Moonlight (the same shape trained by Moonshot with DeepSeek-V3's sigmoid routing, no YaRN).
_MLA_LITE = MLAArgs(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_MLA_V3 = dataclasses.replace(_MLA_LITE, q_lora_rank=1536)
DEEPSEEK_V2_LITE = _deepseek(
    27, 2048, 16, 10944, vocab_size=102400, max_seq_len=163840, rope_theta=10000.0, mla=_MLA_LITE,
    moe=MoEArgs(n_experts=64, top_k=6, expert_ffn_dim=1408, n_shared_experts=2, n_dense_layers=1, route_norm=False),
    yarn=YaRNArgs(factor=40, original_max_seq_len=4096, mscale=0.707, mscale_all_dim=0.707),
)  # fmt: skip
MOONLIGHT_16B_A3B = _deepseek(
    27, 2048, 16, 11264, vocab_size=163840, max_seq_len=8192, rope_theta=50000.0, mla=_MLA_LITE,
    moe=MoEArgs(n_experts=64, top_k=6, expert_ffn_dim=1408, n_shared_experts=2, n_dense_layers=1,
                score_func="sigmoid", route_scale=2.446, bias_update_rate=1e-3),
    norm_eps=1e-5,
)  # fmt: skip
DEEPSEEK_V3_671B = _deepseek(
    61, 7168, 128, 18432, vocab_size=129280, max_seq_len=163840, rope_theta=10000.0, mla=_MLA_V3,
    moe=MoEArgs(n_experts=256, top_k=8, expert_ffn_dim=2048, n_shared_experts=1, n_dense_layers=3,
                score_func="sigmoid", route_scale=2.5, n_groups=8, topk_groups=4, bias_update_rate=1e-3,
                seq_aux_loss_coef=1e-4),  # the paper's balance factor alpha (section 4.2)
    yarn=YaRNArgs(factor=40, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=1.0),
    mtp_modules=1,
)  # fmt: skip
# Kimi K2 trained with MuonClip (--optimizer.name=muon --optimizer.qk_clip=100, lr 2e-4, weight decay 0.1; the whole
# recipe: experiments/configs/kimi_k2_muonclip.toml)
KIMI_K2 = _deepseek(
    61, 7168, 64, 18432, vocab_size=163840, max_seq_len=131072, rope_theta=50000.0, mla=_MLA_V3,
    moe=MoEArgs(n_experts=384, top_k=8, expert_ffn_dim=2048, n_shared_experts=1, n_dense_layers=1,
                score_func="sigmoid", route_scale=2.827, bias_update_rate=1e-3),
    yarn=YaRNArgs(factor=32, original_max_seq_len=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip
# debug-deepseek: the DeepSeek-V3 block at debug size (low-rank queries, group-limited sigmoid routing with the
# loss-free bias and the sequence-wise balance loss, a dense first block, one shared expert, one MTP module),
# trainable on a CPU in minutes.
DEBUG_DEEPSEEK = _deepseek(
    4, 256, 8, 704, vocab_size=320, max_seq_len=1024, rope_theta=10000.0,
    mla=MLAArgs(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=96),
    moe=MoEArgs(n_experts=8, top_k=2, expert_ffn_dim=256, n_shared_experts=1, n_dense_layers=1,
                score_func="sigmoid", route_scale=2.5, n_groups=4, topk_groups=2, bias_update_rate=1e-2,
                seq_aux_loss_coef=1e-4),
    mtp_modules=1,
)  # fmt: skip

# Llama 4 Scout (meta-llama/Llama-4-Scout-17B-16E config.json, text_config): 48 blocks of 5120, 40 query and 8 KV
# heads of 128 with QK-norm, every block a mixture of 16 SwiGLU experts of 8192, top-1 with sigmoid scores (not
# renormalised), and one shared expert of 8192; vocabulary 202,048, rope theta 500,000: 109B parameters, 17B active.
# A planning shape: its NoPE layers (every fourth) and chunked attention (8192 tokens) are not Trillion parts; at the
# 8192 tokens it trains on (torchtitan's runs) every layer's attention is causal over the same tokens, the same work.
# No Hugging Face family of Trillion's holds its shared expert, so it does not export (as debug-moe).
LLAMA4_SCOUT = dataclasses.replace(
    _llama(48, 5120, 40, 8, 16384, vocab_size=202048, max_seq_len=8192),
    explicit_head_dim=128,
    qk_norm=True,
    moe=MoEArgs(n_experts=16, top_k=1, expert_ffn_dim=8192, n_shared_experts=1, score_func="sigmoid", route_norm=False),
)

# debug-moe: the debug model's attention, its first block dense, then 8 experts (top-2) and one shared
# expert, routed as DeepSeek-V3 routes (sigmoid scores, the loss-free balancing bias) so the load
# statistics show balancing work. The bias rate is 10x DeepSeek-V3's 1e-3: a debug run is 100s of steps.
# Measured (100 steps, default corpus): without the bias every MoE layer collapses onto two experts (max/mean
# 4.0); softmax scores with the bias reach 1.6, sigmoid scores 1.3.
DEBUG_MOE = dataclasses.replace(
    _llama(4, 256, 8, 4, 704, vocab_size=320, max_seq_len=1024),
    moe=MoEArgs(
        n_experts=8,
        top_k=2,
        expert_ffn_dim=256,
        n_shared_experts=1,
        n_dense_layers=1,
        score_func="sigmoid",
        bias_update_rate=1e-2,
    ),
)

PRESETS: dict[str, ModelArgs] = {
    # Small enough to train visibly on two CPU cores; vocabulary fits the byte tokenizer (257 ids),
    # padded to a multiple of 64 so tensor-parallel degrees up to 64 divide it.
    "debug": _llama(4, 256, 8, 4, 704, vocab_size=320, max_seq_len=1024),
    "debug-gpt": _gpt(4, 256, 8, max_seq_len=1024, vocab_size=320),
    "gpt-125m": _gpt(12, 768, 12),
    "gpt-1.4b": _gpt(24, 2048, 32),  # the paper's tuning model (final shape)
    "gpt-22b": _gpt(48, 6144, 48),
    "gpt-175b": _gpt(96, 12288, 96),
    "gpt-1t": _gpt(128, 25600, 200),
    "llama3-1b": _llama(16, 2048, 32, 8, 8192),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248),
    "debug-moe": DEBUG_MOE,
    "mixtral-8x7b": _mixtral(32, 4096, 32, 14336, vocab_size=32000, max_seq_len=32768),
    "mixtral-8x22b": _mixtral(56, 6144, 48, 16384, vocab_size=32768, max_seq_len=65536),
    "qwen3-30b-a3b": _qwen3_moe(48, 2048, 32, 768),
    "qwen3-235b-a22b": _qwen3_moe(94, 4096, 64, 1536),
    "llama4-scout": LLAMA4_SCOUT,
    "debug-deepseek": DEBUG_DEEPSEEK,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "moonlight-16b-a3b": MOONLIGHT_16B_A3B,
    "deepseek-v3-671b": DEEPSEEK_V3_671B,
    "kimi-k2": KIMI_K2,
}


def get_preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ConfigError(f"model.name={name!r} is not a known preset. Use one of: {', '.join(PRESETS)}.")
    return PRESETS[name]


def expert_presets() -> list[str]:
    """The presets with routed experts, for the messages that point a user at one."""
    return [name for name, args in PRESETS.items() if args.moe is not None]
