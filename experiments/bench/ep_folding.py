"""Rows and bytes each rank's expert dispatch sends with ep folded over the tp ranks (parallel.etp=1) against the same
layout with the experts tensor-parallel (etp = tp: every tp rank sends its whole tp group's tokens, as the dispatch
did before folding), counted where the dispatch posts its all-to-alls (parallel/ep_exchange.py Traffic) in a real
gloo run: 4 processes, tp 2 x dp_shard 2, ep 2, debug-moe's kind (sigmoid routing, 8 experts top-2, a shared expert),
the same weights and the same token windows under both layouts, forwards of the trainer's parallel model. One
direction: the combine sends as many rows back, and the backward the same again.

    python experiments/bench/ep_folding.py [--micro-batches 8] [--seq-len 256] [--mode rank]
    python experiments/bench/ep_folding.py --smoke     # a few windows, seconds (tested)
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from trillion.models import PRESETS, Transformer  # noqa: E402
from trillion.parallel.dims import ParallelDims  # noqa: E402
from trillion.parallel.ep_exchange import STAGES, Traffic  # noqa: E402
from trillion.parallel.expert_parallel import expert_dispatches  # noqa: E402
from trillion.parallel.parallelize import parallelize  # noqa: E402

WORLD, TP, EP, SEED = 4, 2, 2, 7
MODEL = dataclasses.replace(PRESETS["debug-moe"], n_layers=3, vocab_size=256, max_seq_len=1024)


def count_rows(layout: dict, micro_batches: int, batch: int, seq_len: int, mode: str) -> dict:
    """This rank's dispatch traffic over `micro_batches` forwards of `batch` windows of `seq_len` tokens per
    data-parallel rank (the windows one generator's, each data-parallel rank its slice), under `layout` (etp)."""
    dims = ParallelDims.of(WORLD, tp=TP, dp_shard=WORLD // TP, ep=EP, ep_dispatch=mode, ranks_per_node=WORLD, **layout)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(MODEL)
    parallelize(model, dims, fsdp=False)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    traffic = Traffic()
    for dispatch in expert_dispatches(model):
        dispatch.exchange.traffic = traffic
    windows = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _ in range(micro_batches):
            tokens = torch.randint(0, MODEL.vocab_size, (dims.dp_size * batch, seq_len), generator=windows)
            model(tokens[dims.dp_rank * batch : (dims.dp_rank + 1) * batch])
    others = sum(traffic.sent_rows.get(("dispatch", stage), 0) for stage in STAGES)
    sent_bytes = sum(traffic.sent_bytes.get((what, stage), 0) for what in ("dispatch", "routing") for stage in STAGES)
    return {
        "rows_to_others": others,
        "bytes_to_others": sent_bytes,
        "rows_posted": traffic.posted_rows.get("dispatch", 0),
        "tokens_routed": traffic.tokens,
    }


def _rank(rank: int, store: str, ns: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        shape = (ns.micro_batches, ns.batch, ns.seq_len, ns.mode)
        record = {name: count_rows({"etp": etp}, *shape) for name, etp in (("folded", 1), ("tensor_parallel", TP))}
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, record)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def measure(ns: argparse.Namespace) -> list[dict]:
    """Every rank's record: {layout: count_rows}, the folded layout's and the tensor-parallel one's."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        mp.spawn(_rank, args=(os.path.join(folder, "store"), ns, out), nprocs=WORLD, join=True)
        return json.loads(Path(out).read_text())


def table(records: list[dict]) -> str:
    lines = [
        "| rank | tokens routed (2 MoE layers), etp 1 / etp 2 | rows to other ranks, etp 1 / etp 2 | ratio | rows "
        "posted (own share too), etp 1 / etp 2 | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for rank, record in enumerate(records):
        folded, whole = record["folded"], record["tensor_parallel"]
        lines.append(
            f"| {rank} | {folded['tokens_routed']} / {whole['tokens_routed']} | {folded['rows_to_others']} / "
            f"{whole['rows_to_others']} | {folded['rows_to_others'] / whole['rows_to_others']:.3f} | "
            f"{folded['rows_posted']} / {whole['rows_posted']} | {folded['rows_posted'] / whole['rows_posted']:.3f} |"
        )
    total = {k: sum(r[k]["rows_to_others"] for r in records) for k in ("folded", "tensor_parallel")}
    lines.append(f"| all | | {total['folded']} / {total['tensor_parallel']} | "
                 f"{total['folded'] / total['tensor_parallel']:.3f} | | |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=2, help="windows per micro-batch per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--mode", choices=("expert", "rank"), default="rank", help="parallel.ep_dispatch")
    p.add_argument("--smoke", action="store_true")
    ns = p.parse_args(argv)
    if ns.smoke:
        ns.micro_batches, ns.seq_len = 1, 32
    records = measure(ns)
    print(table(records))
    print(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
