"""Model presets by name. GPT shapes are the Frontier study's (experiments/frontier/PAPER.md: GPT-2 BPE vocabulary
padded to 50,688, LayerNorm, GELU 4h, learned positions, untied output); Llama shapes are
Meta's published Llama 3 configurations."""

from trillion.errors import ConfigError
from trillion.models.args import ModelArgs

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
}


def get_preset(name: str) -> ModelArgs:
    if name not in PRESETS:
        raise ConfigError(f"model.name={name!r} is not a known preset. Use one of: {', '.join(PRESETS)}.")
    return PRESETS[name]
