"""Kimi K2's pairing under Interleaved1F1B (parallel/pipeline_pairing.py PairedInterleaved1F1B): with
parallel.ep_overlap each rank runs one forward more before its first backward and each steady-state forward runs
paired with the backward after it (OVERLAP_F_B), the two taking turns at the expert all-to-alls. Checked: the orders
run without deadlock at the pipeline shapes below, and do not without the extra warm-up forward (why it exists); every
micro-batch's forward and backward of every stage appears once; and parity with one process on gloo, fp32, at pp 2 x
ep 2 (4 ranks, 2 stages per rank): debug-deepseek's kind (latent attention, MTP on) with selective checkpointing over
8 steps, losses, gradient norms and the first step's gradients within 1e-6 relative and every gradient of every step
within the harness's elementwise tolerance, each rank's pairs handing the turn over; and debug-moe under zero3."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B, ScheduleInterleaved1F1B

from tests.helpers.spawn import run_ranks
from tests.moe.harness import check_cases
from trillion.parallel import pipeline_pairing
from trillion.parallel.pipeline_pairing import PairedInterleaved1F1B

PAIRED = {"pp": 2, "dp_shard": 2, "ep": 2, "ep_overlap": True, "schedule": "Interleaved1F1B", "micro": 1}
SHAPES = [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (4, 4, 16), (8, 2, 32), (16, 2, 64)]  # (pp, v, micro-batches)


def rank_orders(p: int, v: int, m: int) -> dict[int, list]:
    """Every rank's compute actions under PairedInterleaved1F1B, built as torch builds them (no process group)."""
    schedule = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m)
    schedule.microbatches_per_round = m // max(1, m // p)
    return {r: PairedInterleaved1F1B._calculate_single_rank_operations(schedule, r) for r in range(p)}


def run_to_the_end(orders: dict[int, list], stages: int) -> bool:
    """Whether every rank gets through its order: in each round every rank runs its next action if what it needs is
    done (a forward: the previous stage's forward of that micro-batch; a backward: the next stage's backward, or on
    the last stage its own forward; a pair: both), until all are through (True) or none can move (a deadlock)."""
    done, position = set(), dict.fromkeys(orders, 0)

    def ready(action) -> bool:
        stage, micro = action.stage_index, action.microbatch_index
        if action.computation_type == FORWARD:
            return stage == 0 or ("F", stage - 1, micro) in done
        return ("B", stage + 1, micro) in done or (stage == stages - 1 and ("F", stage, micro) in done)

    while any(position[r] < len(order) for r, order in orders.items()):
        runnable = [
            r for r, order in orders.items() if position[r] < len(order) and all(map(ready, _parts(order[position[r]])))
        ]
        if not runnable:
            return False
        for r in runnable:
            for action in _parts(orders[r][position[r]]):
                done.add(
                    ("F" if action.computation_type == FORWARD else "B", action.stage_index, action.microbatch_index)
                )
            position[r] += 1
    return True


def _parts(action) -> tuple:
    return action.sub_actions if action.computation_type == OVERLAP_F_B else (action,)


@pytest.mark.parametrize("p, v, m", SHAPES)
def test_paired_orders_run_through_and_need_the_extra_warmup(p, v, m, monkeypatch):
    orders = rank_orders(p, v, m)
    assert run_to_the_end(orders, p * v)
    for rank, order in orders.items():
        actions = [a for item in order for a in _parts(item)]
        kinds = {FORWARD: [], FULL_BACKWARD: []}
        for a in actions:
            kinds[a.computation_type].append((a.stage_index, a.microbatch_index))
        expected = sorted((s * p + rank, mb) for s in range(v) for mb in range(m))
        assert sorted(kinds[FORWARD]) == expected and sorted(kinds[FULL_BACKWARD]) == expected
        assert any(item.computation_type == OVERLAP_F_B for item in order) or rank == 0 and m == p
    monkeypatch.setattr(pipeline_pairing, "INTERLEAVED_EXTRA_WARMUP", 0)
    assert not run_to_the_end(rank_orders(p, v, m), p * v)


def test_interleaved_pairing_at_pp2_x_ep2_equals_one_process():
    deepseek = {"model": "mla", "variant": "mtp", "mode": "zero1", "steps": 8, "relative": 1e-6}
    run_ranks(
        check_cases,
        4,
        [
            {"name": "interleaved-paired-selective", **PAIRED, **deepseek, "ac": "selective", "paired": True},
            {"name": "interleaved-paired-zero3", **PAIRED, "mode": "zero3", "paired": True},
        ],
    )


def torch_orders(p: int, v: int, m: int) -> dict[int, list]:
    """Every rank's compute actions under torch's own ScheduleInterleaved1F1B (unpaired), built as torch builds them."""
    schedule = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m)
    schedule.microbatches_per_round = m // max(1, m // p)
    return {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, r) for r in range(p)}


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (8, 2, 32), (16, 2, 64), (4, 4, 16)])
def test_the_planner_holds_each_ranks_chunks_as_its_order_does(p, v, m):
    """The planner's in-flight micro-batches on every rank (planner/schedules.py interleaved_in_flight) are what the
    rank's own order holds at its peak, replayed as `trillion estimate` replays it (pipeline_schedule.in_flight_peak),
    paired and unpaired: with equal chunks the most chunks at once (the last rank (v - 1) p + 1, the paired schedule
    one more on every rank), and with chunks of unequal bytes (a last stage keeping the MTP module whole) the peak
    bytes."""
    from trillion.parallel.planner.schedules import interleaved_in_flight
    from trillion.trainer.tools.estimate.activations import MicroBatchMemory
    from trillion.trainer.tools.estimate.pipeline_schedule import in_flight_peak

    for extra, orders in ((1, rank_orders(p, v, m)), (0, torch_orders(p, v, m))):
        for rank, order in orders.items():
            sizes = [1.0] * (v - 1) + [7.0 if rank == p - 1 else 1.0]
            for chunks in ([1.0] * v, sizes):
                memory = {s * p + rank: MicroBatchMemory(held=b, forward_peak=b, peak=b, grad_elements=0) for s, b in
                          enumerate(chunks)}  # fmt: skip
                peak, most = in_flight_peak(order, memory)
                units, counts = interleaved_in_flight(p, v, m, rank, tuple(chunks), extra)
                assert units * sum(chunks) == pytest.approx(peak), (extra, rank, chunks)
                if chunks == [1.0] * v:
                    assert sum(counts) == most == (v - 1) * p + 2 * (p - 1 - rank) + 1 + extra
