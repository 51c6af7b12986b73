"""Muon's orthogonalization under any layout: each matrix whole on one owner rank, orthogonalized there once,
the matrices balanced over the ranks, the results sent back to every rank that holds a piece of them.

Newton-Schulz needs each whole matrix, and a rank holds pieces: FSDP2's dim-0 shards over dp_shard (x cp),
tensor parallelism's column or row slices, expert parallelism's experts, their compositions (torch's strided
shards of FSDP over TP included), and replicas (HSDP's dp_replicate, the tp ranks of the routed experts). The
design is Dion's and torchtitan's (gather, compute, scatter by all-to-all), generalised from their 1-D dp shards
to any placement: the only fact used about a rank's piece is the box it is of the global tensor, which DTensor
states for every placement DCP saves (`compute_local_shape_and_global_offset`), so no layout is refused (as
torchtitan refuses tensor parallelism's strided shards). Moonlight's distributed Muon instead all-gathers each
matrix to every data-parallel rank and lets each orthogonalize it: the work is repeated dp times; here it is
spread.

The ranks of one pipeline stage (every axis but pp) hold the stage's parameters, so that is the group. Once
(the first step) they exchange their boxes, and each makes the same plan (plan.py: units, owners balanced by
Newton-Schulz FLOPs, rounds). Each round of a step is then one all-to-all that brings every unit's pieces to its
owner, the owners' Newton-Schulz on their units (batched by shape), and one all-to-all that returns every rank
its pieces of the results, which the optimizer applies as they arrive. Both carry the Newton-Schulz dtype
(bfloat16 halves them): the values it computes in anyway. Gather, compute and scatter run in turn (no overlap);
the planner charges them so (parallel/planner/optimizer.py).
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trillion.parallel.muon.newton_schulz import orthogonalize
from trillion.parallel.muon.plan import ROUND_ELEMENTS, Box, OrthogonalizationPlan, Piece, Round


def as_stack(tensor: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) tensor as (1, rows, cols); a stack as it is."""
    return tensor.unsqueeze(0) if tensor.ndim == 2 else tensor


def local_box(param: torch.Tensor) -> Box:
    """The box of the global (matrices, rows, cols) tensor this rank holds of `param`."""
    if isinstance(param, DTensor):
        size, start = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        size, start = tuple(param.shape), (0,) * param.ndim
    if param.ndim == 2:
        size, start = (1, *size), (0, *start)
    return Box(tuple(start), tuple(size))


def _exchange(pieces_out, pieces_in, values_of, dtype: torch.dtype, device, group) -> list[torch.Tensor]:
    """One all-to-all over `group`: to each peer its pieces (`values_of(piece)`), in `dtype`; returns the arriving
    pieces, each flat, in the order of `pieces_in` (without a group, this rank's own pieces are all there is)."""
    out = [values_of(piece).reshape(-1).to(dtype) for peer in pieces_out for piece in peer]
    send = torch.cat(out) if out else torch.empty(0, dtype=dtype, device=device)
    del out
    if group is None:
        receive = send
    else:
        sizes_in = [sum(p.box.numel for p in peer) for peer in pieces_in]
        sizes_out = [sum(p.box.numel for p in peer) for peer in pieces_out]
        receive = send.new_empty(sum(sizes_in))
        dist.all_to_all_single(receive, send, sizes_in, sizes_out, group=group)
    return list(receive.split([p.box.numel for peer in pieces_in for p in peer]))


# apply(param index, the piece's slices in this rank's (matrices, rows, cols) view of it, its orthogonalized values)
Apply = Callable[[int, tuple[slice, ...], torch.Tensor], None]


class Orthogonalizer:
    """Orthogonalizes the matrices of a list of parameters (this rank's pieces of them) across `group` (the ranks
    of this pipeline stage; None: one rank), each matrix once. `orthogonalized` counts the matrices this rank has
    orthogonalized (the tests sum it over the ranks)."""

    def __init__(self, params: list[torch.Tensor], shapes: list[tuple[int, int]], steps: int, group=None):
        self.params, self.shapes, self.steps, self.group = params, shapes, steps, group
        self.plan: OrthogonalizationPlan | None = None
        self.orthogonalized = 0
        self.round_elements = ROUND_ELEMENTS

    def _make_plan(self) -> OrthogonalizationPlan:
        mine = [local_box(p) for p in self.params]
        if self.group is None:
            return OrthogonalizationPlan(self.shapes, [mine], 0, self.steps, self.round_elements)
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return OrthogonalizationPlan(self.shapes, everyone, dist.get_rank(self.group), self.steps, self.round_elements)

    def __call__(self, updates: list[torch.Tensor], dtype: torch.dtype, apply: Apply) -> None:
        """This rank's pieces (as_stack views) of each parameter's update in, `apply` called on each of this
        rank's pieces of the orthogonalized updates (in `dtype`), round by round."""
        self.plan = self.plan or self._make_plan()
        for round_ in self.plan.rounds:
            self._round(round_, updates, dtype, apply)

    def _round(self, round_: Round, updates: list[torch.Tensor], dtype: torch.dtype, apply: Apply) -> None:
        plan, device = self.plan, updates[0].device if updates else torch.device("cpu")
        units = {i: (plan.units[i], plan.units[i].box(self.shapes[plan.units[i].param])) for i in round_.owned}
        whole = {i: torch.empty(box.size, dtype=dtype, device=device) for i, (_, box) in units.items()}

        def in_local(piece: Piece) -> tuple[slice, ...]:
            return piece.box.inside(plan.mine[piece.param])

        def in_unit(piece: Piece) -> tuple[slice, ...]:
            return piece.box.inside(units[piece.unit][1])

        def exchange(send, receive, values_of) -> list[torch.Tensor]:
            return _exchange(send, receive, values_of, dtype, device, self.group)

        arrived = exchange(round_.gather_send, round_.gather_receive, lambda p: updates[p.param][in_local(p)])
        for piece, values in zip((p for peer in round_.gather_receive for p in peer), arrived):
            whole[piece.unit][in_unit(piece)] = values.view(piece.box.size)
        del arrived
        self._orthogonalize(whole)
        returned = exchange(round_.scatter_send, round_.scatter_receive, lambda p: whole[p.unit][in_unit(p)])
        whole.clear()
        for piece, values in zip((p for peer in round_.scatter_receive for p in peer), returned):
            apply(piece.param, in_local(piece), values.view(piece.box.size))

    def _orthogonalize(self, whole: dict[int, torch.Tensor]) -> None:
        """The owned units, one batched Newton-Schulz per matrix shape, in place."""
        by_shape: dict[tuple, list[int]] = {}
        for index, tensor in whole.items():
            by_shape.setdefault(tuple(tensor.shape[1:]), []).append(index)
        for indices in by_shape.values():
            stacked = torch.cat([whole[i] for i in indices])
            done = orthogonalize(stacked, self.steps, stacked.dtype).split([whole[i].shape[0] for i in indices])
            for i, result in zip(indices, done):
                whole[i] = result
                self.orthogonalized += result.shape[0]


def stage_group(dims):
    """The process group of the ranks that hold this rank's pipeline stage (every mesh axis but pp), or None when
    this rank holds its stage alone. Made once per optimizer, on every rank (a collective)."""
    mesh = dims.mesh
    if mesh is None:
        return None
    names = mesh.mesh_dim_names
    if names == ("pp",):
        return None
    if len(names) == 1:
        return mesh.get_group()
    stages = mesh.mesh.reshape(mesh.size(0) if names[0] == "pp" else 1, -1).tolist()
    group, _ = dist.new_subgroups_by_enumeration(stages)
    return group
