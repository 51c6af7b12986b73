"""The one timing rule of the benchmarks: the median of repeated runs after warm-up, each run
bracketed by device synchronization, optionally on fresh inputs each time."""
import statistics
import time


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, *, warmup: int, repeats: int, fresh_inputs=None) -> float:
    """Median wall time of fn(*inputs); `fresh_inputs()` makes new inputs for every run when given."""
    inputs = fresh_inputs() if fresh_inputs else ()
    for _ in range(warmup):
        fn(*inputs)
    times = []
    for _ in range(repeats):
        inputs = fresh_inputs() if fresh_inputs else inputs
        synchronize(device)
        start = time.perf_counter()
        fn(*inputs)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
