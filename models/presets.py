"""Model presets by name. GPT shapes are the Frontier study's (experiments/frontier/PAPER.md: GPT-2 BPE vocabulary
padded to 50,688, LayerNorm, GELU 4h, learned positions, untied output); Llama shapes are
Meta's published Llama 3 configurations; the mixtures of experts are their publishers' Hugging Face
config.json files (mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1, Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B)."""

import dataclasses

from trillion.errors import ConfigError
from trillion.models.args import ModelArgs, MoEArgs

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
}


def get_preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ConfigError(f"model.name={name!r} is not a known preset. Use one of: {', '.join(PRESETS)}.")
    return PRESETS[name]
