"""The chunked TP overlap's latency injection (parallel/tp_overlap.py TpCollectives, what
experiments/bench/tp_overlap.py measures with), on 2 gloo ranks: a collective waited at once is held its delay; one
waited after compute as long as its delay is not held; chunks share one wire, so two chunks posted together
complete one after the other; and the bookkeeping the benchmark keeps on at a delay of 0 (`instrumented`) holds
nothing and leaves the results unchanged."""

import time

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.helpers.spawn import run_ranks
from trillion.parallel.tp_overlap import TpCollectives

DELAY = 0.3  # seconds: far above gloo's own time for these few bytes and the sleeps' jitter


def _gathered(comm: TpCollectives, rank: int) -> torch.Tensor:
    return comm.all_gather(torch.full((2, 3), float(rank))).wait()


def _injection(rank: int, world_size: int) -> None:
    comm = TpCollectives(init_device_mesh("cpu", (world_size,)), chunks=2)
    expected = torch.arange(world_size, dtype=torch.float32).view(-1, 1, 1).expand(-1, 2, 3)

    comm.instrumented = True  # no delay: the results, nothing held
    assert torch.equal(_gathered(comm, rank), expected)
    assert comm.late_s < 0.05, comm.late_s

    comm.delay_s["all_gather"] = DELAY  # a chunk's share: DELAY / 2, waited at once
    comm.late_s, comm.blocked_s = 0.0, 0.0
    assert torch.equal(_gathered(comm, rank), expected)
    assert DELAY / 2 - 0.02 < comm.late_s <= comm.blocked_s < DELAY / 2 + 0.1, (comm.late_s, comm.blocked_s)

    comm.late_s = 0.0  # compute longer than its share before the wait: the delay is covered
    posted = comm.all_gather(torch.full((2, 3), float(rank)))
    time.sleep(DELAY)
    assert torch.equal(posted.wait(), expected)
    assert comm.late_s < 0.05, comm.late_s

    comm.late_s = 0.0  # two chunks posted together: the second completes a share after the first
    first, second = (comm.all_gather(torch.full((2, 3), float(rank))) for _ in range(2))
    start = time.perf_counter()
    first.wait(), second.wait()
    assert DELAY - 0.03 < time.perf_counter() - start < DELAY + 0.15


def test_injected_delay_is_held_unless_covered_and_chunks_share_one_wire():
    run_ranks(_injection, 2)
