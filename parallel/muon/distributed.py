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
(the first step) they exchange their boxes; each parameter is cut into units (a 2-D weight is one; an expert
stack runs of about E / ranks experts, cut where the ranks' boxes end) and the units are dealt out by longest
processing time first (Newton-Schulz FLOPs, parallel/muon/matrices.py) to the least loaded rank, preferring one
that holds the whole unit already. Each step is then one all-to-all that brings every unit's pieces to its owner
(one copy of each piece: the lowest rank of its replicas sends it, or the owner's own), the owners' Newton-Schulz
on their units (batched by shape), and one all-to-all that returns every rank its pieces of the results. Both
carry the Newton-Schulz dtype (bfloat16 halves them): the values it computes in anyway. Gather, compute and
scatter run in turn (no overlap); the planner charges them so (parallel/planner/optimizer.py).
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trillion.parallel.muon.matrices import newton_schulz_flops
from trillion.parallel.muon.newton_schulz import orthogonalize


@dataclass(frozen=True)
class Box:
    """A block of a (matrices, rows, cols) tensor: its first index and its size in each dimension."""

    start: tuple[int, int, int]
    size: tuple[int, int, int]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def matrices(self, first: int, last: int) -> "Box | None":
        """This box's part of matrices [first, last), or None."""
        lo, hi = max(first, self.start[0]), min(last, self.start[0] + self.size[0])
        if hi <= lo or not self.numel:
            return None
        return Box((lo, *self.start[1:]), (hi - lo, *self.size[1:]))

    def inside(self, outer: "Box") -> tuple[slice, slice, slice]:
        """The slices of this box in a tensor holding `outer`."""
        return tuple(slice(s - o, s - o + n) for s, o, n in zip(self.start, outer.start, self.size))


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


@dataclass(frozen=True)
class Unit:
    """Matrices [first, last) of parameter `param`, orthogonalized together by `owner`."""

    param: int
    first: int
    last: int
    owner: int


@dataclass(frozen=True)
class Piece:
    """A block of unit `unit` (of parameter `param`) that moves: `box` in global coordinates."""

    unit: int
    param: int
    box: Box


def _units(count: int, boxes: list[Box], ranks: int) -> list[tuple[int, int]]:
    """Matrices of one parameter in runs of at most ceil(count / ranks), none crossing a rank's box edge."""
    edges = {0, count} | {e for b in boxes if b.numel for e in (b.start[0], b.start[0] + b.size[0])}
    edges, run, found = sorted(edges), max(1, math.ceil(count / ranks)), []
    for lo, hi in zip(edges, edges[1:]):
        found += [(s, min(s + run, hi)) for s in range(lo, hi, run)]
    return found


class OrthogonalizationPlan:
    """Who owns which unit and which pieces travel where, the same on every rank of the group, from every rank's
    boxes (`boxes[rank][param]`) and each parameter's matrix shape (`shapes[param]`: rows, cols)."""

    def __init__(self, shapes: list[tuple[int, int]], boxes: list[list[Box]], rank: int, steps: int):
        self.rank, self.ranks = rank, len(boxes)
        self.mine = boxes[rank]
        self.units = self._deal(shapes, boxes, steps)
        self.gather_send: list[list[Piece]] = [[] for _ in range(self.ranks)]
        self.gather_receive: list[list[Piece]] = [[] for _ in range(self.ranks)]
        self.scatter_send: list[list[Piece]] = [[] for _ in range(self.ranks)]
        self.scatter_receive: list[list[Piece]] = [[] for _ in range(self.ranks)]
        for index, unit in enumerate(self.units):
            self._route(index, unit, boxes)
        self.owned = [i for i, u in enumerate(self.units) if u.owner == rank]

    def _deal(self, shapes, boxes, steps: int) -> list[Unit]:
        cut = []
        for p, (rows, cols) in enumerate(shapes):
            count = max(b[p].start[0] + b[p].size[0] for b in boxes)
            cost = newton_schulz_flops(rows, cols, steps)
            cut += [(p, lo, hi, (hi - lo) * cost) for lo, hi in _units(count, [b[p] for b in boxes], self.ranks)]
        self.load, units = [0.0] * self.ranks, []
        for p, lo, hi, cost in sorted(cut, key=lambda u: (-u[3], u[0], u[1])):  # longest first
            holders = {r for r in range(self.ranks) if _holds(boxes[r][p], lo, hi, rows_cols=shapes[p])}
            owner = min(range(self.ranks), key=lambda r: (self.load[r], r not in holders, r))
            self.load[owner] += cost
            units.append(Unit(p, lo, hi, owner))
        return sorted(units, key=lambda u: (u.param, u.first))

    def _route(self, index: int, unit: Unit, boxes: list[list[Box]]) -> None:
        """Gather: each distinct box's piece once, from the owner if it holds it, else from its lowest holder.
        Scatter: every holder's piece (replicas included) from the owner."""
        p, owner = unit.param, unit.owner
        senders: dict[Box, int] = {}
        for r in range(self.ranks):
            senders.setdefault(boxes[r][p], r)
        if boxes[owner][p] in senders:
            senders[boxes[owner][p]] = owner
        for box, sender in senders.items():
            self._add(self.gather_send, self.gather_receive, sender, owner, Piece(index, p, box), unit)
        for r in range(self.ranks):
            self._add(self.scatter_send, self.scatter_receive, owner, r, Piece(index, p, boxes[r][p]), unit)

    def _add(self, send, receive, source: int, target: int, piece: Piece, unit: Unit) -> None:
        """Piece (its box cut to the unit's matrices) from `source` to `target`, where this rank is either (or
        both: the all-to-all's own share)."""
        box = piece.box.matrices(unit.first, unit.last)
        if box is None:
            return
        piece = Piece(piece.unit, piece.param, box)
        if self.rank == source:
            send[target].append(piece)
        if self.rank == target:
            receive[source].append(piece)


def _holds(box: Box, first: int, last: int, rows_cols: tuple[int, int]) -> bool:
    """Whether `box` holds matrices [first, last) whole."""
    return (
        box.start == (box.start[0], 0, 0)
        and box.size[1:] == tuple(rows_cols)
        and box.matrices(first, last) == Box((first, 0, 0), (last - first, *rows_cols))
    )


def _exchange(pieces_out, pieces_in, values_of, dtype: torch.dtype, device, group) -> list[torch.Tensor]:
    """One all-to-all over `group`: to each peer its pieces (`values_of(piece)`), in `dtype`; returns the arriving
    pieces, each flat, in the order of `pieces_in` (without a group, this rank's own pieces are all there is)."""
    out = [values_of(piece).reshape(-1).to(dtype) for peer in pieces_out for piece in peer]
    send = torch.cat(out) if out else torch.empty(0, dtype=dtype, device=device)
    if group is None:
        receive = send
    else:
        sizes_in = [sum(p.box.numel for p in peer) for peer in pieces_in]
        sizes_out = [sum(p.box.numel for p in peer) for peer in pieces_out]
        receive = send.new_empty(sum(sizes_in))
        dist.all_to_all_single(receive, send, sizes_in, sizes_out, group=group)
    return list(receive.split([p.box.numel for peer in pieces_in for p in peer]))


class Orthogonalizer:
    """Orthogonalizes the matrices of a list of parameters (this rank's pieces of them) across `group` (the ranks
    of this pipeline stage; None: one rank), each matrix once. `orthogonalized` counts the matrices this rank has
    orthogonalized (the tests sum it over the ranks)."""

    def __init__(self, params: list[torch.Tensor], shapes: list[tuple[int, int]], steps: int, group=None):
        self.params, self.shapes, self.steps, self.group = params, shapes, steps, group
        self.plan: OrthogonalizationPlan | None = None
        self.orthogonalized = 0

    def _make_plan(self) -> OrthogonalizationPlan:
        mine = [local_box(p) for p in self.params]
        if self.group is None:
            return OrthogonalizationPlan(self.shapes, [mine], 0, self.steps)
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return OrthogonalizationPlan(self.shapes, everyone, dist.get_rank(self.group), self.steps)

    def __call__(self, updates: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's pieces (as_stack views, any dtype) of each parameter's update -> its pieces of the
        orthogonalized updates, in `dtype`."""
        plan = self.plan = self.plan or self._make_plan()
        device = updates[0].device if updates else torch.device("cpu")
        whole = {i: torch.empty(self._unit_shape(plan.units[i]), dtype=dtype, device=device) for i in plan.owned}

        def in_unit(piece: Piece) -> tuple[slice, ...]:
            return piece.box.inside(Box((plan.units[piece.unit].first, 0, 0), whole[piece.unit].shape))

        def in_local(piece: Piece) -> tuple[slice, ...]:
            return piece.box.inside(plan.mine[piece.param])

        def exchange(send, receive, values_of) -> list[torch.Tensor]:
            return _exchange(send, receive, values_of, dtype, device, self.group)

        arrived = exchange(plan.gather_send, plan.gather_receive, lambda p: updates[p.param][in_local(p)])
        for piece, values in zip((p for peer in plan.gather_receive for p in peer), arrived):
            whole[piece.unit][in_unit(piece)] = values.view(piece.box.size)
        self._orthogonalize(whole)
        returned = exchange(plan.scatter_send, plan.scatter_receive, lambda p: whole[p.unit][in_unit(p)])
        results = [torch.empty(u.shape, dtype=dtype, device=device) for u in updates]
        for piece, values in zip((p for peer in plan.scatter_receive for p in peer), returned):
            results[piece.param][in_local(piece)] = values.view(piece.box.size)
        return results

    def _unit_shape(self, unit: Unit) -> tuple[int, int, int]:
        return (unit.last - unit.first, *self.shapes[unit.param])

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
