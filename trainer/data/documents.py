"""The documents inside packed windows (data.document_mask, data.reset_positions, eval.document_mask).

Every window comes with its document ids, one per token, non-decreasing along the window, a new id where a
document starts: the packer records them (windows.py), a token store gives them from its document offsets
(prepared.py, no re-tokenizing). Here they become what the model takes beside the tokens (a MicroBatch's
`document_ids`, and `positions` restarting at each document), and the attention work the mask leaves, which the
MFU counts (models/flops.py)."""

import torch

from trillion.parallel.forward_backward import MicroBatch


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) -> each token's position within its document (a run of equal ids), from 0."""
    positions = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return positions - torch.where(starts, positions, 0).cummax(dim=1).values


def attention_share(document_ids: torch.Tensor) -> float:
    """The attention work within documents over that of whole sequences: the sum over documents of their squared
    lengths over the sum of the sequences' squared lengths (batch, seq)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run = starts.cumsum(dim=1)  # a run's number within its row, from 1
    lengths = torch.zeros(document_ids.shape[0], document_ids.shape[1] + 1, dtype=torch.long)
    lengths.scatter_add_(1, run.cpu(), torch.ones_like(run, device="cpu"))
    return float(lengths.square().sum()) / (document_ids.numel() * document_ids.shape[1])


def window_micro_batches(
    windows: torch.Tensor, document_ids: torch.Tensor | None, micro_batch_size: int, *, mask: bool, reset: bool
) -> list:
    """Windows (count, seq + 1) as micro-batches of (inputs, labels); with masking or the position reset, a
    MicroBatch carrying the inputs' document ids or positions (from `document_ids`, the windows')."""
    if not (mask or reset):
        return [(w[:, :-1], w[:, 1:]) for w in windows.split(micro_batch_size)]
    return [
        MicroBatch(
            w[:, :-1],
            w[:, 1:],
            document_ids=ids[:, :-1] if mask else None,
            positions=positions_in_documents(ids[:, :-1]) if reset else None,
        )
        for w, ids in zip(windows.split(micro_batch_size), document_ids.split(micro_batch_size))
    ]


def step_attention_share(micro_batches) -> float:
    """attention_share over a step's micro-batches (1.0 where they carry no document ids: nothing is masked)."""
    shares = [attention_share(ids) for mb in micro_batches if (ids := getattr(mb, "document_ids", None)) is not None]
    return sum(shares) / len(shares) if shares else 1.0
