"""The one timing rule of the benchmarks: the median of repeated runs after warm-up, each run
bracketed by device synchronization, optionally on fresh inputs each time. Kernels shorter than the
host's launch and synchronization overhead (tens of microseconds) are run `calls` times per
synchronized run and the time divided by `calls`."""

import statistics
import time


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, *, warmup: int, repeats: int, fresh_inputs=None, calls: int = 1) -> float:
    """Median wall time of fn(*inputs); `fresh_inputs()` makes new inputs for every run when given."""
    inputs = fresh_inputs() if fresh_inputs else ()
    for _ in range(warmup):
        fn(*inputs)
    times = []
    for _ in range(repeats):
        inputs = fresh_inputs() if fresh_inputs else inputs
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn(*inputs)
        synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def in_turns(step, settings: list, rounds: int) -> dict:
    """Each setting's readings, a list per setting in round order: `step(*setting)` gives one reading (seconds, or a
    dict of them), the settings taking turns step by step (the machine's other load falls on all of them alike),
    after one warm-up round that is not kept."""
    readings = {setting: [] for setting in settings}
    for round_ in range(rounds + 1):
        for setting in settings:
            reading = step(*setting)
            if round_:
                readings[setting].append(reading)
    return readings


def median_difference(later: list[float], earlier: list[float]) -> float:
    """The median over rounds of `later - earlier`, each pair measured in the same round (in_turns): a slow change in
    the machine's load, which shifts both, cancels, where a difference of the two medians carries it."""
    return statistics.median(a - b for a, b in zip(later, earlier, strict=True))
