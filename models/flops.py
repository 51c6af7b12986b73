"""Parameter and FLOP accounting (experiments/frontier/PAPER.md "FLOPs formulas").

Model FLOPs (MFU): 6 * (N - N_emb) + 12 * L * H * T per token, as PaLM, nanoGPT and torchtitan
count them: no causal discount, no recompute (latent attention: 6 * L * heads * (qk + v head dims) * T
in place of the last term, its scores at 192 and its values at 128 for DeepSeek-V3). Hardware FLOPs
(HFU) add the recomputed forward pass. The Megatron formula (Narayanan et al. 2021, eq. 3) is what the
Frontier paper reports.

Under document masking (data.document_mask) attention works within each document only: a window of T
tokens holding documents of lengths l_i costs sum(l_i^2) query-key pairs instead of T^2 (causal halves
both), so the attention term takes `attention_share` = sum(l_i^2) / T^2, measured per batch by the trainer
and expected from a corpus's document lengths by the planner (DocumentLengths).
"""

import dataclasses
from dataclasses import dataclass

import numpy as np

from trillion.models import parts
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
    """Exact parameter count of `Transformer(args)`, without building it: the sum of its parts' declarations."""
    blocks = inactive = 0
    for index in range(args.n_layers + args.mtp_modules):  # a multi-token prediction block numbers on
        block = parts.layer_block(args, index)
        blocks += block.numel
        inactive += block.inactive_numel
    count, ahead = parts.ahead_modules(args)
    mtp = count * ahead.numel if count else 0  # each module's norms and projection besides its block
    root = parts.model_root(args)
    output = 0 if root.tied else root.output.numel
    embedding = root.embedding_numel
    return ParamCount(total=blocks + mtp + embedding + root.norm.numel + output, embedding=embedding, inactive=inactive)


def attention_width(args: ModelArgs) -> int:
    """A head's query-key width plus its value width: what one query-key pair's two matmuls cost per
    FLOP pair (2 x head_dim, or MLA's qk_head_dim + v_head_dim: 192 + 128 for DeepSeek-V3)."""
    heads = parts.block(args).heads
    return heads.qk_head_dim + heads.v_head_dim


def _query_heads(args: ModelArgs) -> int:
    return parts.block(args).heads.heads


def model_flops_per_token(args: ModelArgs, seq_len: int, attention_share: float = 1.0) -> float:
    """Forward + backward FLOPs per token, from the active parameters (a token's top_k routed experts,
    the shared experts and the router; torchtitan's and Megatron's MoE convention). A tied output
    matrix still costs its matmul; so does the output head each multi-token prediction module shares.
    `attention_share`: the attention work document masking leaves (the module docstring)."""
    params = count_params(args)
    head_uses = (1 if args.tie_embeddings else 0) + args.mtp_modules
    matmul_params = params.non_embedding - params.inactive + head_uses * args.vocab_size * args.dim
    blocks = args.n_layers + args.mtp_modules
    return 6 * matmul_params + 6 * blocks * _query_heads(args) * attention_width(args) * seq_len * attention_share


def hardware_flops_per_token(
    args: ModelArgs, seq_len: int, recompute_fraction: float, attention_share: float = 1.0
) -> float:
    """Model FLOPs plus the forward pass recomputed under activation checkpointing.

    recompute_fraction: share of the blocks whose forward runs twice (1.0 = full checkpointing).
    The forward is a third of the model FLOPs of a block; the output layer is never recomputed.
    This is the Megatron convention (a whole forward per checkpointed block); PyTorch's
    non-reentrant checkpoint stops recomputing once the saved tensors backward needs are back,
    so it skips each block's last matmul and the true figure is slightly lower.
    """
    attention_scores = 2 * args.n_layers * _query_heads(args) * attention_width(args) * seq_len * attention_share
    block_forward = 2 * count_blocks_matmul_params(args) + attention_scores
    return model_flops_per_token(args, seq_len, attention_share) + recompute_fraction * block_forward


def unit_flops_per_token(args: ModelArgs, seq_len: int) -> list[float]:
    """Forward + backward FLOPs per token of each pipeline unit (parallel/pp_layout.py): the embedding (a lookup:
    none), each layer (its active parameters and attention), and the output end: the head and each multi-token
    prediction module (its block, its projection and the head again)."""
    attention = 6 * _query_heads(args) * attention_width(args) * seq_len

    def layer(index: int) -> float:
        block = parts.layer_block(args, index)
        return 6 * (block.numel - block.inactive_numel) + attention

    head = 6 * args.vocab_size * args.dim
    count, ahead = parts.ahead_modules(args)
    modules = count * (layer(args.n_layers) + 6 * ahead.numel + head) if count else 0.0
    return [0.0, *(layer(index) for index in range(args.n_layers)), head + modules]


def count_blocks_matmul_params(args: ModelArgs) -> int:
    """The trunk's blocks' parameters one token's forward multiplies by (active ones only; activation
    checkpointing recomputes these, never the multi-token prediction modules)."""
    params = count_params(dataclasses.replace(args, mtp_modules=0))
    root = parts.model_root(args)
    output = 0 if root.tied else root.output.numel
    return params.non_embedding - params.inactive - root.norm.numel - output


def megatron_flops_per_iteration(args: ModelArgs, batch: int, seq_len: int, recompute: bool) -> float:
    """Narayanan et al. eq. 3: 24 k B s L h^2 (1 + s/(6h) + V/(16 L h)), k = 4 with full recompute."""
    k = 4 if recompute else 3
    h, layers = args.dim, args.n_layers
    return 24 * k * batch * seq_len * layers * h * h * (1 + seq_len / (6 * h) + args.vocab_size / (16 * layers * h))


# DocumentLengths' bins: quarter octaves, from length 1
BINS_PER_OCTAVE = 4


@dataclass(frozen=True)
class DocumentLengths:
    """A corpus's document lengths in tokens (EOS included), as `trillion prepare-data` measures them: per bin of a
    quarter octave, the documents' count and the sums of their lengths, squares and cubes, which is what the
    attention work of documents packed into windows of any length needs."""

    counts: tuple[float, ...]
    sums: tuple[tuple[float, ...], ...]  # per bin: (sum l, sum l^2, sum l^3)

    @classmethod
    def measure(cls, lengths) -> "DocumentLengths":
        lengths = np.asarray(lengths, dtype=np.float64)
        bins = np.floor(np.log2(np.maximum(lengths, 1)) * BINS_PER_OCTAVE + 1e-9).astype(np.int64)
        size = int(bins.max()) + 1 if len(bins) else 0
        counts = np.bincount(bins, minlength=size)
        sums = [tuple(np.bincount(bins, weights=lengths**p, minlength=size).tolist()) for p in (1, 2, 3)]
        return cls(tuple(counts.astype(float).tolist()), tuple(zip(*sums)))

    @classmethod
    def from_json(cls, data: dict) -> "DocumentLengths":
        return cls(tuple(data["counts"]), tuple(tuple(s) for s in data["sums"]))

    def to_json(self) -> dict:
        return {"bins_per_octave": BINS_PER_OCTAVE, "counts": list(self.counts), "sums": [list(s) for s in self.sums]}

    @property
    def documents(self) -> int:
        return int(sum(self.counts))

    @property
    def tokens(self) -> float:
        return sum(s[0] for s in self.sums)

    def quantile(self, q: float) -> int:
        """About the length below which a share q of the documents lie (a bin's mean length)."""
        cumulative = np.cumsum(self.counts)
        index = int(np.searchsorted(cumulative, q * cumulative[-1]))
        return round(self.sums[index][0] / max(self.counts[index], 1))

    def attention_share(self, seq_len: int) -> float:
        """Attention within documents over attention over whole windows, for these documents packed end to end into
        windows of seq_len at a random offset: two tokens d apart share a window with probability 1 - d / S, so a
        document of length l costs l^2 - l^3 / (3 S) pairs below S and l S - S^2 / 3 above, against S per token
        unmasked. A bin on both sides of S counts by its mean length's side."""
        pairs = 0.0
        for count, (total, squares, cubes) in zip(self.counts, self.sums):
            if count and total / count <= seq_len:
                pairs += squares - cubes / (3 * seq_len)
            elif count:
                pairs += total * seq_len - count * seq_len**2 / 3
        return min(1.0, pairs / max(self.tokens * seq_len, 1.0))

    def describe(self, seq_lens=(2048, 4096, 8192, 32768, 131072)) -> str:
        shares = ", ".join(f"{s}: {100 * self.attention_share(s):.1f}%" for s in seq_lens)
        return (
            f"{self.documents} documents, mean {self.tokens / max(self.documents, 1):.0f} tokens, median ~"
            f"{self.quantile(0.5)}, 90% under ~{self.quantile(0.9)}; attention under document masking, share of "
            f"the unmasked by window length: {shares}"
        )
