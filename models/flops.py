"""Parameter and FLOP accounting (experiments/frontier/PAPER.md "FLOPs formulas").

Model FLOPs (MFU): 6 * (N - N_emb) + 12 * L * H * T per token, as PaLM, nanoGPT and torchtitan
count them: no causal discount, no recompute (latent attention: 6 * L * heads * (qk + v head dims) * T
in place of the last term, its scores at 192 and its values at 128 for DeepSeek-V3). Hardware FLOPs
(HFU) add the recomputed forward pass. The Megatron formula (Narayanan et al. 2021, eq. 3) is what the
Frontier paper reports.
"""

import dataclasses
from dataclasses import dataclass

from trillion.models.args import ModelArgs


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token and learned-position tables: lookups, no matmul FLOPs
    inactive: int = 0  # routed experts a token does not reach: (E - top_k) experts per MoE layer

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding

    @property
    def active(self) -> int:
        """What one token's forward touches: every parameter but the routed experts it skips."""
        return self.total - self.inactive


def count_params(args: ModelArgs) -> ParamCount:
    """Exact parameter count of `Transformer(args)`, without building it."""
    d = args.dim
    bias = args.bias
    attention = _attention_params(args)
    norm = d * (2 if args.norm == "layernorm" and bias else 1)
    blocks = inactive = 0
    for index in range(args.n_layers + args.mtp_modules):  # a multi-token prediction block numbers on
        blocks += attention + 2 * norm
        if args.is_moe_layer(index):
            moe = args.moe
            expert = 3 * d * moe.expert_ffn_dim
            blocks += moe.n_experts * expert + d * moe.n_experts + _mlp(args, moe.n_shared_experts * moe.expert_ffn_dim)
            inactive += (moe.n_experts - moe.top_k) * expert
        else:
            blocks += _mlp(args, args.ffn_hidden)
    embedding = args.vocab_size * d + (args.max_seq_len * d if args.positions == "learned" else 0)
    output = 0 if args.tie_embeddings else args.vocab_size * d
    mtp = args.mtp_modules * (3 * norm + 2 * d * d)  # each MTP block's enorm, hnorm, final norm and eh_proj
    return ParamCount(total=blocks + mtp + embedding + norm + output, embedding=embedding, inactive=inactive)


def _attention_params(args: ModelArgs) -> int:
    """One block's attention: grouped-query (q, k, v, o, biases, QK-norm), or latent (models/mla.py)."""
    d, mla = args.dim, args.mla
    if mla is not None:
        heads = args.n_heads
        q = d * heads * mla.qk_head_dim
        if mla.q_lora_rank:  # down projection, its norm, up projection
            q = d * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
        kv = d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
        kv += mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        return q + kv + heads * mla.v_head_dim * d
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    bias = (q + 2 * kv + d) if args.bias else 0
    return 2 * d * q + 2 * d * kv + bias + (2 * args.head_dim if args.qk_norm else 0)


def attention_width(args: ModelArgs) -> int:
    """A head's query-key width plus its value width: what one query-key pair's two matmuls cost per
    FLOP pair (2 x head_dim, or MLA's qk_head_dim + v_head_dim: 192 + 128 for DeepSeek-V3)."""
    return args.mla.qk_head_dim + args.mla.v_head_dim if args.mla is not None else 2 * args.head_dim


def _mlp(args: ModelArgs, hidden: int) -> int:
    n_in = 2 if args.mlp == "swiglu" else 1
    return (n_in + 1) * args.dim * hidden + ((n_in * hidden + args.dim) if args.bias else 0)


def model_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Forward + backward FLOPs per token, from the active parameters (a token's top_k routed experts,
    the shared experts and the router; torchtitan's and Megatron's MoE convention). A tied output
    matrix still costs its matmul; so does the output head each multi-token prediction module shares."""
    params = count_params(args)
    head_uses = (1 if args.tie_embeddings else 0) + args.mtp_modules
    matmul_params = params.non_embedding - params.inactive + head_uses * args.vocab_size * args.dim
    blocks = args.n_layers + args.mtp_modules
    return 6 * matmul_params + 6 * blocks * args.n_heads * attention_width(args) * seq_len


def hardware_flops_per_token(args: ModelArgs, seq_len: int, recompute_fraction: float) -> float:
    """Model FLOPs plus the forward pass recomputed under activation checkpointing.

    recompute_fraction: share of the blocks whose forward runs twice (1.0 = full checkpointing).
    The forward is a third of the model FLOPs of a block; the output layer is never recomputed.
    This is the Megatron convention (a whole forward per checkpointed block); PyTorch's
    non-reentrant checkpoint stops recomputing once the saved tensors backward needs are back,
    so it skips each block's last matmul and the true figure is slightly lower.
    """
    attention_scores = 2 * args.n_layers * args.n_heads * attention_width(args) * seq_len
    block_forward = 2 * count_blocks_matmul_params(args) + attention_scores
    return model_flops_per_token(args, seq_len) + recompute_fraction * block_forward


def count_blocks_matmul_params(args: ModelArgs) -> int:
    """The trunk's blocks' parameters one token's forward multiplies by (active ones only; activation
    checkpointing recomputes these, never the multi-token prediction modules)."""
    params = count_params(dataclasses.replace(args, mtp_modules=0))
    output = args.vocab_size * args.dim
    final_norm = args.dim * (2 if args.norm == "layernorm" and args.bias else 1)
    return params.non_embedding - params.inactive - final_norm - (0 if args.tie_embeddings else output)


def megatron_flops_per_iteration(args: ModelArgs, batch: int, seq_len: int, recompute: bool) -> float:
    """Narayanan et al. eq. 3: 24 k B s L h^2 (1 + s/(6h) + V/(16 L h)), k = 4 with full recompute."""
    k = 4 if recompute else 3
    h, layers = args.dim, args.n_layers
    return 24 * k * batch * seq_len * layers * h * h * (1 + seq_len / (6 * h) + args.vocab_size / (16 * layers * h))
