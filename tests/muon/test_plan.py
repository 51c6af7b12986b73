"""The orthogonalization plan (parallel/muon/plan.py) for the boxes real layouts give, without processes: every
matrix has one owner, a unit's gathered pieces tile it once, each rank gets back exactly its box, the sends of one
rank are the receives of the other in the same order, replicas send nothing, the work is balanced, rounds are
bounded."""

import math

from trillion.parallel.muon.plan import Box, OrthogonalizationPlan


def rows(count: int, cols: int, cuts: list[int]) -> list[Box]:
    """A (count, rows, cols) tensor's boxes cut along rows at `cuts` (FSDP's dim-0 shards of a 2-D weight)."""
    return [Box((0, lo, 0), (count, hi - lo, cols)) for lo, hi in zip(cuts, cuts[1:])]


def layout_boxes() -> tuple[list[tuple[int, int]], list[list[Box]]]:
    """8 ranks: a (10, 6) weight in uneven row shards over 4 ranks, replicated twice (HSDP); an (8, 4, 6) expert
    stack over ep 2 (experts 0-3, 4-7), each ep rank's experts in two row halves (expert FSDP on dim 1), every box
    held by two ranks (tp replicas); a (6, 16) weight split by columns over 2 (a row-parallel TP shard) and by rows
    over 4 (FSDP)."""
    weight = rows(1, 6, [0, 3, 6, 8, 10]) * 2
    experts = [Box((e, r, 0), (4, 2, 6)) for e in (0, 4) for r in (0, 2) for _ in range(2)]
    split = [Box((0, r, c), (1, 2 if r < 4 else 1, 8)) for c in (0, 8) for r in (0, 2, 4, 5)]
    return [(10, 6), (4, 6), (6, 16)], [list(b) for b in zip(weight, experts, split)]


def plans(shapes, boxes, **kwargs) -> list[OrthogonalizationPlan]:
    return [OrthogonalizationPlan(shapes, boxes, rank, 5, **kwargs) for rank in range(len(boxes))]


def test_every_matrix_is_gathered_whole_once_and_every_rank_gets_its_box_back():
    shapes, boxes = layout_boxes()
    everyone = plans(shapes, boxes)
    units = everyone[0].units
    assert all(plan.units == units for plan in everyone), "every rank makes the same plan"
    for p, (r, c) in enumerate(shapes):
        count = max(b[p].start[0] + b[p].size[0] for b in boxes)
        covered = sorted((u.first, u.last) for u in units if u.param == p)
        assert (
            covered[0][0] == 0 and covered[-1][1] == count and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        )
    owned = sum(len(rd.owned) for plan in everyone for rd in plan.rounds)
    assert owned == len(units), "each unit orthogonalized by exactly one rank"
    for index, unit in enumerate(units):
        owner = everyone[unit.owner]
        pieces = [p for rd in owner.rounds for peer in rd.gather_receive for p in peer if p.unit == index]
        assert sum(p.box.numel for p in pieces) == unit.box(shapes[unit.param]).numel, f"unit {index} tiled once"
    for rank, plan in enumerate(everyone):
        back = [p for rd in plan.rounds for peer in rd.scatter_receive for p in peer]
        for param, box in enumerate(boxes[rank]):
            assert sum(p.box.numel for p in back if p.param == param) == box.numel, (rank, param)
        for peer in range(len(boxes)):
            for kind in ("gather", "scatter"):
                sent = [getattr(rd, f"{kind}_send")[peer] for rd in plan.rounds]
                received = [getattr(rd, f"{kind}_receive")[rank] for rd in everyone[peer].rounds]
                assert sent == received, (kind, rank, peer)


def test_replicas_send_one_copy_and_owners_use_their_own():
    shapes, boxes = layout_boxes()
    for rank, plan in enumerate(plans(shapes, boxes)):
        for rd in plan.rounds:
            for owner, pieces in enumerate(rd.gather_send):
                for piece in pieces:
                    mine = boxes[rank][piece.param]
                    lowest = min(r for r in range(len(boxes)) if boxes[r][piece.param] == mine)
                    assert rank == owner or (rank == lowest and boxes[owner][piece.param] != mine), (rank, piece)


def test_equal_matrices_are_dealt_evenly_and_rounds_are_bounded():
    shapes = [(8, 8)] * 12
    boxes = [[Box((0, 0, 0), (1, 8, 8))] * 12 for _ in range(4)]  # every rank holds every matrix (replicas)
    everyone = plans(shapes, boxes)
    assert everyone[0].load == [everyone[0].load[0]] * 4 and sum(len(r.owned) for r in everyone[0].rounds) == 3
    assert all(
        not peer
        for rank, plan in enumerate(everyone)
        for rd in plan.rounds
        for r, peer in enumerate(rd.gather_send)
        if r != rank
    ), "an owner holding its matrices whole gathers nothing from others"
    bounded = plans(shapes, boxes, round_elements=2 * 64)
    assert len(bounded[0].rounds) == math.ceil(12 / (2 * 4))  # two matrices per rank per round
    for plan in bounded:
        for rd in plan.rounds:
            assert sum(math.prod(plan.units[i].box((8, 8)).size) for i in rd.owned) <= 2 * 64
