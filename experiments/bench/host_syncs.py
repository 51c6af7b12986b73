"""What the host's reads of device values cost a step: `trillion train` at metrics.log_freq 1 (the loss,
gradient norm and skipped-step flags read every step) next to larger ones (read only at logging steps),
with the reads counted per step by trillion.trainer.metrics.profiling.HostReadCounter.

    python experiments/bench/host_syncs.py                  # CPU: debug model + llama3-1b cut to 2 layers
    python experiments/bench/host_syncs.py --device cuda    # GPU (device_check.sh): debug + the whole llama3-1b
    python experiments/bench/host_syncs.py --smoke          # CPU, tiny sizes, seconds: the test of this script

For each model and log_freq, `--repeats` runs of `--steps` steps (by default each model's own, in MODELS);
the repeats alternate between the log_freqs (their order rotates each repeat) so a machine busy for a
while slows all alike. Per run:

- wall ms/step: the wall clock between the first and the last logged step (both always logged) over
  the steps between them: what the run costs, device included;
- CPU ms/step: this process's CPU time (time.process_time, all its threads) over the same steps: on
  cores other work shares, the work of the step rather than the time it waited to be scheduled;
- host ms/iteration: the median, over steps 2..N-1, of the host time of one loop iteration (a RunHooks
  iteration context around it). On a GPU an iteration that reads nothing returns once its work is
  queued: this is the step's host-dispatch time (until the queue fills); one that reads waits for the
  device. On a CPU dispatch and compute are the same thread: the two columns measure the same thing;
- reads per step: HostReadCounter's count over steps 2..N divided by N-1, and the count at an
  unlogged step (max) and at a logged step (median of steps 2..N). On a CPU it counts calls of the
  Tensor methods that read values; on a GPU (`cuda=True`) the synchronisations that
  torch.cuda.set_sync_debug_mode reports (an explicit torch.cuda.synchronize, which logged steps'
  phase timers make, is not one of them: c10's device_synchronize does not report to it).

The counter is on in every run (its own cost, measured and printed, is microseconds per iteration).
Medians over the repeats; the load average (os.getloadavg) is printed before and after. Rows go to
OUT/host_syncs-<time>.jsonl as they are measured, the table to OUT/host_syncs-<time>.md.
"""

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from trillion.trainer.config.schema import load_config
from trillion.trainer.metrics.profiling import HostReadCounter
from trillion.trainer.train import RunHooks, train

HERE = Path(__file__).resolve().parent
RUN_FLAGS = [
    "--logging.wandb=false",
    "--checkpoint.save_final=false",
    "--logging.progress_bar=lines",
    "--eval.interval=0",
]
# (name, flags, steps) per device. CPU: a Llama 3 1B block (dim 2048, 32 heads, 8 KV heads, FFN 8192) cut
# to 2 layers and a 16,384-token vocabulary (the preset's untied 128,256-token embedding and output are
# 525M parameters, 8.4 GB with gradients and AdamW state, seconds a step on a shared core), on 2 x 64 tokens.
MODELS = {
    "cpu": [
        ("debug", ["--model.name=debug"], 15),
        (
            "llama3-1b, 2 layers, vocab 16384",
            [
                "--model.name=llama3-1b",
                "--model.n_layers=2",
                "--model.vocab_size=16384",
                "--training.seq_len=64",
                "--training.global_batch_size=2",
                "--training.micro_batch_size=2",
            ],
            8,
        ),
    ],
    "cuda": [("debug", ["--model.name=debug"], 40), ("llama3-1b", ["--model.name=llama3-1b"], 30)],  # whole, bf16
    "smoke": [
        ("debug, 1 layer", ["--model.name=debug", "--model.n_layers=1"], 12),
        (
            "llama3-1b cut small",
            ["--model.name=llama3-1b", "--model.n_layers=1", "--model.dim=128", "--model.ffn_dim=256"]
            + ["--model.n_heads=4", "--model.n_kv_heads=2", "--model.vocab_size=320"],
            12,
        ),
    ],
}
SMOKE_FLAGS = ["--training.seq_len=32", "--training.global_batch_size=2", "--training.micro_batch_size=2"]


def timed_run(flags: list[str], steps: int, log_freq: int, cuda: bool, out: Path) -> dict:
    """One run: wall s/step between the first and last logged step, host s per iteration and reads, by step."""
    counter, host, cpu = HostReadCounter(cuda=cuda), {}, {}

    @contextlib.contextmanager
    def iteration(step: int):
        start = time.perf_counter()
        with counter.iteration(step):
            yield
        host[step] = time.perf_counter() - start
        cpu[step] = time.process_time()

    config = load_config(
        None,
        [*flags, f"--training.steps={steps}", f"--metrics.log_freq={log_freq}", f"--job.output_dir={out}"],
    )
    train(config, hooks=RunHooks(iteration=iteration))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    logged = {r["step"] for r in records}
    later = range(2, steps + 1)  # step 1 is the warm-up, as the wall time's window
    return {
        "wall_s": (last["time"] - first["time"]) / (last["step"] - first["step"]),
        "cpu_s": (cpu[steps] - cpu[1]) / (steps - 1),
        "host_s": statistics.median(host[s] for s in range(2, steps)),
        "reads_per_step": sum(counter.reads[s] for s in later) / len(later),
        "reads_unlogged": max((counter.reads[s] for s in later if s not in logged), default=None),
        "reads_logged": statistics.median(counter.reads[s] for s in later if s in logged),
    }


def counter_cost(cuda: bool) -> float:
    """Seconds one HostReadCounter iteration context costs with no read inside."""
    counter, calls = HostReadCounter(cuda=cuda), 200
    start = time.perf_counter()
    for step in range(calls):
        with counter.iteration(step):
            pass
    return (time.perf_counter() - start) / calls


def markdown(rows: list[dict], header: str, note: str) -> str:
    lines = [
        header,
        "",
        note,  # device_check.sh keeps what follows the header's two lines
        "",
        "| model | log_freq | steps x repeats | wall ms/step (median) | vs log_freq 1 | repeats (ms) "
        "| CPU ms/step (median) | vs log_freq 1 | host ms/iteration (median) | reads/step "
        "| reads, unlogged step | reads, logged step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} |")
            continue
        lines.append(
            f"| {r['model']} | {r['log_freq']} | {r['steps']} x {r['repeats']} | {r['wall_ms']:.1f} "
            f"| {r['vs_log_freq_1']} | {r['repeats_ms']} | {r['cpu_ms']:.1f} | {r['cpu_vs_log_freq_1']} "
            f"| {r['host_ms']:.1f} | {r['reads_per_step']:.2f} "
            f"| {'-' if r['reads_unlogged'] is None else r['reads_unlogged']} | {r['reads_logged']:g} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--log-freqs", default="", help="comma-separated (default 1,100 on a CPU, 1,10,100 on a GPU)")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default: each model's own, MODELS)")
    parser.add_argument(
        "--repeats", type=int, default=0, help="per model and log_freq (default 3 on a CPU, 2 on a GPU)"
    )
    parser.add_argument("--only", default="", help="comma-separated model indices to run (default all), e.g. 0")
    parser.add_argument(
        "--threads", type=int, default=0, help="intra-op threads (default 1 on a CPU: see trainer_overhead.py)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, 12 steps, 1 repeat (seconds)")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for the .md and .jsonl files")
    parser.add_argument("overrides", nargs="*", help="more trainer overrides for every run, after --")
    return parser


def model_rows(model: str, flags_line: str, steps: int, repeats: int, runs: dict, loads: list, cost: float) -> list:
    """One row per log_freq of a model's runs (`runs`: log_freq -> timed runs), medians over the repeats."""
    log_freqs, rows = list(runs), []
    wall_1 = statistics.median(r["wall_s"] for r in runs[log_freqs[0]])
    cpu_1 = statistics.median(r["cpu_s"] for r in runs[log_freqs[0]])
    for f in log_freqs:
        wall = statistics.median(r["wall_s"] for r in runs[f])
        cpu_s = statistics.median(r["cpu_s"] for r in runs[f])
        row = {
            "model": model,
            "flags": flags_line,
            "log_freq": f,
            "steps": steps,
            "repeats": repeats,
            "wall_ms": 1e3 * wall,
            "vs_log_freq_1": "-" if f == log_freqs[0] else f"{100 * (wall / wall_1 - 1):+.1f}%",
            "repeats_ms": ", ".join(f"{1e3 * r['wall_s']:.1f}" for r in runs[f]),
            "cpu_ms": 1e3 * cpu_s,
            "cpu_vs_log_freq_1": "-" if f == log_freqs[0] else f"{100 * (cpu_s / cpu_1 - 1):+.1f}%",
            "host_ms": 1e3 * statistics.median(r["host_s"] for r in runs[f]),
            **{k: runs[f][0][k] for k in ("reads_per_step", "reads_unlogged", "reads_logged")},
            "reads_same_in_every_repeat": len({r["reads_per_step"] for r in runs[f]}) == 1,
            "load_before_after": loads,
            "counter_cost_us": 1e6 * cost,
        }
        rows.append(row)
    return rows


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    cuda = opts.device == "cuda" and not opts.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no GPU")
    models = MODELS["smoke" if opts.smoke else opts.device]
    if opts.only:
        models = [models[int(i)] for i in opts.only.split(",")]
    log_freqs = [int(x) for x in (opts.log_freqs or ("1,10,100" if cuda or opts.smoke else "1,100")).split(",")]
    repeats = 1 if opts.smoke else opts.repeats or (2 if cuda else 3)
    base = [
        f"--job.device={'cuda' if cuda else 'cpu'}",
        *RUN_FLAGS,
        *(SMOKE_FLAGS if opts.smoke else []),
        *opts.overrides,
    ]
    if opts.threads or not cuda:
        torch.set_num_threads(opts.threads or 1)
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} thread(s)"
    stamp = datetime.datetime.now()
    header = (
        f"## {stamp:%Y-%m-%d %H:%M}, host syncs, {name}, torch {torch.__version__}{' (smoke)' if opts.smoke else ''}"
    )
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"host_syncs-{'smoke-' if opts.smoke else ''}{stamp:%Y%m%d-%H%M%S}"
    cost = counter_cost(cuda)
    note = (
        f"`experiments/bench/host_syncs.py{' --smoke' if opts.smoke else ''}`: the trainer's step at metrics.log_freq "
        f"{' / '.join(map(str, log_freqs))}, {name}, HostReadCounter({'cuda=True' if cuda else ''}) on in every run "
        f"(its own cost {1e6 * cost:.0f} us per iteration); load average {os.getloadavg()[0]:.2f} at the start."
    )
    print(f"HostReadCounter's own cost: {1e6 * cost:.1f} us per iteration; load average {os.getloadavg()[0]:.2f}")
    rows = []

    def record(row: dict) -> None:  # on disk at once: a part cut short by its time limit keeps its rows
        rows.append(row)
        with stem.with_suffix(".jsonl").open("a") as file:
            file.write(json.dumps({"device": name, "torch": torch.__version__, "smoke": opts.smoke, **row}) + "\n")
        stem.with_suffix(".md").write_text(markdown(rows, header, note))

    with tempfile.TemporaryDirectory() as root:
        for index, (model, flags, steps) in enumerate(models):
            steps = opts.steps or steps
            runs = {f: [] for f in log_freqs}
            load_before = os.getloadavg()[0]
            try:
                for repeat in range(repeats):
                    for f in log_freqs[repeat % len(log_freqs) :] + log_freqs[: repeat % len(log_freqs)]:
                        out = Path(root) / f"m{index}-f{f}-r{repeat}"
                        runs[f].append(timed_run([*base, *flags], steps, f, cuda, out))
            except Exception as error:  # the next model still runs
                traceback.print_exc()
                record(
                    {
                        "model": model,
                        "flags": " ".join([*base, *flags]),
                        "error": f"{type(error).__name__}: {error}"[:300],
                    }
                )
                continue
            load_after = os.getloadavg()[0]
            for row in model_rows(
                model, " ".join([*base, *flags]), steps, repeats, runs, [load_before, load_after], cost
            ):
                record(row)
            print(f"{model}: load average {load_before:.2f} before, {load_after:.2f} after", flush=True)
    print(markdown(rows, header, note))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
