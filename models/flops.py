"""Parameter and FLOP accounting (experiments/frontier/PAPER.md "FLOPs formulas").

Model FLOPs (MFU): 6 * (N - N_emb) + 12 * L * H * T per token, as PaLM, nanoGPT and torchtitan
count them: no causal discount, no recompute. Hardware FLOPs (HFU) add the recomputed forward
pass. The Megatron formula (Narayanan et al. 2021, eq. 3) is what the Frontier paper reports.
"""

from dataclasses import dataclass

from trillion.models.args import ModelArgs


@dataclass(frozen=True)
class ParamCount:
    total: int
    embedding: int  # token and learned-position tables: lookups, no matmul FLOPs

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_params(args: ModelArgs) -> ParamCount:
    """Exact parameter count of `Transformer(args)`, without building it."""
    d, kv = args.dim, args.kv_heads * args.head_dim
    bias = args.bias
    attention = d * d + 2 * d * kv + d * d + (d + 2 * kv + d if bias else 0)
    n_mlp_in = 2 if args.mlp == "swiglu" else 1
    mlp = (n_mlp_in + 1) * d * args.ffn_hidden + ((n_mlp_in * args.ffn_hidden + d) if bias else 0)
    norm = d * (2 if args.norm == "layernorm" and bias else 1)
    block = attention + mlp + 2 * norm
    embedding = args.vocab_size * d + (args.max_seq_len * d if args.positions == "learned" else 0)
    output = 0 if args.tie_embeddings else args.vocab_size * d
    return ParamCount(total=args.n_layers * block + embedding + norm + output, embedding=embedding)


def model_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Forward + backward FLOPs per token. A tied output matrix still costs its matmul."""
    params = count_params(args)
    matmul_params = params.non_embedding + (args.vocab_size * args.dim if args.tie_embeddings else 0)
    return 6 * matmul_params + 12 * args.n_layers * args.dim * seq_len


def hardware_flops_per_token(args: ModelArgs, seq_len: int, recompute_fraction: float) -> float:
    """Model FLOPs plus the forward pass recomputed under activation checkpointing.

    recompute_fraction: share of the blocks whose forward runs twice (1.0 = full checkpointing).
    The forward is a third of the model FLOPs of a block; the output layer is never recomputed.
    This is the Megatron convention (a whole forward per checkpointed block); PyTorch's
    non-reentrant checkpoint stops recomputing once the saved tensors backward needs are back,
    so it skips each block's last matmul and the true figure is slightly lower.
    """
    block_forward = 2 * count_blocks_matmul_params(args) + 4 * args.n_layers * args.dim * seq_len
    return model_flops_per_token(args, seq_len) + recompute_fraction * block_forward


def count_blocks_matmul_params(args: ModelArgs) -> int:
    params = count_params(args)
    output = args.vocab_size * args.dim
    final_norm = args.dim * (2 if args.norm == "layernorm" and args.bias else 1)
    return params.non_embedding - final_norm - (0 if args.tie_embeddings else output)


def megatron_flops_per_iteration(args: ModelArgs, batch: int, seq_len: int, recompute: bool) -> float:
    """Narayanan et al. eq. 3: 24 k B s L h^2 (1 + s/(6h) + V/(16 L h)), k = 4 with full recompute."""
    k = 4 if recompute else 3
    h, layers = args.dim, args.n_layers
    return 24 * k * batch * seq_len * layers * h * h * (1 + seq_len / (6 * h) + args.vocab_size / (16 * layers * h))
