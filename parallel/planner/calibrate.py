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
"""

import dataclasses
import json
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trillion.devices import lookup_device
from trillion.kernels import attention
from trillion.models import Transformer
from trillion.models.args import ModelArgs
from trillion.parallel.tensor_parallel import apply_tensor_parallel

SQUARE_GEMMS = {
    "cpu": ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024)),
    "gpu": ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 8192)),
}
COLLECTIVE_BYTES = {"cpu": 16 * 2**20, "gpu": 256 * 2**20}
WARMUP, REPEATS = 2, 5
MIN_TIMING_S = {"cpu": 0.2, "cuda": 0.02}  # one timing loops fn at least this long: a scheduler slice is ~4 ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device, calls: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def median_seconds(fn, device: torch.device, repeats: int = REPEATS, warmup: int = WARMUP, calls: int = 0) -> float:
    """Median seconds of one fn() over `repeats` timings after `warmup` calls, each timing looping fn
    for at least MIN_TIMING_S (the median, because a shared machine's neighbours make single
    timings unreliable). Collectives pass `calls`: every rank must make the same number."""
    for _ in range(warmup):
        fn()
    calls = calls or max(1, math.ceil(MIN_TIMING_S[device.type] / max(_seconds(fn, device, 1), 1e-7)))
    return statistics.median(_seconds(fn, device, calls) for _ in range(repeats))


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


def measure_gemms(shapes, device: torch.device, dtype: torch.dtype) -> list[tuple[float, float]]:
    """(FLOPs of one GEMM, achieved FLOP/s) per shape."""
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        flops = 2.0 * m * k * n
        out.append((flops, flops / median_seconds(lambda: a @ b, device)))
    return out


def measure_attention(
    args: ModelArgs, micro_batch: int, seq_len: int, device: torch.device, dtype: torch.dtype
) -> float:
    """FLOP/s of causal attention forward and backward, counted as the planner counts it:
    2 b s^2 q forward (half of the 4 b s^2 q of a full mask), 2.5 times that backward."""
    shape = (micro_batch, args.n_heads, seq_len, args.head_dim)
    kv_shape = (micro_batch, args.kv_heads, seq_len, args.head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(kv_shape, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(kv_shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=dtype)

    def step():
        attention(q, k, v, impl=args.attention_impl, causal=True).backward(grad)

    flops = 3.5 * 2.0 * micro_batch * seq_len * seq_len * args.n_heads * args.head_dim
    return flops / median_seconds(step, device)


def measure_copy_bandwidth(device: torch.device) -> float:
    x = torch.empty((256 if device.type == "cuda" else 64) * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / median_seconds(lambda: y.copy_(x), device)  # read + write


def measure_launch_overhead(device: torch.device) -> float:
    """Seconds of one kernel that does (almost) nothing: dispatch and launch."""
    x = torch.zeros(1, device=device)
    return median_seconds(lambda: x.add_(1.0), device)


def all_reduce_link(device: torch.device, world: int, nbytes: int, group=None) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency per ring step in s) of all-reduce among `world` ranks, in
    the planner's ring model 2 ((n-1)/n bytes / bandwidth + (n-1) latency): the latency from a
    4-byte all-reduce, the bandwidth from an nbytes one less that latency."""
    small, large = torch.ones(1, device=device), torch.ones(nbytes // 4, device=device)
    latency = median_seconds(lambda: dist.all_reduce(small, group=group), device, calls=20) / (2 * (world - 1))
    seconds = median_seconds(lambda: dist.all_reduce(large, group=group), device, calls=2)
    return 2 * (world - 1) / world * nbytes / max(seconds - 2 * (world - 1) * latency, 1e-9), latency


def tp_collective_links(device: torch.device, world: int, args: ModelArgs, tokens: int, group=None) -> dict:
    """{kind: (bandwidth in bytes/s, latency per ring step in s)} of the all-gather, reduce-scatter
    and all-reduce among `world` ranks as tensor parallelism issues them: DTensor redistributions
    (Shard -> Replicate, Partial -> Shard, Partial -> Replicate), so DTensor's own host work per
    collective is in the figures, in the planner's ring model ((n-1)/n bytes / bandwidth + (n-1)
    latency; twice that for an all-reduce). The latency from one element per rank, the bandwidth
    from one of the model's activations (tokens x dim) less that."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    to_full, to_shard = [Replicate()], [Shard(0)]

    def redistribute(kind: str, local: torch.Tensor):
        source = [Shard(0)] if kind == "all_gather" else [Partial()]
        return lambda: (
            DTensor.from_local(local, mesh, source, run_check=False)
            .redistribute(mesh, to_shard if kind == "reduce_scatter" else to_full)
            .to_local()
        )

    calls = 20  # every rank makes the same number of collectives
    activation = tokens * args.dim // world * world
    links = {}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        shard = kind == "all_gather"  # an all-gather starts from this rank's 1/world
        tiny = torch.ones(1 if shard else world, device=device, dtype=dtype)
        large = torch.ones(activation // world if shard else activation, device=device, dtype=dtype)
        small_s = median_seconds(redistribute(kind, tiny), device, calls=calls)
        large_s = median_seconds(redistribute(kind, large), device, calls=calls // 4)
        steps = (2 if kind == "all_reduce" else 1) * (world - 1)
        links[kind] = (steps / world * activation * tiny.element_size() / max(large_s - small_s, 1e-9), small_s / steps)
    return links


def tp_layer_host_seconds(
    device: torch.device, world: int, args: ModelArgs, links: dict, group=None
) -> tuple[float, float]:
    """(forward, backward) seconds of host work that tensor parallelism adds to one of the model's
    blocks beyond its collectives: DTensor's dispatch and sharding propagation of some 150 ops per
    block, a fixed cost per op. On a CPU the host's work is the step's; on a GPU it runs ahead of
    the kernels and adds only when they are shorter, which the planner does not model, so a GPU
    calibration does not measure it. Measured
    on the model's blocks shrunk to a few tokens and 8 dimensions per head, so that the host work is
    all there is: per block (5 blocks less 1, quartered) with TP over `world` ranks, less the same
    without TP, less the block's 4 all-gathers and 4 reduce-scatters at their measured latency."""
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    tokens = torch.zeros(1, 2 * world, dtype=torch.long, device=device)

    def per_block(parallel: bool) -> tuple[float, float]:
        timings = []
        for layers in (1, 5):
            small = dataclasses.replace(
                args,
                n_layers=layers,
                dim=8 * args.n_heads,
                ffn_dim=16 * args.n_heads,
                vocab_size=8 * world,
                max_seq_len=2 * world,
            )
            torch.manual_seed(0)
            model = Transformer(small).to(device)
            if parallel:
                apply_tensor_parallel(model, mesh)

            def logits():
                return model(tokens)

            local = (lambda out: out.to_local()) if parallel else (lambda out: out)
            forward = median_seconds(logits, device, calls=10)
            both = median_seconds(lambda: local(logits()).sum().backward(), device, calls=10)
            timings.append((forward, both - forward))
        (f1, b1), (f3, b3) = timings
        return (f3 - f1) / 4, (b3 - b1) / 4

    (tp_forward, tp_backward), (plain_forward, plain_backward) = per_block(True), per_block(False)
    latency = {kind: latency * (world - 1) for kind, (_, latency) in links.items()}
    collectives = 2 * latency["all_gather"] + 2 * latency["reduce_scatter"]  # each pass
    return max(tp_forward - plain_forward - collectives, 0.0), max(tp_backward - plain_backward - collectives, 0.0)


def measure_device(
    device: torch.device, shapes, args: ModelArgs | None, seq_len: int, micro_batch: int, barrier=lambda: None
) -> dict:
    """What one device delivers: GEMM rates per shape, attention, copy bandwidth, launch overhead.
    `barrier` lines the ranks up before each measurement, so each is taken with all of them busy,
    as they are in training (a CPU's cores share caches, memory and the machine's other load)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    barrier()
    gemms = sorted(measure_gemms(shapes, device, dtype))
    barrier()
    attention_rate = measure_attention(args, micro_batch, seq_len, device, dtype) if args else 0.0
    barrier()
    copy = measure_copy_bandwidth(device)
    barrier()
    return {"gemms": gemms, "attention": attention_rate, "copy": copy, "launch": measure_launch_overhead(device)}


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
    curve = ", ".join(f"[{flops:.4g}, {min(rate / peak, 1.0):.4f}]" for flops, rate in gemms)
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
