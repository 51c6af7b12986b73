"""Parity harness: train a small model for a few steps under a parallel layout and compare every
loss, gradient norm, gradient (full_tensor) and initial weight with one process, same seed, fp32.

A case is a dict: family (llama | gpt), dp_replicate, dp_shard, cp, tp, mode (zero1/2/3), ac, compile,
attention (kernels.attention backend; the reference runs sdpa);
`differs: True` expects the case NOT to match (a broken layout the comparison must catch).
`check_cases` runs on every rank of a gloo group; rank 0 also runs the one-process reference (once
per family, plain: no AC, no compile) and compares.
"""

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trillion.models import PRESETS, Transformer
from trillion.parallel.dims import ParallelDims
from trillion.parallel.forward_backward import MicroBatchLoop
from trillion.parallel.parallelize import parallelize
from trillion.trainer.data.loader import DataLoader
from trillion.trainer.step import train_step

FAMILIES = {
    "llama": dataclasses.replace(
        PRESETS["debug"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=32
    ),
    "gpt": dataclasses.replace(PRESETS["debug-gpt"], n_layers=2, dim=64, n_heads=4, vocab_size=128, max_seq_len=32),
}
SEQ_LEN, GLOBAL_BATCH, MICRO_BATCH, STEPS, SEED = 16, 8, 2, 3, 11
MAX_NORM = float(os.environ.get("PARITY_MAX_NORM", 0.5))  # 0: no clipping, to localize a wrong gradient


class RandomWindows:
    """Stands in for the packed corpus: the same token windows for every layout."""

    def __init__(self, vocab_size: int, window: int):
        self.vocab_size, self.window = vocab_size, window
        self.generator = torch.Generator().manual_seed(SEED)

    def next_windows(self, count: int) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (count, self.window), generator=self.generator)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def train_case(case: dict, world_size: int) -> dict:
    """Run the case on all ranks of the current group (or alone when world_size is 1)."""
    args = dataclasses.replace(FAMILIES[case["family"]], attention_impl=case.get("attention", "sdpa"))
    dims = ParallelDims.of(
        dp_replicate=case.get("dp_replicate", 1),
        dp_shard=case.get("dp_shard", -1),
        cp=case.get("cp", 1),
        tp=case.get("tp", 1),
        world_size=world_size,
    )
    dims.validate(args, SEQ_LEN)
    dims.build_mesh("cpu")
    mode = case.get("mode", "zero3")
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(
        model,
        dims,
        dp_shard_mode=mode,
        activation_checkpoint=case.get("ac", "none"),
        compile=bool(case.get("compile")),
        compile_backend=case.get("compile") or "inductor",
    )
    if "attend" in case:  # a replacement attention, for cases that must fail
        for block in model.layers.values():
            block.attention.attend = case["attend"]
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    initial = {name: _full(p) for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    grads = []
    optimizer.register_step_pre_hook(
        lambda *_: grads.append({name: _full(p.grad) for name, p in model.named_parameters()})
    )
    loader = DataLoader(
        RandomWindows(args.vocab_size, SEQ_LEN + 1), GLOBAL_BATCH, MICRO_BATCH, dims.dp_rank, dims.dp_size
    )
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses, norms = [], []
    for _ in range(STEPS):
        loss, norm = train_step(
            MicroBatchLoop(model, dims.tp_enabled, mode),
            loader.next_batch(),
            optimizer,
            scaler,
            contextlib.nullcontext(),
            MAX_NORM,
            dims=dims,
        )
        losses.append(loss.item())
        norms.append(norm.item())
    return {"losses": losses, "norms": norms, "grads": grads, "initial": initial}


def _compare(name: str, actual: dict, expected: dict, exact: bool = False, tol: dict | None = None) -> None:
    tol = tol or ({"rtol": 0, "atol": 0} if exact else {"rtol": 2e-4, "atol": 2e-6})
    assert actual["initial"].keys() == expected["initial"].keys(), name
    for key, value in expected["initial"].items():
        assert torch.equal(actual["initial"][key], value), f"{name}: initial value of {key} differs"
    assert len(actual["grads"]) == len(expected["grads"]) == STEPS, name
    for step, (got, want) in enumerate(zip(actual["grads"], expected["grads"])):
        wrong = []
        for key, value in want.items():
            assert value.abs().sum() > 0, f"{name}: reference gradient of {key} is zero"
            try:
                torch.testing.assert_close(got[key], value, **tol)
            except AssertionError as error:
                wrong.append(f"{key}: {str(error).splitlines()[-3]}")
        assert not wrong, f"{name}: step {step}: {len(wrong)} gradients differ:\n" + "\n".join(wrong)
    torch.testing.assert_close(actual["losses"], expected["losses"], **tol, msg=lambda m: f"{name}: losses\n{m}")
    torch.testing.assert_close(actual["norms"], expected["norms"], **tol, msg=lambda m: f"{name}: grad norms\n{m}")


def check_cases(rank: int, world_size: int, cases: list[dict]) -> None:
    """Entry point for run_ranks: every case against the one-process run (rank 0 compares)."""
    references, results = {}, {}
    for case in cases:
        label = case.get("name") or ", ".join(f"{k}={v}" for k, v in case.items())
        result = train_case(case, world_size)
        results[label] = result
        if rank == 0:
            family = case["family"]
            if family not in references:
                references[family] = _run_alone({"family": family})
            try:
                _compare(label, result, references[family], exact=case.get("exact", False))
            except AssertionError as error:
                if case.get("differs"):
                    print("DIFFERS as expected", label, flush=True)
                elif not os.environ.get("PARITY_KEEP_GOING"):
                    raise
                else:
                    print("FAILED", str(error)[:600], flush=True)
            else:
                assert not case.get("differs"), f"{label}: matches one process, but the case must not"
                print("PASSED", label, flush=True)
            if "same_as" in case:  # e.g. AC on vs off in the same layout: bit-identical
                _compare(f"{label} vs {case['same_as']}", result, results[case["same_as"]], exact=True)
        dist.barrier()


def _run_alone(case: dict) -> dict:
    """The one-process reference, run on this rank outside the process group."""
    return train_case(case, world_size=1)
