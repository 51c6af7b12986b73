"""Rows through the routed experts (models/moe.py's RoutedExperts): each row's chosen experts run and their outputs
return to it, weighted and summed. One process runs every token here (MoE.dispatch); under expert parallelism each
rank runs the rows that arrived for its experts (parallel/expert_parallel.py).

Each slot's routing weight scales its SwiGLU output before the down projection (kernels/swiglu.py; w2 is linear, so
the weighted sum is the same), and the outputs come back summed as they are. Weighting after w2 kept every slot's
output (dim wide) for the weights' gradient, and under expert parallelism index_add_ kept the weighted outputs again:
at DeepSeek-V3's shape 2 x 8 x 7168 elements a token and MoE layer. Now the weights' gradient is the dot of the
down projection's input gradient with SwiGLU's output, recomputed from gate and up, which backward keeps anyway;
the sums back keep only their indices.
"""

import torch
from torch import nn

from trillion.kernels.permute import combine, inverse_order, permute


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
    GEMM per projection (each slot's weight applied before w2), and the outputs are summed back into their rows: with
    every slot, by the fused permutation's combine (kernels/permute.py, kernels.permutation). `slots` (expert
    parallelism's receivers, whose rows hold few of their top_k slots here): how many slots are filled at most; only
    that many rows are gathered and run, and their outputs are added into their rows. `sources` (receivers): the rows
    from each source rank, in row order; the experts then get their rows per (source, expert), so a float8 product's
    weight-gradient tiles restart at each source's rows as they do in the source's own process
    (RoutedExperts.forward)."""
    rows, top_k = ids.shape
    held = range(experts.w1.shape[0]) if held is None else held
    local, flat = len(held), ids.flatten()
    key = torch.where(flat >= 0, flat - held.start, local)  # no slot: sorted last, never run
    order = key.argsort(stable=True)
    counts = _slot_counts(key, local, top_k, sources)
    if slots is None:
        positions = inverse_order(order)
        routed = permute(x, order, positions, top_k, experts.permute_impl)
        out = experts(routed, counts, weights.flatten()[order])  # rows past counts: zeros
        return combine(out, positions.view(rows, top_k), experts.permute_impl)
    order = order[:slots]
    out = experts(x[order // top_k], counts, weights.flatten()[order])
    return _AddRows.apply(out, order // top_k, rows)


class _AddRows(torch.autograd.Function):
    """(rows, dim): the rows of `src` (n, dim) summed into rows `index`, keeping only the index for backward (torch's
    index_add_ keeps its source too)."""

    @staticmethod
    def forward(ctx, src: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return src.new_zeros(rows, src.shape[-1]).index_add_(0, index, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


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
