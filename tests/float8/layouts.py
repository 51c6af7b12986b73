"""Emulated float8 under parallel layouts against one process: the parity harness's model, data and step
(tests/helpers/parity.py: fp32, gloo, 3 steps of 4 micro-batches) with the linears swapped for torchao's
Float8Linear (parallel/float8.py) and, under FSDP, the scales precomputed after each optimizer step as the
trainer does. `check_layouts` runs on every rank of a gloo group; rank 0 also runs the one-process
reference per recipe and compares.

Why the tolerance is the plain harness's: every layout quantises the same numbers with the same scales.
Data-parallel ranks take the one-process run's micro-batches (same sequences, same count per forward), so
each activation and gradient scale is computed over the same tensor; under TP the float8 styles reduce
their amaxes over the tp group (DTensor), and the weights' scales are the global amax (FSDP's precompute
all-reduces it). What remains is fp32 summation order (reduce-scatters, TP partial sums), a few ulps,
which could move a value across a float8 rounding boundary; `FLIP_ALLOWANCE` says how often that may
show, and the measured runs show none beyond the plain tolerance.
"""

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from tests.helpers.parity import FAMILIES, GLOBAL_BATCH, MAX_NORM, MICRO_BATCH, SEED, SEQ_LEN, STEPS, RandomWindows
from tests.helpers.parity import _full as full
from trillion.models import Transformer
from trillion.parallel.dims import ParallelDims, check_layout
from trillion.parallel.float8 import convert, register_scale_precompute
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.layout import layout_on, resolve_float8
from trillion.parallel.parallelize import parallelize
from trillion.trainer.data.loader import DataLoader
from trillion.trainer.step import train_step

TOLERANCE = {"rtol": 2e-4, "atol": 2e-6}  # tests/helpers/parity.py's fp32 tolerance, unchanged
FLIP_ALLOWANCE = 0.0  # share of a gradient's elements allowed outside it (a float8 rounding flip); none seen


def train_layout(case: dict, world_size: int) -> dict:
    """Run `case` (recipe, dp_shard, tp, fsdp_all_gather) on all ranks of the group, or alone (world_size 1)."""
    args = FAMILIES[case.get("family", "llama")]
    layout = layout_on(
        world_size, dp_shard=case.get("dp_shard", -1), tp=case.get("tp", 1), compile=bool(case.get("compile"))
    )
    recipe, gather = case["recipe"], case.get("fsdp_all_gather", "auto")  # recipe None: the plain fp32 run
    fsdp = layout.fsdp_enabled
    settings = resolve_float8(recipe, fsdp_enabled=fsdp, fsdp_all_gather=gather, emulate=True) if recipe else None
    dims = ParallelDims(dataclasses.replace(layout, float8=settings), world_size)
    check_layout(dims.layout, args, SEQ_LEN)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, dims, compile_backend="aot_eager")
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append({n: full(p.grad) for n, p in model.named_parameters()}))
    precomputed = register_scale_precompute(optimizer, model)
    loader = DataLoader(
        RandomWindows(args.vocab_size, SEQ_LEN + 1), GLOBAL_BATCH, MICRO_BATCH, dims.dp_rank, dims.dp_size
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses = []
    for _ in range(STEPS):
        loss, _ = train_step(
            MicroBatchLoop(model, dims.layout),
            loader.next_batch(),
            optimizer,
            scaler,
            contextlib.nullcontext(),
            MAX_NORM,
            dims=dims,
        )
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "precomputed": precomputed, "settings": settings}


def compare(name: str, got: dict, want: dict) -> list[str]:
    """What differs between a layout's run and the one-process run, beyond TOLERANCE; [] when nothing."""
    problems = []
    for step, (mine, theirs) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        for key, value in theirs.items():
            off = ~torch.isclose(mine[key], value, **TOLERANCE)
            if off.float().mean() > FLIP_ALLOWANCE:
                worst = (mine[key] - value).abs().max().item()
                problems.append(f"{name}: step {step} {key}: {int(off.sum())}/{off.numel()} off, max {worst:.3g}")
    try:
        torch.testing.assert_close(got["losses"], want["losses"], **TOLERANCE)
    except AssertionError as error:
        problems.append(f"{name}: losses {got['losses']} vs {want['losses']}: {str(error).splitlines()[-1]}")
    return problems


def check_layouts(rank: int, world_size: int, cases: list[dict], control: bool = True) -> None:
    """Entry point for run_ranks: each case against the one-process float8 run of its recipe (rank 0 compares);
    `control`: also show that the plain run lies outside the tolerance of each float8 reference."""
    references, problems = {}, []
    for case in cases:
        result = train_layout(case, world_size)
        if rank == 0:
            if case["recipe"] not in references:
                references[case["recipe"]] = train_layout({"recipe": case["recipe"]}, 1)
            assert result["settings"].fsdp_all_gather == case.get("expect_gather", False), case
            assert result["precomputed"] == result["settings"].fsdp_all_gather, case
            problems += compare(case["name"], result, references[case["recipe"]])
        dist.barrier()
    assert not problems, "\n".join(problems)
    if rank == 0 and control:  # the tolerance is tighter than float8's own effect: the plain run is far outside
        plain = train_layout({"recipe": None}, 1)
        for recipe, reference in references.items():
            assert len(compare(f"plain vs {recipe}", plain, reference)) > len(reference["grads"]), recipe


def converted_linears(model_args, recipe: str = "tensorwise", tp: int = 1) -> dict:
    """{linear name: None if converted, else why kept} of a meta model, as parallelize's swap decides."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(model_args))
    return convert(model, resolve_float8(recipe, fsdp_enabled=False, emulate=True), tp=tp), model
