"""Async TP (`parallel.async_tp`): torch's micro-pipelined tensor parallelism, as torchtitan's users know it
(--parallelism.enable_async_tensor_parallel).

Under torch.compile, Inductor's micro-pipeline TP pass (torch._inductor.config._micro_pipeline_tp) finds each
all-gather whose output feeds GEMMs and each GEMM whose output is reduce-scattered in a compiled block's graph, and
replaces the pair by one fused op (fused_all_gather_matmul, fused_matmul_reduce_scatter; with float8, their scaled
variants) that cuts the collective into per-rank steps moved through symmetric memory (buffers every rank of the tp
group maps) while the GEMM of the step before runs. The pass fuses only for a group symmetric memory is enabled
for, so `enable` turns it on for the tp group before the blocks are compiled; the tensor-parallel plan stays
DTensor's (tensor_parallel.py), whose collectives are what the pass matches.

What it needs (checked before any work: tp_checks.py for the layout, `check_device` here for the machine):
tensor parallelism, compile with Inductor, a CUDA device, and a torch whose build has a symmetric-memory backend
for it (`torch.distributed._symmetric_memory.get_backend`). Where one is missing, the chunked overlap
(parallel.tp_overlap, tp_overlap.py) hides the same collectives on any backend.
"""

import warnings

import torch

from trillion.errors import ConfigError

FALLBACK = "Use the chunked overlap instead: --parallel.tp_overlap=N (NCCL, RCCL or gloo; no compile needed)."


def symmetric_memory_backend(device: torch.device) -> str | None:
    """The symmetric-memory backend this torch build has for `device`'s type (e.g. "CUDA", "NVSHMEM"), or None."""
    try:
        from torch.distributed import _symmetric_memory
    except ImportError:
        return None
    try:
        return _symmetric_memory.get_backend(torch.device(device.type))
    except (RuntimeError, AttributeError):  # a build without the symmetric-memory bindings
        return None


def check_device(device: torch.device) -> None:
    """ConfigError, naming the fix, where async TP cannot run on `device`."""
    if device.type != "cuda":
        raise ConfigError(
            f"parallel.async_tp=true runs on CUDA GPUs (symmetric memory between the tp group's devices); this run's "
            f"device is {device.type}. {FALLBACK}"
        )
    if symmetric_memory_backend(device) is None:
        build = f"ROCm {torch.version.hip}" if torch.version.hip else f"torch {torch.__version__}"
        raise ConfigError(
            f"parallel.async_tp=true needs symmetric memory, which this torch build ({build}) has no backend for on "
            f"{device.type}. {FALLBACK}"
        )


def enable(tp_mesh) -> None:
    """Symmetric memory for the tp group and Inductor's micro-pipeline TP pass, before the blocks are compiled."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():  # deprecated in favour of automatic registration, which 2.13 does not yet do
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    torch._inductor.config._micro_pipeline_tp = True
