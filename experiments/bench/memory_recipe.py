"""Loss drift of DeepSeek-V3's lossy memory savings over 200 steps of debug-deepseek, each against the run it changes
(same seed, same data, same everything else), on the CPU:

- AdamW's moments in bfloat16 (`optimizer.state_dtype=bfloat16`, parallel/adamw_states.py) against float32 moments;
- the routed experts' activations kept for backward in float8 (`float8.cache_activations`, models/moe.py) against
  the same float8 experts keeping them in high precision (both emulated: the float8 quantisation with fp32 matmuls);
  under DeepSeek's recompute too (`parallel.activation_checkpoint=deepseek`, itself exact), where w2's weight gradient
  reads its input rebuilt from the float8 gate and up (kernels/swiglu.py); and the float8 experts against the plain
  run, for scale.

Each run trains in fp32 on the CPU (sequences of 64 tokens, 4 a step; the held-out loss at steps 0 and 200), one
thread in a process of its own (the runs go side by side, --jobs), and logs every step. The drift of a run against
its reference: the largest and the mean absolute difference of their training losses over the steps, the difference
of their last 20 steps' mean loss, and of their final held-out loss.

    python experiments/bench/memory_recipe.py            # 5 runs x 200 steps; rewrites its section of RESULTS.md
    python experiments/bench/memory_recipe.py --smoke    # 3 steps, a small model, seconds (tested); no RESULTS.md
"""

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
from experiments.bench.results_file import RESULTS, replace_section  # noqa: E402

HEADING = "## CPU: `python experiments/bench/memory_recipe.py`"

FLOAT8_EXPERTS = ("--float8.enabled=true", "--float8.emulate=true", "--float8.linears=false")
RUNS = {  # name: (flags, the run it is compared with)
    "fp32 moments, no float8": ((), None),
    "bf16 moments": (("--optimizer.state_dtype=bfloat16",), "fp32 moments, no float8"),
    "float8 experts": (FLOAT8_EXPERTS, "fp32 moments, no float8"),
    "float8 experts + float8 cache": ((*FLOAT8_EXPERTS, "--float8.cache_activations=true"), "float8 experts"),
    "float8 cache + deepseek recompute": (
        (*FLOAT8_EXPERTS, "--float8.cache_activations=true", "--parallel.activation_checkpoint=deepseek"),
        "float8 experts",
    ),
}


def train(name: str, flags: tuple, out: Path, steps: int, smoke: bool) -> dict:
    """One run's training losses (by step) and final held-out loss, from its metrics.jsonl; one thread (the runs go
    side by side, each in its own process)."""
    import torch

    from trillion.trainer.config.schema import load_config
    from trillion.trainer.train import train as run_training

    torch.set_num_threads(1)

    small = ["--model.n_layers=2", "--model.dim=64"] if smoke else []
    folder = out / name.replace(" ", "_").replace(",", "").replace("+", "and")
    settings = [
        "--model.name=debug-deepseek",
        *small,
        f"--training.steps={steps}",
        "--training.seq_len=64",
        "--training.global_batch_size=4",
        "--training.micro_batch_size=4",
        f"--eval.interval={steps}",
        "--eval.steps=8",
        "--metrics.log_freq=1",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        "--logging.wandb=false",
        "--logging.progress_bar=lines",
        "--job.overwrite=true",
        f"--job.output_dir={folder}",
        *flags,
    ]
    start = time.perf_counter()
    run_training(load_config(None, settings))
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    held_out = [r["eval_loss"] for r in records if "eval_loss" in r]
    return {"name": name, "losses": losses, "eval_loss": held_out[-1], "seconds": time.perf_counter() - start}


def drift(run: dict, reference: dict) -> dict:
    steps = sorted(reference["losses"])
    gaps = [abs(run["losses"][s] - reference["losses"][s]) for s in steps]
    tail = steps[-20:]
    mean_tail = [sum(r["losses"][s] for s in tail) / len(tail) for r in (run, reference)]
    return {
        "max_abs": max(gaps),
        "mean_abs": sum(gaps) / len(gaps),
        "tail_gap": mean_tail[0] - mean_tail[1],
        "tail_relative": (mean_tail[0] - mean_tail[1]) / mean_tail[1],
        "eval_gap": run["eval_loss"] - reference["eval_loss"],
    }


def table(results: dict) -> str:
    lines = [
        "| run | against | last 20 steps' mean loss | held-out loss | largest gap | mean gap | last 20 steps' gap "
        "| held-out gap | s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (_, against) in RUNS.items():
        run = results[name]
        tail = sorted(run["losses"])[-20:]
        mean = sum(run["losses"][s] for s in tail) / len(tail)
        if against is None:
            cells = ["-"] * 4
        else:
            d = drift(run, results[against])
            cells = [
                f"{d['max_abs']:.4f}",
                f"{d['mean_abs']:.4f}",
                f"{d['tail_gap']:+.4f} ({100 * d['tail_relative']:+.2f}%)",
                f"{d['eval_gap']:+.4f}",
            ]
        row = [name, against or "-", f"{mean:.4f}", f"{run['eval_loss']:.4f}", *cells, f"{run['seconds']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_section(results: dict, steps: int, path: Path = RESULTS) -> None:
    """This benchmark's section of RESULTS.md, replaced (or appended) with the table just measured."""
    import torch

    section = (
        f"{HEADING} (loss drift of bf16 AdamW moments and the float8 activation cache, {steps} steps of "
        "debug-deepseek)\n\n"
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, `python experiments/bench/memory_recipe.py`, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, fp32, one process, the same seed and data in "
        "every run; float8 experts emulated (blockwise: the quantisation with fp32 matmuls), the linears in fp32. "
        "The module docstring says what is measured; each run is compared with the run it changes one setting "
        "of (`against`). Gaps are losses in nats: largest and mean absolute difference over the steps' training "
        "losses, the difference of the last 20 steps' mean, and of the final held-out loss.\n\n" + table(results) + "\n"
    )
    replace_section(HEADING, section, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default="experiments/bench/results/memory_recipe")
    p.add_argument("--jobs", type=int, default=len(RUNS), help="runs side by side (processes of one thread)")
    p.add_argument("--smoke", action="store_true")
    ns = p.parse_args(argv)
    steps = 3 if ns.smoke else ns.steps
    out = Path(ns.out)
    jobs = [(name, flags, out, steps, ns.smoke) for name, (flags, _) in RUNS.items()]
    with multiprocessing.get_context("spawn").Pool(min(ns.jobs, len(jobs))) as pool:
        results = {result["name"]: result for result in pool.starmap(train, jobs)}
    print(table(results))
    (out / "memory_recipe.json").write_text(json.dumps(results, indent=1))
    if not ns.smoke:
        write_section(results, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
