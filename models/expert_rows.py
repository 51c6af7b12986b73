"""Rows through the routed experts (models/moe.py's RoutedExperts): each row's chosen experts run and their outputs
return to it, weighted and summed. One process runs every token here (MoE.dispatch); under expert parallelism each
rank runs the rows that arrived for its experts (parallel/expert_parallel.py).
"""

import torch
from torch import nn

from trillion.kernels.permute import inverse_order, permute, unpermute


def run_experts(
    experts: nn.Module,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    held: range | None = None,
    slots: int | None = None,
    sources: list[int] | None = None,
):
    """(R, dim) rows, each with top_k slots of expert ids (R, top_k; -1: none) and weights -> (R, dim) each row's
    weighted sum over its slots of the experts' outputs; `experts` holds the experts `held` (all by default), which
    every slot's id is one of. The slots are sorted by expert (no per-token Python), the experts run as one grouped
    GEMM per projection, and the weighted outputs return to row order: with every slot, by the fused permutation
    (kernels/permute.py, kernels.permutation). `slots` (expert parallelism's receivers, whose rows hold few of their
    top_k slots here): how many slots are filled at most; only that many rows are gathered and run, and their
    outputs are added into their rows. `sources` (receivers): the rows from each source rank, in row order; the
    experts then get their rows per (source, expert), so a float8 product's weight-gradient tiles restart at each
    source's rows as they do in the source's own process (RoutedExperts.forward)."""
    rows, top_k = ids.shape
    held = range(experts.w1.shape[0]) if held is None else held
    local, flat = len(held), ids.flatten()
    key = torch.where(flat >= 0, flat - held.start, local)  # no slot: sorted last, never run
    order = key.argsort(stable=True)
    counts = _slot_counts(key, local, top_k, sources)
    if slots is None:
        positions = inverse_order(order)
        out = experts(permute(x, order, positions, top_k, experts.permute_impl), counts)  # rows past counts: zeros
        return unpermute(out, positions, weights, experts.permute_impl)
    order = order[:slots]
    out = experts(x[order // top_k], counts)
    out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    return out.new_zeros(rows, out.shape[-1]).index_add_(0, order // top_k, out)


def _slot_counts(key: torch.Tensor, local: int, top_k: int, sources: list[int] | None) -> torch.Tensor:
    """Filled slots per local expert (local,), or per (source, local expert) with `sources` (key: each slot's local
    expert, `local` for none)."""
    if sources is None:
        counts = torch.zeros(local + 1, dtype=torch.long, device=key.device)
        return counts.scatter_add_(0, key, torch.ones_like(key))[:local]
    per_source = torch.tensor(sources, device=key.device)
    source = torch.arange(len(sources), device=key.device).repeat_interleave(per_source, output_size=sum(sources))
    bins = source.repeat_interleave(top_k) * (local + 1) + key
    counts = torch.zeros(len(sources) * (local + 1), dtype=torch.long, device=key.device)
    return counts.scatter_add_(0, bins, torch.ones_like(bins)).view(len(sources), local + 1)[:, :local]
