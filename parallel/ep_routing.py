"""One hop of the expert dispatch (parallel/expert_parallel.py): which rows go to which member of a process group,
one row per (row, member) however many of the row's chosen experts that member holds, and back.

A hop takes R rows (tokens, or rows an earlier hop delivered), each with top_k slots of expert ids (-1: no slot
here) and weights, and `owner`, the member holding an expert. It sends a row once to each member owning any of
its slots (`reach`), with its slots masked to that member's; the member runs them, sums their weighted outputs
and sends one row back; the hop then sums each row's returns (`combine`). Everything is computed on the device,
at shapes known on the host: with dropless splits the sizes read once per layer (expert_parallel.py), or with a
capacity, C rows per member (rows past it dropped: models/moe.py's rank_capacity_mask has dropped the same).

The payload's form is one replaceable pair, a Payload: `pack` (the rows to send, gathered into member order: the
permutation) and `wire` (their form on the wire, decoded on arrival to the compute dtype; None: as they are).
Float8 dispatch gives the wire (parallel/float8_dispatch.py); a fused permutation kernel would give the pack. The
routing (weights and expert ids) travels beside it in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from trillion.kernels.permute import combine as permutation_combine
from trillion.kernels.permute import fused


class Wire(Protocol):
    """A payload's form on the wire: `encode(rows)` -> the tensor posted; `decode(tensor, dim, dtype)` -> the rows
    (n, dim) in the compute dtype. The gradient travels back in the compute dtype (ep_exchange.py), the combine's in
    a wire form of its own where one is given (Payload.gradient_wire)."""

    def encode(self, rows: torch.Tensor) -> torch.Tensor: ...

    def decode(self, wire: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor: ...


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows of x that the send slots carry (rows[i]; len(x): an empty slot, zeros)."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])])[rows]


@dataclass(frozen=True)
class Payload:
    """How a hop's rows travel: `pack(x, rows)` -> the rows to send (gather_rows' contract), on the wire as `wire`
    has them (None: as they are)."""

    pack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = gather_rows
    wire: Wire | None = None
    gradient_wire: Wire | None = None  # the combine's gradient on its way back (float8.combine_gradient)


@dataclass
class Hop:
    """The plan of one hop: each slot's member (R, top_k; `members`: no slot) and which members each row reaches
    (R, members)."""

    members: int
    dest: torch.Tensor
    reach: torch.Tensor

    @classmethod
    def plan(cls, ids: torch.Tensor, owner: Callable[[torch.Tensor], torch.Tensor], members: int) -> Hop:
        dest = torch.where(ids >= 0, owner(ids.clamp(min=0)), members)
        reach = torch.zeros(ids.shape[0], members + 1, dtype=torch.bool, device=ids.device)
        return cls(members, dest, reach.scatter_(1, dest, True)[:, :members])

    def counts(self) -> torch.Tensor:
        """(rows, filled slots) to each member (members, 2), on the device."""
        slots = torch.zeros(self.members + 1, dtype=torch.long, device=self.dest.device)
        slots = slots.scatter_add_(0, self.dest.flatten(), torch.ones_like(self.dest.flatten()))[: self.members]
        return torch.stack([self.reach.sum(dim=0), slots], dim=1)


@dataclass
class Placement:
    """Where each row travels: `rows` (S,) the row each send slot carries (R: empty), `member` (S,) its member, and
    `combine_index` (R, top_k) the send slot whose return carries slot j of row r (S where j is not the first slot of
    its member, or none)."""

    rows: torch.Tensor
    member: torch.Tensor
    combine_index: torch.Tensor

    @property
    def total(self) -> int:
        return self.rows.numel()


def place(hop: Hop, send: list[int], capacity: int = 0) -> Placement:
    """Send slots in member order: a member's rows in row order, at its offset (dropless: `send` from the sizes read
    on the host; with a capacity, C slots each, rows past them dropped)."""
    rows, members, device = hop.reach.shape[0], hop.members, hop.reach.device
    position = hop.reach.long().cumsum(dim=0) - 1  # a row's place among the rows to its member
    if capacity:
        start = torch.arange(members, device=device) * capacity
        fits = hop.reach & (position < capacity)
        total, member = members * capacity, torch.arange(members, device=device).repeat_interleave(capacity)
    else:
        sizes = torch.tensor(send, device=device)
        start, fits, total = sizes.cumsum(0) - sizes, hop.reach, sum(send)
        member = torch.arange(members, device=device).repeat_interleave(sizes, output_size=total)
    slot = torch.where(fits, start + position, total)  # (R, members); total: not sent
    row_of = torch.arange(rows, device=device).repeat_interleave(members)
    carried = torch.full((total + 1,), rows, dtype=torch.long, device=device).scatter_(0, slot.flatten(), row_of)
    slot = torch.cat([slot, slot.new_full((rows, 1), total)], dim=1).gather(1, hop.dest)  # (R, top_k)
    earlier_same = (hop.dest.unsqueeze(2) == hop.dest.unsqueeze(1)).tril(diagonal=-1).any(dim=2)
    return Placement(carried[:total], member, torch.where(earlier_same, total, slot))


def pack_routing(hop: Hop, placement: Placement, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(S, 2 top_k) float32: each send slot's weights, then expert ids, of the slots its member owns (others 0, -1)."""
    rows = placement.rows
    ids = torch.cat([ids, ids.new_full((1, ids.shape[1]), -1)])[rows]
    weights = torch.cat([weights, weights.new_zeros(1, weights.shape[1])])[rows]
    dest = torch.cat([hop.dest, hop.dest.new_full((1, hop.dest.shape[1]), hop.members)])[rows]
    owned = dest == placement.member.unsqueeze(1)
    return torch.cat([torch.where(owned, weights, 0.0).float(), torch.where(owned, ids, -1).float()], dim=1)


def unpack_routing(routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids (n, top_k) long, weights (n, top_k) float32) of received rows."""
    top_k = routing.shape[1] // 2
    return routing[:, top_k:].long(), routing[:, :top_k]


def combine(returned: torch.Tensor, placement: Placement, impl: str = "auto") -> torch.Tensor:
    """(R, dim) each row's sum of what its members sent back (their weighted outputs), in slot order; `impl` the
    permutation's kernels (kernels.permutation: the fused combine on a GPU)."""
    return _SumReturns.apply(returned, placement.combine_index, placement.rows, impl)


class _SumReturns(torch.autograd.Function):
    """Each row's returns summed in slot order with float32 accumulation, as torch's sum over a gathered (R, top_k,
    dim) adds them, without that gather: at DeepSeek-V3's shape the second hop of the per-node dispatch gathered 1.9 GB
    a layer for a sum of 0.2 GB. On a GPU the fused combine (kernels/permute.py) reads each returned row once; elsewhere
    the slots are added one at a time into one accumulator. Backward keeps only the send slots' rows: each send slot's
    return went into one row, whose gradient it takes."""

    @staticmethod
    def forward(ctx, returned, combine_index, rows, impl: str) -> torch.Tensor:
        ctx.save_for_backward(rows)
        sent = returned.shape[0]
        if sent and fused(impl, returned):  # `sent` (not a slot of this member's) reads the zero row after them
            padded = torch.cat([returned, returned.new_zeros(1, returned.shape[1])])
            return permutation_combine(padded, combine_index, impl)
        dtype = torch.float32 if returned.dtype in (torch.float16, torch.bfloat16) else returned.dtype
        total = returned.new_zeros(combine_index.shape[0], returned.shape[1], dtype=dtype)
        for slots in combine_index.t() if sent else ():  # no slot sent: every row's sum is zero
            part = returned.index_select(0, slots.clamp(max=sent - 1))
            total += part.masked_fill_((slots == sent).unsqueeze(1), 0)
        return total.to(returned.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return gather_rows(grad, rows), None, None, None
