"""Who orthogonalizes which matrices, and which pieces travel where (no torch: the same on every rank of a
pipeline stage, from every rank's boxes; distributed.py runs it).

A parameter is a stack of matrices (a 2-D weight a stack of one); a rank holds a box of it (`boxes[rank][param]`:
its first index and size in matrices, rows and columns). Each parameter is cut into units, matrices
orthogonalized together: a 2-D weight is one; an expert stack runs of at most ceil(E / ranks) experts, cut where
a rank's box ends. The units, in parameter order, go into rounds of at most ROUND_ELEMENTS per rank (the
exchange buffers' bound); within a round they are dealt out longest first (Newton-Schulz FLOPs,
matrices.py) to the least loaded rank, preferring one that holds the whole unit already. A round gathers each
unit's pieces to its owner (one copy of each distinct box: the owner's own if it holds it, else its lowest
holder's; a replica sends nothing) and scatters the result to every rank that holds a piece, replicas included.
"""

import math
from dataclasses import dataclass, field

from trillion.parallel.muon.matrices import newton_schulz_flops

# Exchange buffers are bounded by rounds of this many matrix elements per rank (256 MB in bfloat16): a rank holds
# about four times that at once beside its updates (distributed.py), instead of four copies of its whole share
ROUND_ELEMENTS = 1 << 27


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


@dataclass(frozen=True)
class Unit:
    """Matrices [first, last) of parameter `param`, orthogonalized together by `owner`."""

    param: int
    first: int
    last: int
    owner: int

    def box(self, shape: tuple[int, int]) -> Box:
        return Box((self.first, 0, 0), (self.last - self.first, *shape))


@dataclass(frozen=True)
class Piece:
    """A block of unit `unit` (of parameter `param`) that moves: `box` in global coordinates."""

    unit: int
    param: int
    box: Box


@dataclass
class Round:
    """One gather, the owners' Newton-Schulz, one scatter: this rank's pieces out and in, by peer."""

    owned: list[int]
    gather_send: list[list[Piece]]
    gather_receive: list[list[Piece]]
    scatter_send: list[list[Piece]]
    scatter_receive: list[list[Piece]]


@dataclass
class OrthogonalizationPlan:
    """The units and this rank's rounds, from every rank's boxes and each parameter's matrix shape (rows, cols)."""

    shapes: list[tuple[int, int]]
    boxes: list[list[Box]]
    rank: int
    steps: int
    round_elements: int = ROUND_ELEMENTS
    units: list[Unit] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)

    def __post_init__(self):
        self.ranks, self.mine = len(self.boxes), self.boxes[self.rank]
        self.load = [0.0] * self.ranks  # Newton-Schulz FLOPs per step of each rank
        for members in self._rounds(self._cut()):
            first = len(self.units)
            self.units += self._deal(members)
            self.rounds.append(self._route(range(first, len(self.units))))

    def _cut(self) -> list[tuple[int, int, int]]:
        """(param, first, last) of every unit, in parameter order."""
        cut = []
        for p in range(len(self.shapes)):
            boxes = [b[p] for b in self.boxes]
            count = max(b.start[0] + b.size[0] for b in boxes)
            edges = sorted({0, count} | {e for b in boxes if b.numel for e in (b.start[0], b.start[0] + b.size[0])})
            run = max(1, math.ceil(count / self.ranks))
            cut += [(p, s, min(s + run, hi)) for lo, hi in zip(edges, edges[1:]) for s in range(lo, hi, run)]
        return cut

    def _rounds(self, cut) -> list[list[tuple[int, int, int]]]:
        """Consecutive units up to round_elements per rank (a larger unit alone)."""
        rounds, size, capacity = [[]], 0, self.round_elements * self.ranks
        for p, lo, hi in cut:
            numel = (hi - lo) * math.prod(self.shapes[p])
            if rounds[-1] and size + numel > capacity:
                rounds.append([])
                size = 0
            rounds[-1].append((p, lo, hi))
            size += numel
        return rounds

    def _deal(self, members) -> list[Unit]:
        """Longest first to the least loaded rank of this round, a holder of the whole unit preferred."""
        load, units = [0.0] * self.ranks, []
        costed = [(p, lo, hi, (hi - lo) * newton_schulz_flops(*self.shapes[p], self.steps)) for p, lo, hi in members]
        for p, lo, hi, cost in sorted(costed, key=lambda u: (-u[3], u[0], u[1])):
            whole = Box((lo, 0, 0), (hi - lo, *self.shapes[p]))
            holders = {r for r in range(self.ranks) if self.boxes[r][p].matrices(lo, hi) == whole}
            owner = min(range(self.ranks), key=lambda r: (load[r], r not in holders, r))
            load[owner] += cost
            self.load[owner] += cost
            units.append(Unit(p, lo, hi, owner))
        return sorted(units, key=lambda u: (u.param, u.first))

    def _route(self, indices: range) -> Round:
        peers = lambda: [[] for _ in range(self.ranks)]  # noqa: E731
        found = Round([i for i in indices if self.units[i].owner == self.rank], peers(), peers(), peers(), peers())
        for index in indices:
            unit = self.units[index]
            p, owner = unit.param, unit.owner
            senders: dict[Box, int] = {}
            for r in range(self.ranks):
                senders.setdefault(self.boxes[r][p], r)
            if self.boxes[owner][p] in senders:  # the owner's own copy, where it has one
                senders[self.boxes[owner][p]] = owner
            for box, sender in senders.items():
                self._add(found.gather_send, found.gather_receive, sender, owner, Piece(index, p, box), unit)
            for r in range(self.ranks):
                self._add(found.scatter_send, found.scatter_receive, owner, r, Piece(index, p, self.boxes[r][p]), unit)
        return found

    def _add(self, send, receive, source: int, target: int, piece: Piece, unit: Unit) -> None:
        """`piece` (its box cut to the unit's matrices) from `source` to `target`, where this rank is either (or
        both: the all-to-all's own share)."""
        box = piece.box.matrices(unit.first, unit.last)
        if box is None:
            return
        piece = Piece(piece.unit, piece.param, box)
        if self.rank == source:
            send[target].append(piece)
        if self.rank == target:
            receive[source].append(piece)
