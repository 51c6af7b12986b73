"""DeepSeek-V3's multi-token prediction (arXiv 2412.19437, section 2.2), a training-only extra objective.

Module k (k = 1..D) sees, at each position i, the previous depth's hidden state (for k = 1 the trunk's final one,
after its final norm: what its head reads, as Megatron-Core's MTP and the serving engines feed it) and the
embedding of token i + k, and predicts token i + k + 1:

    h_k = Block_k(eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1})]))    logits_k = Head(norm_k(h_k))

sharing the trunk's embedding and output head. The concatenation puts the embedding first, as the published
checkpoint's `eh_proj` is laid out (its layer 61: enorm, hnorm, eh_proj, the block, shared_head.norm) and as the
serving engines that load it read it; the paper writes the two the other way round. Depth k covers seq - k
positions of a window, so its labels are the window's shifted k more. Evaluation, generation and export use the
trunk's head only (Transformer.forward without `with_mtp`).
"""

from collections.abc import Callable

import torch
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
    tokens: torch.Tensor,
    h: torch.Tensor,
    rope,
    document_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Each depth's logits, depth k's of shape (batch, seq - k, vocab): position i predicts token i + k + 1 from
    the trunk's final hidden states `h` (after its final norm) and `tokens` (batch, seq). The rotary table's first
    positions serve each depth, whose position i is the trunk's; so do the trunk's `document_ids`."""
    logits = []
    for depth, module in enumerate(modules.values(), start=1):
        ids = None if document_ids is None else document_ids[:, : tokens.shape[1] - depth]
        h, normed = module(h[:, :-1], embed(tokens[:, depth:]), rope, ids)
        logits.append(head(normed))
    return logits
