"""What the trainer adds to a step: `trillion train`'s loop next to a minimal hand-written
PyTorch loop on the same model, batch and optimizer.

    python experiments/bench/trainer_overhead.py            # debug model, 30 steps, 3 repeats
    python experiments/bench/trainer_overhead.py --smoke    # seconds, for the test suite

The trainer's time per step is the wall clock between its first and last logged step (data
loading, LR schedule, metrics, everything the loop does), divided by the steps in between. The
hand loop repeats one preloaded batch. Repeats alternate between the two and the medians are
compared, so a machine that is busy for a while slows both alike.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trillion.models import Transformer
from trillion.trainer.assemble import build_model_args
from trillion.trainer.config.schema import load_config
from trillion.trainer.data.tokenizer import build_tokenizer
from trillion.trainer.optim import build_optimizer
from trillion.trainer.train import train


def trainer_seconds_per_step(overrides: list[str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        config = load_config(
            None,
            [
                *overrides,
                f"--training.steps={steps}",
                f"--metrics.log_freq={steps}",
                f"--job.output_dir={out}",
                "--logging.wandb=false",
                "--checkpoint.save_final=false",
                "--logging.progress_bar=lines",
                "--eval.interval=0",
            ],
        )  # the hand loop evaluates nothing
        train(config)
        first, last = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return (last["time"] - first["time"]) / (last["step"] - first["step"])


def hand_loop_seconds_per_step(overrides: list[str], steps: int) -> float:
    config = load_config(None, overrides)
    args = build_model_args(config, build_tokenizer(config.tokenizer).vocab_size)
    model = Transformer(args)
    model.init_weights(config.job.seed)
    optimizer = build_optimizer(model, config.optimizer, "cpu")
    t = config.training
    tokens = torch.randint(0, args.vocab_size, (t.global_batch_size, t.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    step().item()  # warm-up, as the trainer's first (unmeasured) step
    start = time.perf_counter()
    for _ in range(steps - 1):
        loss = step()
    loss.item()
    return (time.perf_counter() - start) / (steps - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny model and few steps (seconds)")
    parser.add_argument("overrides", nargs="*", help="trainer overrides, e.g. --model.name=debug-gpt")
    opts = parser.parse_args()
    overrides = ["--job.device=cpu", *opts.overrides]
    if opts.smoke:
        overrides += [
            "--model.n_layers=1",
            "--training.seq_len=32",
            "--training.global_batch_size=2",
            "--training.micro_batch_size=2",
        ]
        opts.steps, opts.repeats = 4, 1
    trainer_times, hand_times = [], []
    for _ in range(opts.repeats):
        trainer_times.append(trainer_seconds_per_step(overrides, opts.steps))
        hand_times.append(hand_loop_seconds_per_step(overrides, opts.steps))
    trainer_s, hand_s = statistics.median(trainer_times), statistics.median(hand_times)
    print(f"{'loop':<12}{'ms/step (median)':>18}{'all repeats (ms)':>40}")
    print(f"{'trainer':<12}{1e3 * trainer_s:>18.1f}{', '.join(f'{1e3 * x:.1f}' for x in trainer_times):>40}")
    print(f"{'hand loop':<12}{1e3 * hand_s:>18.1f}{', '.join(f'{1e3 * x:.1f}' for x in hand_times):>40}")
    print(
        f"trainer overhead: {100 * (trainer_s / hand_s - 1):+.1f}% (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {' '.join(overrides)})"
    )


if __name__ == "__main__":
    sys.exit(main())
