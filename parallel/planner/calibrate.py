"""`trillion plan --calibrate`: measure this machine and write a hardware profile the planner reads.

Measured, each as the median of several timings after warm-up runs:
  - GEMMs of the shapes the planner times for a model (every layer GEMM and the output projection
    at tensor-parallel degrees 1 and 2, for one micro-batch), plus square GEMMs up to 16384 x
    16384 x 8192 on a GPU: the GEMM efficiency curve;
  - flash attention, forward and backward, at the model's heads and sequence length;
  - memory bandwidth (a copy) and the launch overhead of a kernel that does nothing;
  - collectives among this node's devices (all-reduce bus bandwidth and latency; gloo processes
    on a CPU); with a model, also the all-gather, reduce-scatter and all-reduce as tensor
    parallelism issues them (DTensor redistributions of the model's activation), whose cost on
    gloo differs from the ring model of one large all-reduce (a reduce-scatter costs about what an
    all-reduce of the same bytes does), and whose host work matters for a small model.
The network between nodes is measured only when the calibration runs across nodes (torchrun
with more than one node): never assumed to be as fast as the links inside one. A profile measured
on one node says so, and the planner refuses layouts that cross nodes with it.
On a CPU nobody publishes a peak, so the profile's peak is the best rate measured (GEMMs and
attention); on a GPU the peak comes from devices.toml.
The measurements themselves are planner/measure.py's.
"""

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trillion.devices import lookup_device
from trillion.models.args import ModelArgs
from trillion.parallel.planner.measure import (
    MIN_TIMING_S,
    REPEATS,
    WARMUP,
    all_reduce_link,
    measure_device,
    tp_collective_links,
    tp_layer_host_seconds,
)

SQUARE_GEMMS = {
    "cpu": ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024)),
    "gpu": ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 8192)),
}
COLLECTIVE_BYTES = {"cpu": 16 * 2**20, "gpu": 256 * 2**20}


def model_gemm_shapes(args: ModelArgs, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every GEMM the planner times for one layer and the output, at tp 1 and 2."""
    h, q, kv, f = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden
    shapes = set()
    for tp in (1, 2):
        shapes |= {
            (tokens, h, q // tp),
            (tokens, h, kv // tp),
            (tokens, q // tp, h),
            (tokens, h, f // tp),
            (tokens, f // tp, h),
            (tokens, h, args.vocab_size // tp),
        }
    return sorted(shapes)


def _worker(rank: int, world: int, init_file: str, backend: str, plan: dict, out_file: str) -> None:
    """One of `world` processes of this node: measure the device with all of them busy, then the
    collectives among them; rank 0 writes what it saw."""
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    MIN_TIMING_S.update(plan["min_timing"])  # a spawned process starts from the module's defaults
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    measured = measure_device(device, plan["shapes"], plan["args"], plan["seq_len"], plan["micro_batch"], dist.barrier)
    measured["link"] = all_reduce_link(device, world, plan["nbytes"])
    if plan["args"]:
        measured["tp_links"] = tp_collective_links(device, world, plan["args"], plan["seq_len"] * plan["micro_batch"])
        if device.type == "cpu":
            measured["tp_host"] = tp_layer_host_seconds(device, world, plan["args"], measured["tp_links"])
    if rank == 0:
        Path(out_file).write_text(json.dumps(measured))
    dist.destroy_process_group()


def measure_node(world: int, on_gpu: bool, plan: dict) -> dict:
    """measure_device and the all-reduce (bandwidth, latency) among `world` processes of this node."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "measured.json")
        mp.start_processes(
            _worker,
            nprocs=world,
            start_method="spawn",
            args=(world, os.path.join(tmp, "init"), "nccl" if on_gpu else "gloo", plan, out_file),
        )
        return json.loads(Path(out_file).read_text())


def measure_in_job(on_gpu: bool, plan: dict) -> tuple[int, dict] | None:
    """Under a multi-node torchrun job: (GPUs per node, measure_device with every rank busy plus the
    all-reduce (bandwidth, latency) among one node's ranks ("link") and among one rank of each node
    ("network")); None outside such a job. Every rank returns; rank 0's figures are written."""
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    if not local or world <= local:
        return None
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
    measured = measure_device(device, plan["shapes"], plan["args"], plan["seq_len"], plan["micro_batch"], dist.barrier)
    nodes = world // local
    # every rank creates every group, in the same order, as new_group requires
    intra = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]
    inter = [dist.new_group(list(range(r, world, local))) for r in range(local)]
    measured["link"] = all_reduce_link(device, local, plan["nbytes"], intra[rank // local]) if local > 1 else (0.0, 0.0)
    if plan["args"] and local > 1:
        measured["tp_links"] = tp_collective_links(
            device, local, plan["args"], plan["seq_len"] * plan["micro_batch"], intra[rank // local]
        )
        if device.type == "cpu":
            measured["tp_host"] = tp_layer_host_seconds(
                device, local, plan["args"], measured["tp_links"], intra[rank // local]
            )
    measured["network"] = all_reduce_link(device, nodes, plan["nbytes"], inter[rank % local])
    dist.destroy_process_group()
    return local, measured


def calibrate(
    out: Path, args: ModelArgs | None = None, seq_len: int = 0, micro_batch: int = 1, processes: int = 2
) -> Path:
    """Measure this machine into a profile at `out`: a node of `processes` CPU processes (of all its
    GPUs on a GPU machine), each measured while all are busy. With a model, its own GEMM shapes and
    attention. Under a multi-node torchrun job every rank measures and rank 0 writes."""
    on_gpu = torch.cuda.is_available()
    if on_gpu and "LOCAL_RANK" in os.environ:  # under torchrun: this rank's own GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    spec = (
        lookup_device(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count)
        if on_gpu
        else None
    )
    plan = _measurement_plan(on_gpu, args, seq_len, micro_batch)
    node = _measure(on_gpu, plan, processes)
    if node is None:
        return out
    world, measured = node
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_profile_toml(measured, world, on_gpu, spec, args, seq_len, micro_batch))
    return out


def _measurement_plan(on_gpu: bool, args: ModelArgs | None, seq_len: int, micro_batch: int) -> dict:
    """What every measuring process needs: GEMM shapes (the model's with one), sizes and timing floors."""
    kind = "gpu" if on_gpu else "cpu"
    shapes = list(SQUARE_GEMMS[kind]) + (model_gemm_shapes(args, micro_batch * seq_len) if args else [])
    return {
        "shapes": shapes,
        "args": args,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "nbytes": COLLECTIVE_BYTES[kind],
        "min_timing": dict(MIN_TIMING_S),
    }


def _measure(on_gpu: bool, plan: dict, processes: int) -> tuple[int, dict] | None:
    """(devices per node, what they measured): across a multi-node torchrun job, else among this
    node's GPUs or `processes` CPU processes, else on this one device; None on the ranks of a job
    other than 0, which write nothing."""
    job = measure_in_job(on_gpu, plan)
    if job is not None and int(os.environ["RANK"]) != 0:
        return None
    if job:
        return job
    world = torch.cuda.device_count() if on_gpu else processes
    if world > 1:
        return world, measure_node(world, on_gpu, plan)
    device = torch.device("cuda" if on_gpu else "cpu")
    measured = measure_device(device, plan["shapes"], plan["args"], plan["seq_len"], plan["micro_batch"])
    return world, {**measured, "link": (0.0, 0.0)}


def _tp_host_line(host) -> str:
    """The profile's tp_layer_host_us line, when measured (a CPU's only: tp_layer_host_seconds says why)."""
    if not host:
        return ""
    return (
        f"tp_layer_host_us = {{ forward = {host[0] * 1e6:.1f}, backward = {host[1] * 1e6:.1f} }}  # measured: "
        "DTensor's host work per block under TP, beyond its collectives\n"
    )


def _attention_line(args: ModelArgs | None, attention_rate: float, gemms, peak: float, seq_len, micro_batch) -> str:
    if args:
        return (
            f"attention_efficiency = {attention_rate / peak:.4f}  # measured: {args.n_heads} heads of "
            f"{args.head_dim}, {micro_batch} x {seq_len} tokens, {args.attention_impl}"
        )
    return (
        f"attention_efficiency = {max(rate for _, rate in gemms) / peak / 2:.4f}  "
        "# not measured (no --model): half the best GEMM rate"
    )


def _profile_toml(measured: dict, world: int, on_gpu: bool, spec, args, seq_len: int, micro_batch: int) -> str:
    """The hardware profile's TOML text from what the node measured."""
    gemms, attention_rate, copy, launch = measured["gemms"], measured["attention"], measured["copy"], measured["launch"]
    (bus, latency), (network, network_latency) = measured["link"], measured.get("network", (0.0, 0.0))
    # On a CPU the peak is the best rate measured, attention included: a small model's attention can
    # outrun its small GEMMs, and a share of peak above 1 would make the planner faster than measured.
    peak = spec.peak_tflops_bf16 * 1e12 if spec else max([rate for _, rate in gemms] + [attention_rate or 0.0])
    name = (spec.name if spec else "cpu") + "-calibrated"
    kinds = "".join(
        f", {kind} = {{ bandwidth_gbs = {bandwidth / 1e9:.4f}, latency_us = {latency * 1e6:.2f} }}"
        for kind, (bandwidth, latency) in measured.get("tp_links", {}).items()
    )
    host_line = _tp_host_line(measured.get("tp_host"))
    curve = ", ".join(f"[{flops:.4g}, {min(rate / peak, 1.0):.4g}]" for flops, rate in gemms)  # never rounded to 0
    attention_line = _attention_line(args, attention_rate, gemms, peak, seq_len, micro_batch)
    memory = (
        torch.cuda.get_device_properties(0).total_memory
        if on_gpu
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    written = f"{socket.gethostname()} ({time.strftime('%Y-%m-%d %H:%M')})"
    peak_note = "Peak from devices.toml" if spec else f"CPU: the peak is the best rate measured ({peak:.4g} FLOP/s)"
    units = "GPUs" if on_gpu else "processes"
    overlaps = (
        "true  # copy engines and NICs move the bytes"
        if on_gpu
        else "false  # gloo moves the bytes on the cores that compute"
    )
    return f"""# Written by `trillion plan --calibrate` on {written}: medians of
# {REPEATS} timings after {WARMUP} warm-up runs. {peak_note}.
# node_bandwidth_gbs = 0: the network was not measured (one node), and the planner refuses layouts
# that cross nodes with this profile; calibrate under a torchrun job of two or more nodes to measure it.
description = "calibrated: {name}, {world} {units}, all-reduce bus bandwidth {bus / 1e9:.3f} GB/s"
gpus_per_node = {world}
# intra_node: the measured all-reduce bus bandwidth (0: one device); with a model, each collective kind
# as TP issues them, DTensor redistributions of the model's activation (calibrate.tp_collective_links)
intra_node = [{{ group = {world}, bandwidth_gbs = {bus / 1e9:.4f}{kinds} }}]
node_bandwidth_gbs = {network * world / 1e9:.4f}  # measured all-reduce bus bandwidth between nodes, per node
collective_efficiency = 1.0  # the bandwidth above is the achieved figure
link_latency_us = {latency * 1e6:.2f}  # measured: a 4-byte all-reduce, per ring step
network_latency_us = {network_latency * 1e6:.2f}
compute_dtype = "{"bf16" if on_gpu else "fp32"}"
overlaps_collectives = {overlaps}
{host_line}
[device]
name = "{name}"
peak_tflops = {{ bf16 = {peak / 1e12:.6f}, fp32 = {peak / 1e12:.6f} }}
memory_gb = {memory / 1e9:.1f}
memory_bandwidth_gbs = {copy / 1e9:.3f}  # measured copy (read + write)
memory_efficiency = 1.0
kernel_overhead_us = {launch * 1e6:.2f}  # measured: one tiny kernel
{attention_line}
gemm_efficiency = [{curve}]
"""
