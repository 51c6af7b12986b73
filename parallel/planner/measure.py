"""The measurements `trillion plan --calibrate` (planner/calibrate.py) makes on one device and among a
node's ranks, each the median of several timings after warm-up runs: GEMM rates, flash attention,
memory bandwidth, launch overhead, the all-reduce link, tensor parallelism's collectives as DTensor
issues them, and the host work TP adds per block.
"""

import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from trillion.kernels import attention
from trillion.models import Transformer
from trillion.models.args import ModelArgs
from trillion.parallel.tensor_parallel import apply_tensor_parallel

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
