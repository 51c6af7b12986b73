"""A parameter as the planner shards it: its shape, the dimension tensor parallelism splits, and the elements a
rank holds after tensor parallelism and after FSDP (memory.py and optimizer.py count with it)."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dimension tensor parallelism splits; None = replicated


def local_numel(spec: ParamSpec, tp: int, dp_shard: int) -> tuple[int, int]:
    """(elements after TP, elements after TP and FSDP) on the rank holding the most: rank 0."""
    shape = list(spec.shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = math.ceil(shape[spec.tp_dim] / tp)
    tp_local = math.prod(shape)
    shape[0] = math.ceil(shape[0] / dp_shard)
    return tp_local, math.prod(shape)
