"""Context-parallel attention: how much of a block's attention time is the K/V exchange.

    python experiments/bench/context_parallel.py [--seq 4096] [--cp 2] [--impl sdpa]

Spawns cp ranks (gloo on CPU, NCCL on GPUs, one GPU each) and times, per rank, forward + backward
of trillion.parallel.context_parallel.attention_across_shards on the rank's share of one sequence
(Llama-like: 32 query heads, 8 KV heads, head dim 128 on GPUs; 8/2/64 on CPU), and the same with
the exchange alone (the K/V all-gather and its dK/dV reduce-scatter on the same tensors). The
exchange's share is what a ring, overlapping it with compute, could at most hide.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.bench.timing import median_seconds  # noqa: E402


def _rank(rank: int, cp: int, store: str, seq: int, impl: str) -> None:
    from torch.distributed._functional_collectives import all_gather_single

    from trillion.parallel.context_parallel import attention_across_shards

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(store, cp), rank=rank, world_size=cp)
    heads, kv_heads, dim, dtype = (32, 8, 128, torch.bfloat16) if cuda else (8, 2, 64, torch.float32)
    local = seq // cp
    q = torch.randn(1, heads, local, dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, local, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)

    def attention():
        out = attention_across_shards(q, k, v, group=dist.group.WORLD, rank=rank, cp=cp, impl=impl)
        out.backward(grad)

    def exchange():
        for t in (k, v):
            gathered = all_gather_single(t, 0, dist.group.WORLD)
            gathered.backward(torch.ones_like(gathered))

    total = median_seconds(attention, device, warmup=2, repeats=5)
    comm = median_seconds(exchange, device, warmup=2, repeats=5)
    if rank == 0:
        print(
            f"seq {seq}, cp {cp}, {impl}, {dtype}, {device.type}: attention fwd+bwd {total * 1e3:.1f} ms per rank, "
            f"K/V exchange {comm * 1e3:.2f} ms ({100 * comm / total:.1f}%)",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--impl", default="sdpa")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(args.cp, os.path.join(folder, "store"), args.seq, args.impl), nprocs=args.cp)


if __name__ == "__main__":
    main()
