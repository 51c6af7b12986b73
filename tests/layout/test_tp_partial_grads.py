"""Sequence-parallel norm weights get Partial gradients under TP without FSDP; the train step sums
them once, in one all-reduce, instead of letting every foreach op of clipping and AdamW all-reduce
them again (4 per norm per step before). Fake process group, one process: counts collectives and
placements, not values (the gloo parity tests compare the values with one process)."""

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from trillion.models import PRESETS, Transformer
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.parallelize import parallelize
from trillion.trainer.step import train_step

SEQ_LEN = 16


def _all_reduces_of_one_step(n_layers: int) -> tuple[int, list]:
    args = dataclasses.replace(
        PRESETS["debug"], n_layers=n_layers, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=32
    )
    dims = ParallelDims.of(tp=2, world_size=2)
    check_layout(dims.layout, args, SEQ_LEN)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, dims)
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    placements = []
    optimizer.register_step_pre_hook(
        lambda *_: placements.extend(p.grad.placements for p in model.parameters() if isinstance(p.grad, DTensor))
    )
    tokens = torch.randint(0, args.vocab_size, (2, SEQ_LEN + 1))
    with CommDebugMode() as comm:
        train_step(
            MicroBatchLoop(model, dims.layout),
            [(tokens[:, :-1], tokens[:, 1:])],
            optimizer,
            torch.amp.GradScaler("cpu", enabled=False),
            contextlib.nullcontext(),
            1.0,
            dims=dims,
        )
    counts = comm.get_comm_counts()
    return sum(n for op, n in counts.items() if "all_reduce" in str(op) or "allreduce" in str(op)), placements


def test_partial_gradients_are_all_reduced_once_per_step():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        one_layer, placements = _all_reduces_of_one_step(1)
        three_layers, _ = _all_reduces_of_one_step(3)
    finally:
        dist.destroy_process_group()
    assert placements and all(not any(p.is_partial() for p in grad) for grad in placements)
    assert any(grad == (Replicate(),) for grad in placements)  # the norms' summed gradients
    # 2 more norms per layer used to cost 8 more all-reduces; now the count does not grow with depth
    assert one_layer == three_layers
