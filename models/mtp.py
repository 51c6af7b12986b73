"""DeepSeek-V3's multi-token prediction (arXiv 2412.19437, section 2.2), a training-only extra objective.

Module k (k = 1..D) sees, at each position i, the previous depth's hidden state (for k = 1 the trunk's final one,
after its final norm: what its head reads, as Megatron-Core's MTP and the serving engines feed it) and the
embedding of token i + k, and predicts token i + k + 1:

    h_k = Block_k(eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})]))    logits_k = Head(norm_k(h_k))

sharing the trunk's embedding and output head. The concatenation puts the embedding first, as the published
checkpoint's `eh_proj` is laid out (its layer 61: enorm, hnorm, eh_proj, the block, shared_head.norm) and as the
serving engines that load it read it; the paper writes the two the other way round.

Every depth runs at the trunk's length and positions (as Megatron-Core's MTP rolls its inputs rather than
cutting them): position i of depth k reads the token k further on, `ahead[..., k - 1]` (`lookahead_tokens`),
built from the labels before the batch is split, so a rank holding only part of each sequence (context
parallelism) or only the model's last stage (a pipeline) has every token it needs where it needs it. The last k
positions, past the window, read token 0 and predict nothing (their labels are ignored); attention is causal,
so they change no other position, though their tokens do count in the depth's MoE statistics. Evaluation,
generation and export use the trunk's head only (Transformer.forward without `ahead`).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trillion.models.attention import with_documents


class MultiTokenPrediction(nn.Module):
    """One depth: (previous hidden (batch, n, dim), embedded later tokens (batch, n, dim)) -> (its hidden, the
    same normed for the head), each (batch, n, dim); the norm inside the forward, where FSDP has gathered the
    module's parameters. `block` is a block built for this depth's layer index; `make_norm` the model's norm."""

    def __init__(self, dim: int, block: nn.Module, make_norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = make_norm()  # before the shared head (the checkpoint's shared_head.norm)

    def forward(
        self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor | None, document_ids=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        h = self.block(h, rope, **with_documents(document_ids))
        return h, self.norm(h)


def predict_ahead(
    modules: nn.ModuleDict,
    embed: nn.Module,
    head: nn.Module,
    ahead: torch.Tensor,
    h: torch.Tensor,
    rope,
    document_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Each depth's logits (batch, seq, vocab): position i of depth k predicts token i + k + 1 from the trunk's final
    hidden states `h` (after its final norm) and `ahead[..., k - 1]`, the token k further on (batch, seq, D). Each
    depth runs at the trunk's positions, so its attention takes the trunk's `document_ids` as they are."""
    logits = []
    for depth, module in enumerate(modules.values(), start=1):
        h, normed = module(h, embed(ahead[..., depth - 1]), rope, document_ids)
        logits.append(head(normed))
    return logits


def lookahead_labels(labels: torch.Tensor, depths: int, ignore_index: int) -> torch.Tensor:
    """(batch, seq) labels -> (batch, seq, 1 + depths): column j holds the label j positions further on (column 0
    the trunk's own), `ignore_index` past the window's end. Depth k predicts column k and reads column k - 1."""
    columns = [labels] + [F.pad(labels[:, j:], (0, j), value=ignore_index) for j in range(1, depths + 1)]
    return torch.stack(columns, dim=-1)


def lookahead_tokens(stacked: torch.Tensor) -> torch.Tensor:
    """The tokens the depths read, `ahead` of Transformer.forward: (batch, seq, depths) from the stacked labels
    (an ignored label reads token 0)."""
    return stacked[..., :-1].clamp(min=0)
