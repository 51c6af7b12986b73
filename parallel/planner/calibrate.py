"""`trillion plan --calibrate`: measure this machine and write a hardware profile the planner reads.

Measured: GEMM throughput over sizes (the efficiency curve), copy bandwidth (element-wise kernels),
and all-reduce bus bandwidth among processes on this machine (gloo on CPU, NCCL/RCCL on GPUs).
On a CPU nobody publishes a peak, so the profile's peak is the best GEMM rate measured, and the
curve is relative to it; on a GPU the peak comes from devices.toml.
"""
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trillion.devices import lookup_device

GEMM_SIZES = (128, 256, 512, 1024, 2048)
ALL_REDUCE_BYTES = 64 * 2**20


def _timed(fn, repeats: int) -> float:
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def measure_gemms(device: torch.device, dtype: torch.dtype) -> list[tuple[float, float]]:
    """(FLOPs of one square GEMM, achieved FLOP/s)."""
    out = []
    for n in GEMM_SIZES:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        seconds = _timed(lambda: a @ b, repeats=max(2, int(2e9 / n**3)))
        out.append((2.0 * n**3, 2.0 * n**3 / seconds))
    return out


def measure_copy_bandwidth(device: torch.device) -> float:
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / _timed(lambda: y.copy_(x), repeats=10)  # read + write


def _all_reduce_worker(rank: int, world: int, init_file: str, backend: str, result) -> None:
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    tensor = torch.ones(ALL_REDUCE_BYTES // 4, device=device)
    seconds = _timed(lambda: dist.all_reduce(tensor), repeats=5)
    if rank == 0:  # bus bandwidth: what each rank sends and receives in a ring
        result.value = 2 * (world - 1) / world * ALL_REDUCE_BYTES / seconds
    dist.destroy_process_group()


def measure_all_reduce(world: int) -> float:
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    result = mp.get_context("spawn").Value("d", 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_all_reduce_worker, args=(world, os.path.join(tmp, "init"), backend, result), nprocs=world,
                           start_method="spawn")
    return result.value


def calibrate(out: Path) -> Path:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    spec = lookup_device(torch.cuda.get_device_name()) if on_gpu else None
    gemms = measure_gemms(device, dtype)
    peak = spec.peak_tflops_bf16 * 1e12 if spec else max(rate for _, rate in gemms)
    copy = measure_copy_bandwidth(device)
    world = torch.cuda.device_count() if on_gpu else 2
    bus = measure_all_reduce(world) if world > 1 else copy
    name = (spec.name if spec else "cpu") + "-calibrated"
    curve = ", ".join(f"[{flops:.3g}, {rate / peak:.3f}]" for flops, rate in gemms)
    text = f"""# Written by `trillion plan --calibrate` on {socket.gethostname()} ({time.strftime('%Y-%m-%d %H:%M')}).
# {'Peak from devices.toml' if spec else 'CPU: the peak is the best GEMM rate measured ({:.3g} FLOP/s)'.format(peak)}.
description = "calibrated: {name}, {world} {'GPUs' if on_gpu else 'processes'}, all-reduce bus bandwidth {bus / 1e9:.2f} GB/s"
gpus_per_node = {world}
intra_node = [{{ group = {world}, bandwidth_gbs = {bus / 1e9:.3f} }}]
node_bandwidth_gbs = {bus / 1e9 * world:.3f}
collective_efficiency = 1.0  # measured bus bandwidth already is the achieved figure

[device]
name = "{name}"
peak_tflops = {{ bf16 = {peak / 1e12:.4f}, fp32 = {peak / 1e12:.4f} }}
memory_gb = {(torch.cuda.get_device_properties(0).total_memory if on_gpu else os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')) / 1e9:.1f}
memory_bandwidth_gbs = {copy / 1e9:.2f}
memory_efficiency = 1.0
attention_efficiency = {max(rate for _, rate in gemms) / peak / 2:.3f}  # assumed: half the best GEMM rate
gemm_efficiency = [{curve}]
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
