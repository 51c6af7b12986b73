"""What the trainer adds to a step: `trillion train`'s loop next to a minimal hand-written PyTorch loop
of the same model, batches and optimizer, in one process or as 2 FSDP2 ranks (gloo, on the CPU).

    python experiments/bench/trainer_overhead.py                # debug model, 1 process, 15 steps, 4 repeats
    python experiments/bench/trainer_overhead.py --ranks 2      # the trainer at --parallel.dp_shard=2 vs FSDP2
    python experiments/bench/trainer_overhead.py --smoke [--ranks 2]   # seconds, for the test suite

The trainer's time per step is the wall clock between its first and last logged step (data loading,
LR schedule, metrics, everything the loop does), divided by the steps in between (`--metrics.log_freq`
is the step count, so only those two steps read the loss). The hand loop is measured the same way:
from the host read of its first step's loss to that of its last. It trains on the very batches the
trainer's loader gives each rank (read beforehand, so its data costs nothing), with the trainer's
optimizer (`build_optimizer`: AdamW, fused, the same lr and weight-decay groups) and gradient
clipping. With `--ranks 2` every process runs both: the trainer with `--parallel.dp_shard=2`, the hand
loop as `fully_shard` per block and then the root (blocks resharded after forward, the root not: the
trainer's default zero3) over a 1-D mesh of the 2 ranks. Every process uses `--threads` intra-op threads
(default 1: on shared cores a second OpenMP thread waits for a descheduled sibling at every op, which
turned this machine's load into four- to eightfold slowdowns). The hand loop's loss is the mean over its
rank's tokens and FSDP2 averages the gradients over the ranks (its default); the trainer sums them and
divides its loss by the global batch's token count: the same gradient. Both loops see the same first
batch and the same initial weights, so their first losses must agree: the script checks it.

Besides the wall clock, the CPU time the processes spend over the same window (time.process_time, summed
over the ranks; the trainer's read at the end of its first and last loop iterations through a RunHooks
iteration context) is compared: on cores other work shares it counts the work of the loop, not the
time it waited to be scheduled.

Repeats alternate between the two (trainer first in even repeats, the hand loop first in odd ones) and
the medians are compared, so a machine that is busy for a while slows both alike. The machine's load
average (os.getloadavg) is printed before and after: on shared cores the figures are only as good as
the spread of the repeats.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from trillion.models import Transformer
from trillion.trainer.assemble import build_model_args, resolve_layout
from trillion.trainer.config.schema import load_config
from trillion.trainer.data import build_data_loader, build_tokenizer, held_out_fraction
from trillion.trainer.optim import build_optimizer
from trillion.trainer.train import RunHooks, train

RUN_FLAGS = [  # what neither loop does: evaluation, checkpoints, wandb; progress as plain lines
    "--logging.wandb=false",
    "--checkpoint.save_final=false",
    "--logging.progress_bar=lines",
    "--eval.interval=0",
]
SMOKE_FLAGS = [
    "--model.n_layers=1",
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=2",
]


def trainer_run(overrides: list[str], steps: int, out: Path, rank: int) -> dict:
    """wall s/step (rank 0's metrics; None on other ranks), this process's CPU s/step, first step's loss."""
    config = load_config(
        None, [*overrides, f"--training.steps={steps}", f"--metrics.log_freq={steps}", f"--job.output_dir={out}"]
    )
    cpu = {}

    @contextlib.contextmanager
    def iteration(step: int):
        yield
        cpu[step] = time.process_time()  # after the step's log record, as the record's own time

    train(config, hooks=RunHooks(iteration=iteration))
    result = {"wall": None, "cpu": (cpu[steps] - cpu[1]) / (steps - 1), "loss": None}
    if rank == 0:
        first, last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        result.update(wall=(last["time"] - first["time"]) / (last["step"] - first["step"]), loss=first["loss"])
    return result


class HandLoop:
    """The hand-written loop: this rank's batches of the trainer's loader, read once up front."""

    def __init__(self, overrides: list[str], steps: int, rank: int, world_size: int):
        self.config = config = load_config(None, [*overrides, f"--training.steps={steps}"])
        t = config.training
        tokenizer = build_tokenizer(config.tokenizer)
        layout = resolve_layout(config, world_size)  # dp_shard = world size: one rank's share of the batch
        self.args = build_model_args(config, tokenizer.vocab_size, layout)
        micro_batch_size = layout.micro_batch_size
        loader = build_data_loader(
            config.data,
            tokenizer,
            seed=config.job.seed,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            micro_batch_size=micro_batch_size,
            held_out=held_out_fraction(config.eval),
            dp_rank=rank,
            dp_size=world_size,
        )
        self.batches = [loader.next_batch() for _ in range(steps)]
        self.world_size = world_size

    def build(self):
        if self.world_size == 1:
            model = Transformer(self.args)
        else:  # FSDP2 as a user writes it: each block, then the root (which stays gathered after forward)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (self.world_size,))
            with torch.device("meta"):
                model = Transformer(self.args)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            model.to_empty(device="cpu")
        model.init_weights(self.config.job.seed)
        return model, build_optimizer(model, self.config.optimizer, "cpu")

    def run(self) -> dict:
        """wall and this process's CPU s/step, first step's loss averaged over the ranks."""
        model, optimizer = self.build()
        max_norm = self.config.training.max_grad_norm

        def step(batch):
            loss = 0.0
            for inputs, labels in batch:  # micro-batches: accumulate the mean of their means
                micro = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1)) / len(batch)
                micro.backward()
                loss = loss + micro.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # FSDP2: DTensor gradients, the full norm
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        first = step(self.batches[0]).item()  # the trainer's first step is logged, and not timed either
        start, start_cpu = time.perf_counter(), time.process_time()
        for batch in self.batches[1:]:
            loss = step(batch)
        loss.item()
        steps = len(self.batches) - 1
        result = {"wall": (time.perf_counter() - start) / steps, "cpu": (time.process_time() - start_cpu) / steps}
        if self.world_size > 1:  # outside the timing: the global mean, as the trainer reports it
            first_loss = torch.tensor(first)
            dist.all_reduce(first_loss)
            first = first_loss.item() / self.world_size
        return {**result, "loss": first}


def measure(overrides: list[str], steps: int, repeats: int, root: Path, rank: int, world_size: int) -> dict:
    """Alternating repeats of both loops: {loop: [result per repeat]}, CPU times summed over the ranks."""
    hand = HandLoop(overrides, steps, rank, world_size)
    results = {"trainer": [], "hand": []}
    for repeat in range(repeats):
        for loop in ("trainer", "hand") if repeat % 2 == 0 else ("hand", "trainer"):
            if loop == "trainer":
                results[loop].append(trainer_run(overrides, steps, root / f"trainer-{repeat}", rank))
            else:
                results[loop].append(hand.run())
    if world_size > 1:  # the work of both ranks
        for runs in results.values():
            cpu = torch.tensor([run["cpu"] for run in runs], dtype=torch.float64)
            dist.all_reduce(cpu)
            for run, total in zip(runs, cpu.tolist()):
                run["cpu"] = total
    return results


def report(results: dict, overrides, threads: str, loads) -> bool:
    """Prints the table; False if the two loops' first losses differ (not the same model and batch)."""
    wall = {loop: [run["wall"] for run in runs] for loop, runs in results.items()}
    cpu = {loop: [run["cpu"] for run in runs] for loop, runs in results.items()}
    med = {k: {loop: statistics.median(v) for loop, v in d.items()} for k, d in (("wall", wall), ("cpu", cpu))}
    print(f"{'loop':<12}{'wall ms/step':>14}{'CPU ms/step':>14}   wall, all repeats (ms) | CPU, all repeats (ms)")
    for loop, label in (("trainer", "trainer"), ("hand", "hand loop")):
        print(
            f"{label:<12}{1e3 * med['wall'][loop]:>14.1f}{1e3 * med['cpu'][loop]:>14.1f}   "
            f"{', '.join(f'{1e3 * x:.1f}' for x in wall[loop])} | {', '.join(f'{1e3 * x:.1f}' for x in cpu[loop])}"
        )
    overhead = {k: 100 * (m["trainer"] / m["hand"] - 1) for k, m in med.items()}
    print(
        f"trainer overhead: {overhead['wall']:+.1f}% wall, {overhead['cpu']:+.1f}% CPU (medians; torch "
        f"{torch.__version__}, {threads}, {' '.join(overrides)})"
    )
    losses = {loop: runs[0]["loss"] for loop, runs in results.items()}
    print(f"first-step loss: trainer {losses['trainer']:.6f}, hand loop {losses['hand']:.6f}")
    print(f"load average (1 min) before/after: {loads[0]:.2f} / {loads[1]:.2f}")
    return abs(losses["trainer"] - losses["hand"]) <= 1e-4 * abs(losses["hand"])


DIFFERENT = "the two loops did not see the same model and batch: their first losses differ"


def rank_entry(rank: int, world_size: int, store_path: str, overrides, steps, repeats, root: str, threads: int):
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )  # what torchrun sets: train() joins the group made here
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        loads = [os.getloadavg()[0]]
        results = measure(overrides, steps, repeats, Path(root), rank, world_size)
        loads.append(os.getloadavg()[0])
        same = (
            [report(results, overrides, f"{world_size} ranks x {threads} thread(s) (gloo)", loads)]
            if rank == 0
            else [None]
        )
        dist.broadcast_object_list(same, src=0)  # every rank leaves together, whatever the verdict
    finally:
        dist.destroy_process_group()
    if not same[0]:
        raise SystemExit(DIFFERENT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2), help="2: FSDP over 2 gloo processes")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each process")
    parser.add_argument("--smoke", action="store_true", help="tiny model and few steps (seconds)")
    parser.add_argument("overrides", nargs="*", help="trainer overrides after --, e.g. -- --model.name=debug-gpt")
    opts = parser.parse_args()
    overrides = ["--job.device=cpu", *RUN_FLAGS, *opts.overrides]
    if opts.smoke:
        overrides += SMOKE_FLAGS
        opts.steps, opts.repeats = 4, 1
    if opts.ranks > 1:
        overrides.append(f"--parallel.dp_shard={opts.ranks}")
    with tempfile.TemporaryDirectory() as root:
        if opts.ranks == 1:
            torch.set_num_threads(opts.threads)
            loads = [os.getloadavg()[0]]
            results = measure(overrides, opts.steps, opts.repeats, Path(root), 0, 1)
            loads.append(os.getloadavg()[0])
            if not report(results, overrides, f"1 process x {opts.threads} thread(s)", loads):
                raise SystemExit(DIFFERENT)
        else:
            mp.spawn(
                rank_entry,
                args=(opts.ranks, f"{root}/store", overrides, opts.steps, opts.repeats, root, opts.threads),
                nprocs=opts.ranks,
                join=True,
            )


if __name__ == "__main__":
    sys.exit(main())
