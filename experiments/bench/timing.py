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
