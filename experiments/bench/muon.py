"""Muon against AdamW: the optimizer step's time, and the held-out loss curve each reaches at its best learning rate.

    python experiments/bench/muon.py step                     # debug model, 1 process: ms per optimizer step
    python experiments/bench/muon.py step --ranks 2 --layout tp   # per rank under tp 2 (or dp: dp_shard 2), gloo
    python experiments/bench/muon.py curves                   # debug and debug-moe, a small learning-rate sweep
    python experiments/bench/muon.py ... --smoke              # seconds, for the test suite

`step`: the trainer's optimizer (trainer/optim.py build_optimizer: fused AdamW; Muon with Newton-Schulz in float32,
as `newton_schulz_dtype=auto` runs on a CPU) on the model the trainer builds for the layout, every parameter given a
random gradient (what the step does does not depend on the values); `--steps` timed steps after 2 warm-up steps,
repeats alternating AdamW and Muon, medians. Under 2 ranks each rank times its own steps between barriers.

`curves`: `trillion train` in-process for each model, optimizer and learning rate of the sweep (the same seed,
data, schedule and batch), the held-out loss every `--eval-interval` steps (a run already in --out with the same
settings is read, not trained again). For each model and optimizer the best learning rate is the one with the
lowest final held-out loss (each default sweep brackets its optimizer's best at debug size). The figure is the
tokens Muon, at its best learning rate, needs to reach AdamW's best final held-out loss: Muon trained again for
shorter budgets (`--budgets`, each run with its whole schedule, as Moonlight compares), the final losses
interpolated linearly between budgets; beside it, where Muon's full run first gets below that loss (a mid-run
figure, at a higher learning rate than AdamW's final one, and as noisy as one evaluation). It writes a JSON
record and a Markdown table into --out. One intra-op thread per process (the
machine's cores are shared).
"""

import argparse
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

LRS = {"adamw": (3e-4, 1e-3, 3e-3), "muon": (3e-3, 1e-2, 3e-2)}  # each brackets its best at debug size (measured)
RUN_FLAGS = ["--logging.wandb=false", "--checkpoint.save_final=false", "--logging.progress_bar=lines"]


def optimizer_step_ms(model_name: str, layout: dict, world_size: int, steps: int, repeats: int, smoke: bool) -> dict:
    """{optimizer: median ms per step} on this rank, the model built and parallelized as the trainer does."""
    from trillion.models import PRESETS, Transformer
    from trillion.parallel.dims import ParallelDims
    from trillion.parallel.parallelize import parallelize
    from trillion.trainer.config.schema import Optimizer
    from trillion.trainer.optim import build_optimizer

    args = PRESETS[model_name]
    if smoke:
        import dataclasses

        args = dataclasses.replace(args, n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
    dims = ParallelDims.of(world_size=world_size, **layout)
    dims.build_mesh("cpu")
    times = {"adamw": [], "muon": []}
    for repeat in range(repeats):
        for name in ("adamw", "muon") if repeat % 2 == 0 else ("muon", "adamw"):
            with torch.device("meta"):
                model = Transformer(args)
            parallelize(model, dims)
            model.to_empty(device="cpu")
            model.init_weights(0)
            for param in model.parameters():
                param.grad = torch.randn_like(param) * 1e-3
            optimizer = build_optimizer(model, Optimizer(name=name), "cpu", model_args=args, dims=dims)
            for _ in range(2):
                optimizer.step()
            if world_size > 1:
                dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            if world_size > 1:
                dist.barrier()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def _rank(rank: int, world_size: int, store: str, layout: dict, ns: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(ns.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        result = optimizer_step_ms(ns.model, layout, world_size, ns.steps, ns.repeats, ns.smoke)
        Path(f"{out}.{rank}").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def step(ns: argparse.Namespace) -> None:
    layout = {"dp": {"dp_shard": 2}, "tp": {"tp": 2}}.get(ns.layout, {}) if ns.ranks > 1 else {}
    print(f"# load average before: {os.getloadavg()[0]:.2f}")
    torch.set_num_threads(ns.threads)
    if ns.ranks == 1:
        results = [optimizer_step_ms(ns.model, {}, 1, ns.steps, ns.repeats, ns.smoke)]
    else:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "result")
            mp.spawn(_rank, args=(ns.ranks, os.path.join(folder, "store"), layout, ns, out), nprocs=ns.ranks)
            results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(ns.ranks)]
    where = f"{ns.ranks} ranks, {', '.join(f'{k}={v}' for k, v in layout.items())}" if ns.ranks > 1 else "1 process"
    print(f"optimizer step, {ns.model}, {where}: ms per step (median of {ns.repeats} repeats of {ns.steps} steps)")
    for rank, result in enumerate(results):
        ratio = result["muon"] / result["adamw"]
        print(f"rank {rank}: adamw {result['adamw']:.2f}  muon {result['muon']:.2f}  ratio {ratio:.2f}")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")


def train_curve(
    model: str, optimizer: str, lr: float, ns: argparse.Namespace, out: Path, steps: int = 0
) -> list[tuple[int, float]]:
    """(tokens, held-out loss) of one run of `trillion train` (`steps`: a shorter run with its own whole schedule)."""
    from trillion.trainer.config.schema import load_config
    from trillion.trainer.train import train

    steps = steps or ns.train_steps
    folder = out / (f"{model}-{optimizer}-{lr:g}" + (f"-{steps}steps" if steps != ns.train_steps else ""))
    tokens = ns.batch * ns.seq_len
    if (folder / "metrics.jsonl").is_file():  # a finished run of the same settings (the runs are deterministic)
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        curve = [(r["step"] * tokens, r["eval_loss"]) for r in records if "eval_loss" in r]
        if curve and curve[-1][0] == steps * tokens:
            return curve
    flags = [
        f"--model.name={model}",
        f"--optimizer.name={optimizer}",
        f"--optimizer.lr={lr}",
        f"--training.steps={steps}",
        f"--training.seq_len={ns.seq_len}",
        f"--training.global_batch_size={ns.batch}",
        f"--training.micro_batch_size={ns.batch}",
        f"--lr_schedule.warmup_steps={max(1, steps // 10)}",
        f"--eval.interval={ns.eval_interval}",
        f"--eval.steps={ns.eval_steps}",
        f"--metrics.log_freq={ns.eval_interval}",
        f"--job.output_dir={folder}",
        "--job.overwrite=true",
        *RUN_FLAGS,
        *(["--model.n_layers=1", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2"] if ns.smoke else []),
    ]
    train(load_config(None, flags))
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"] * tokens, r["eval_loss"]) for r in records if "eval_loss" in r]


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The tokens at which a held-out curve first reaches `target`, linear between evaluations; None if never."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1) if l0 > target else t0
    return None


def curves(ns: argparse.Namespace) -> None:
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(ns.threads)
    lrs = {"adamw": ns.adamw_lrs, "muon": ns.muon_lrs}
    started, record = time.time(), {"lrs": lrs, "steps": ns.train_steps, "models": {}}
    for model in ns.models:
        runs = {(opt, lr): train_curve(model, opt, lr, ns, out) for opt in lrs for lr in lrs[opt]}
        best = {opt: min(lrs[opt], key=lambda lr, opt=opt: runs[(opt, lr)][-1][1]) for opt in lrs}
        target, adamw_tokens = runs[("adamw", best["adamw"])][-1][1], runs[("adamw", best["adamw"])][-1][0]
        budgets = [train_curve(model, "muon", best["muon"], ns, out, round(f * ns.train_steps))[-1] for f in ns.budgets]
        record["models"][model] = {
            "final": {f"{o}@{lr:g}": runs[(o, lr)][-1][1] for o, lr in runs},
            "best_lr": best,
            "curves": {o: runs[(o, best[o])] for o in best},
            "adamw_final": target,
            "adamw_tokens": adamw_tokens,
            "muon_budgets": [*budgets, runs[("muon", best["muon"])][-1]],  # (tokens, final held-out loss)
            "muon_budget_to_adamw_final": tokens_to_reach([*budgets, runs[("muon", best["muon"])][-1]], target),
            "muon_run_crosses_adamw_final": tokens_to_reach(runs[("muon", best["muon"])], target),
        }
    record["minutes"] = (time.time() - started) / 60
    (out / "muon_curves.json").write_text(json.dumps(record, indent=1))
    (out / "muon_curves.md").write_text(markdown(record))
    print(markdown(record))


def markdown(record: dict) -> str:
    lines = [
        "| model | AdamW best lr | its final held-out loss | Muon best lr | its final | Muon's budget reaching AdamW's "
        "final | its run first below it |",
        "|---|---|---|---|---|---|---|",
    ]

    def share(tokens, r) -> str:
        return "not reached" if tokens is None else f"{tokens:,.0f} tokens ({tokens / r['adamw_tokens']:.0%})"

    for model, r in record["models"].items():
        lines.append(
            f"| {model} | {r['best_lr']['adamw']:g} | {r['adamw_final']:.4f} | {r['best_lr']['muon']:g} | "
            f"{r['curves']['muon'][-1][1]:.4f} | {share(r['muon_budget_to_adamw_final'], r)} | "
            f"{share(r['muon_run_crosses_adamw_final'], r)} |"
        )
    finals = "; ".join(
        f"{m}: " + ", ".join(f"{k} {v:.4f}" for k, v in r["final"].items()) for m, r in record["models"].items()
    )
    budgets = "; ".join(
        f"{m}: " + ", ".join(f"{t:,} tokens {loss:.4f}" for t, loss in r["muon_budgets"])
        for m, r in record["models"].items()
    )
    return "\n".join(lines + ["", f"Final held-out loss of every run: {finals}.", "", f"Muon's budgets: {budgets}."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("step", "curves"))
    parser.add_argument("--model", default="debug", help="step: the preset")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--layout", choices=("dp", "tp"), default="dp")
    parser.add_argument("--steps", type=int, default=10, help="step: timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=["debug", "debug-moe"], help="curves: the presets")
    parser.add_argument("--adamw-lrs", nargs="+", type=float, default=list(LRS["adamw"]))
    parser.add_argument("--muon-lrs", nargs="+", type=float, default=list(LRS["muon"]))
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument(
        "--budgets", nargs="+", type=float, default=[0.5, 0.7, 0.85], help="curves: Muon's shorter runs, x train-steps"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--eval-steps", type=int, default=4)
    parser.add_argument("--out", default="outputs/bench/muon")
    parser.add_argument("--smoke", action="store_true", help="a one-layer model, a few steps: seconds")
    ns = parser.parse_args()
    if ns.smoke:
        ns.steps, ns.repeats, ns.train_steps, ns.eval_interval, ns.eval_steps = 2, 2, 4, 2, 1
        ns.adamw_lrs, ns.muon_lrs, ns.budgets = [1e-3], [1e-3, 1e-2], [0.5]
        ns.seq_len, ns.models = 32, ns.models[:1] if ns.what == "curves" else ns.models
    step(ns) if ns.what == "step" else curves(ns)


if __name__ == "__main__":
    sys.exit(main())
