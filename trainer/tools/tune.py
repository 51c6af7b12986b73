"""`trillion tune`: the planner's best layouts, measured by short real training runs and narrowed
by successive halving (the Frontier authors searched with about a thousand DeepHyper trials; the
planner's ranking lets a handful do).

  trillion tune --config my_run.toml --nproc 8 --hardware dgx-h100 [--candidates 8] [--steps 5] [--eta 2]

Round r runs every surviving layout for steps * eta^r optimizer steps under torchrun on this
node and keeps the fastest 1/eta by measured tokens/s, until a round leaves one. Each trial is
logged to metrics.jsonl (and W&B when enabled) in the tune directory; the winner is written as a
`trillion train` config.
"""

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

from trillion.errors import ConfigError
from trillion.parallel.dims import check_layout
from trillion.parallel.layout import Layout
from trillion.parallel.planner.hardware import load_profile, profile_names
from trillion.parallel.planner.search import Request, search
from trillion.trainer.assemble import build_model_args
from trillion.trainer.cli.args import CommandParser
from trillion.trainer.config.schema import load_config, to_toml
from trillion.trainer.data.tokenizer import build_tokenizer
from trillion.trainer.metrics.meters import MetricsSink


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser("tune", description=__doc__)
    p.add_argument("--config", required=True, help="the run to tune (a `trillion train` config)")
    p.add_argument("--nproc", type=int, required=True, help="processes (GPUs) on this node to run each trial on")
    p.add_argument(
        "--hardware",
        required=True,
        help=f"planner profile ranking the candidates: {', '.join(profile_names())}, "
        "or a file from `trillion plan --calibrate`",
    )
    p.add_argument("--candidates", type=int, default=8, help="planner candidates measured in the first round")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps of a first-round trial (the first is warm-up)")
    p.add_argument("--eta", type=int, default=2, help="keep the fastest 1/eta each round, run them eta times longer")
    p.add_argument("--out", default="outputs/tune", help="trial run directories, trials.jsonl and best.toml")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a trial counts as failed")
    p.add_argument("overrides", nargs="*", help="config overrides applied to every trial, e.g. --training.seq_len=2048")
    return p


def runnable_candidates(request: Request, config, count: int) -> list[Layout]:
    """The planner's fastest layouts that this trainer accepts (its own layout checks decide, on the model as the
    trainer would build it for each: the norm kernels and the per-rank capacity follow the layout)."""
    chosen, seen = [], set()
    vocab = build_tokenizer(config.tokenizer).vocab_size
    for candidate in search(request).ranked:
        layout = candidate.layout
        try:
            check_layout(layout, build_model_args(config, vocab, layout), request.seq_len, gpus_per_node=request.gpus)
        except ConfigError:
            continue
        trainer_view = tuple(o for o in layout_overrides(layout) if layout.pp > 1 or "pp_schedule" not in o)
        if trainer_view not in seen:  # without a pipeline, schedules and virtual stages change nothing
            seen.add(trainer_view)
            chosen.append(layout)
        if len(chosen) == count:
            break
    if not chosen:
        raise ConfigError(
            f"None of the planner's layouts for {request.gpus} processes can run in this trainer; "
            "check the config's model and batch against `trillion plan`."
        )
    return chosen


def layout_overrides(layout: Layout) -> list[str]:
    return [
        f"--parallel.tp={layout.tp}",
        f"--parallel.pp={layout.pp}",
        f"--parallel.dp_replicate={layout.dp_replicate}",
        f"--parallel.dp_shard={layout.dp_shard}",
        f"--parallel.dp_shard_mode={layout.dp_shard_mode}",
        *([f"--parallel.pp_schedule={layout.pp_schedule}"] if layout.pp > 1 else []),  # refused at pp 1: idle
        f"--parallel.activation_checkpoint={layout.activation_checkpoint}",
        f"--training.micro_batch_size={layout.micro_batch_size}",
        *([f"--parallel.cp={layout.cp}"] if layout.cp > 1 else []),
        *([f"--parallel.ep={layout.ep}"] if layout.ep > 1 else []),  # dense layouts keep their overrides
    ]


def run_trial(config_path: Path, layout: Layout, steps: int, nproc: int, run_dir: Path, timeout: float) -> dict:
    """Train `steps` steps in a fresh run directory; tokens/s over all steps but the first."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trillion",
        "train",
        "--config",
        str(config_path),
        *layout_overrides(layout),
        f"--training.steps={steps}",
        f"--metrics.log_freq={steps}",
        f"--job.output_dir={run_dir}",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        "--logging.wandb=false",
        "--logging.progress_bar=lines",
        "--eval.interval=0",
    ]  # timed steps only: no evaluation
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if result.returncode != 0:
        last = [line for line in result.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        return {"error": f"exit {result.returncode}: {last[0][:300]}"}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    return {"seconds_per_step": (last["time"] - first["time"]) / (last["step"] - first["step"]), "loss": last["loss"]}


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.steps < 2 or ns.eta < 2 or ns.candidates < 1 or ns.nproc < 1:
        raise ConfigError(
            "trillion tune needs --steps >= 2 (the first step is warm-up), --eta >= 2, --candidates >= 1 "
            "and --nproc >= 1."
        )
    config = load_config(ns.config, ns.overrides)
    t = config.training
    # the model's shape for the planner's ranking (one process's kernels: each candidate's are its own, above)
    args = build_model_args(config, build_tokenizer(config.tokenizer).vocab_size, Layout())
    request = Request(config.model.name, args, load_profile(ns.hardware), ns.nproc, t.global_batch_size, t.seq_len)
    survivors = runnable_candidates(request, config, ns.candidates)

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    base_config = out / "base.toml"
    base_config.write_text(to_toml(config))
    sink = MetricsSink(
        out,
        dataclasses.replace(config.logging, wandb_run_name=config.logging.wandb_run_name or "tune"),
        {"config": dataclasses.asdict(config), "tune": vars(ns)},
    )
    trials, steps, round_index = [], ns.steps, 0
    try:
        while True:
            measured = []
            for index, layout in enumerate(survivors):
                run_dir = out / f"round{round_index}-trial{index}"
                print(
                    f"round {round_index}, trial {index + 1}/{len(survivors)}: {steps} steps of "
                    f"{' '.join(layout_overrides(layout))}",
                    file=sys.stderr,
                    flush=True,
                )
                result = run_trial(base_config, layout, steps, ns.nproc, run_dir, ns.timeout)
                tokens = t.global_batch_size * t.seq_len
                row = {
                    "step": len(trials) + 1,
                    "round": round_index,
                    "steps": steps,
                    **layout.as_dict(),
                    **result,
                    "tokens_per_s": tokens / result["seconds_per_step"] if "seconds_per_step" in result else None,
                }
                trials.append(row)
                sink.write(row)
                if row["tokens_per_s"] is not None:
                    measured.append((row["tokens_per_s"], layout))
            if not measured:
                raise ConfigError(
                    f"Every trial of round {round_index} failed (see {out}/metrics.jsonl), "
                    f"e.g.: {trials[-1].get('error')}"
                )
            measured.sort(key=lambda pair: -pair[0])
            keep = math.ceil(len(measured) / ns.eta)
            if keep == 1:  # the winner is decided: a longer run of it alone would measure nothing new
                break
            survivors = [layout for _, layout in measured[:keep]]
            steps, round_index = steps * ns.eta, round_index + 1
    finally:
        sink.close()

    best = measured[0][1]
    best_config = load_config(str(base_config), layout_overrides(best))
    (out / "best.toml").write_text(
        f"# trillion tune: fastest measured layout, {measured[0][0]:,.0f} tokens/s on "
        f"{ns.nproc} processes\n" + to_toml(best_config)
    )
    print(format_trials(trials))
    print(f"best: {' '.join(layout_overrides(best))} ({measured[0][0]:,.0f} tokens/s); wrote {out / 'best.toml'}")
    return 0


def format_trials(trials: list[dict]) -> str:
    lines = [
        f"{'round':>5} {'steps':>5} {'tp':>3} {'pp':>3} {'dp':>7} {'mode':>6} {'mb':>3} "
        f"{'ckpt':>10} {'tokens/s':>12}  error"
    ]
    for r in trials:
        speed = f"{r['tokens_per_s']:>12,.0f}" if r["tokens_per_s"] is not None else f"{'-':>12}"
        lines.append(
            f"{r['round']:>5} {r['steps']:>5} {r['tp']:>3} {r['pp']:>3} {r['dp_replicate']:>3}x{r['dp_shard']:<3} "
            f"{r['dp_shard_mode']:>6} {r['micro_batch_size']:>3} {r['activation_checkpoint']:>10} {speed}  "
            f"{r.get('error', '')}"
        )
    return "\n".join(lines)
