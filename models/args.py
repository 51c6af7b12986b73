"""The shape of a model: plain data, importable without torch (the planner and the CLI read it
without paying for a torch import)."""

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts feed-forward (models/moe.py): E routed SwiGLU experts of which each token
    reaches top_k, optional shared experts every token passes, and the first n_dense_layers blocks dense."""

    n_experts: int
    top_k: int
    expert_ffn_dim: int  # each routed expert's hidden width
    n_shared_experts: int = 0  # shared experts' hidden width: n_shared_experts * expert_ffn_dim
    n_dense_layers: int = 0  # the first blocks keep the dense feed-forward (ModelArgs.ffn_dim)
    score_func: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    route_norm: bool = True  # renormalise the chosen experts' scores to sum to one
    route_scale: float = 1.0  # multiplies the routed output (DeepSeek-V3's routed_scaling_factor)
    n_groups: int = 1  # group-limited routing: experts in n_groups groups, tokens choose among topk_groups
    topk_groups: int = 1
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes ceil(cf * tokens * top_k / E) tokens
    # 0: dropless; else each of `capacity_ranks` groups of E / capacity_ranks experts (an ep rank's) takes at most
    # ceil(rcf * tokens * min(top_k, capacity_ranks) / capacity_ranks) tokens, the first in token order
    rank_capacity_factor: float = 0.0
    capacity_ranks: int = 1
    # with a per-rank capacity: the equal chunks of each sequence whose tokens reach it apart (the tp ranks, each
    # routing its own positions, when ep folds over them); a layer whose sequences are split over ranks holds one
    capacity_shards: int = 1
    aux_loss_coef: float = 0.0  # Switch/Mixtral load-balancing loss (0 = off)
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss, its alpha (0 = off)
    bias_update_rate: float = 0.0  # DeepSeek-V3 auxiliary-loss-free balancing bias step (0 = off)
    experts_impl: str = "auto"  # filled from kernels.grouped_gemm: auto | torch | loop
    permute_impl: str = "auto"  # filled from kernels.permutation: auto | triton | torch


@dataclass(frozen=True)
class MLAArgs:
    """DeepSeek's multi-head latent attention: keys and values from one compressed latent of kv_lora_rank
    (normed), queries through an optional low-rank projection; each query/key head is a qk_nope_head_dim part
    without positions and a qk_rope_head_dim rotary part (the key's shared by all heads); values v_head_dim."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries by one full projection (DeepSeek-V2-Lite, Moonlight)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class YaRNArgs:
    """YaRN rotary scaling (Peng et al. 2023) as DeepSeek's configs give it (`rope_scaling`, type yarn): the
    frequencies interpolated between beta_fast and beta_slow, and the softmax scale multiplied by mscale^2."""

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


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
    explicit_head_dim: int | None = None  # None: dim // n_heads (Qwen3 sets it wider)
    qk_norm: bool = False  # RMSNorm over each query and key head before rotary positions (Qwen3)
    moe: MoEArgs | None = None  # None: every block dense
    mla: MLAArgs | None = None  # None: grouped-query attention; else multi-head latent attention
    yarn: YaRNArgs | None = None  # None: plain rotary frequencies
    mtp_modules: int = 0  # DeepSeek-V3's multi-token prediction modules (training only; 0 = off)
    mtp_loss_weight: float = 0.0  # the weight of their mean extra loss (DeepSeek-V3: 0.3, later 0.1)
    attention: str = ""  # a models/parts ATTENTION_KINDS name; "": "mla" with `mla` set, else "gqa"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index >= self.moe.n_dense_layers

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_dim or 4 * self.dim
