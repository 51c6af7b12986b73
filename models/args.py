"""The shape of a model: plain data, importable without torch (the planner and the CLI read it
without paying for a torch import)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArgs:
    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int
    max_seq_len: int
    n_kv_heads: int | None = None  # None: as many as query heads (plain multi-head attention)
    ffn_dim: int | None = None  # None: 4 * dim
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    norm_eps: float = 1e-5
    mlp: str = "swiglu"  # swiglu | gelu (tanh approximation, as GPT-2 and Megatron's fused bias-GeLU)
    positions: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    bias: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention_impl: str = "sdpa"  # filled from the `kernels` config section
    norm_impl: str = "torch"  # torch | triton (kernels/norm.py: same parameters, fused kernels)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_dim or 4 * self.dim
