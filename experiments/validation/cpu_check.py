"""Calibrate this CPU, predict the debug model's step time for three layouts, measure the same runs,
and record both in cpu_results.toml (then VALIDATION.md).

  nice -n 10 python experiments/validation/cpu_check.py [--repeats 3] [--steps 8]

Layouts: one process; dp_shard 2 (FSDP, gloo); tp 2 (gloo). Every rank runs one thread
(OMP_NUM_THREADS=1), and so does the calibration, so a rank of the plan is one core; the one-process
layout is planned on a profile calibrated with one process busy, the others on one calibrated with
two (two niced processes on a loaded machine share what one would get). What a core delivers
drifts with its neighbours' load: each repeat calibrates afresh and predicts from that, then
measures the three layouts right after; each run's
step time is the median of its steps after the first few; the table gives the medians over the
repeats, the spread of the runs and the load average seen.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trillion.models.presets import get_preset
from trillion.parallel.layout import Layout
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.search import Request, evaluate

HERE = Path(__file__).parent
CONFIG = HERE.parents[0] / "configs" / "debug.toml"
MODEL, GLOBAL_BATCH, SEQ_LEN = "debug", 8, 256
LAYOUTS = {  # name: (processes, trainer overrides, planner layout)
    "1 process": (
        1,
        [],
        Layout(micro_batch_size=8),
    ),
    "dp_shard 2 (FSDP, gloo)": (
        2,
        ["--parallel.dp_shard=2"],
        Layout(dp_shard=2, micro_batch_size=4),
    ),
    "tp 2 (gloo)": (
        2,
        ["--parallel.tp=2"],
        Layout(tp=2, micro_batch_size=8),
    ),
}
SKIP_STEPS = 3  # the first steps allocate and warm caches


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def calibrate(out: Path, processes: int) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trillion",
            "plan",
            "--calibrate",
            "--model",
            MODEL,
            "--seq-len",
            str(SEQ_LEN),
            "--micro-batch-size",
            str(GLOBAL_BATCH),
            "--calibrate-processes",
            str(processes),
            "--calibrate-out",
            str(out),
        ],
        check=True,
        env=_env(),
    )


def measure(processes: int, overrides: list[str], micro_batch: int, steps: int, run_dir: Path) -> float:
    """Median step time of one training run, over its steps after the first SKIP_STEPS."""
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m"]
        if processes > 1
        else [sys.executable, "-m"]
    )
    result = subprocess.run(
        [
            *launcher,
            "trillion",
            "train",
            "--config",
            str(CONFIG),
            *overrides,
            f"--training.steps={steps}",
            f"--training.global_batch_size={GLOBAL_BATCH}",
            f"--training.micro_batch_size={micro_batch}",
            f"--training.seq_len={SEQ_LEN}",
            "--metrics.log_freq=1",
            f"--job.output_dir={run_dir}",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            "--logging.wandb=false",
            "--logging.progress_bar=lines",
            "--eval.interval=0",
        ],
        env=_env(),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:  # say why, not only that it failed
        raise SystemExit(f"training run {run_dir} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records if r.get("step", 0) > SKIP_STEPS and "step_time_s" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    ns = parser.parse_args()
    loads = [os.getloadavg()[0]]
    predicted, measured = {name: [] for name in LAYOUTS}, {name: [] for name in LAYOUTS}
    summaries = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(ns.repeats):
            profiles = {}
            for processes in (1, 2):  # a node of one busy process, and of two
                calibrate(Path(tmp) / f"cpu{repeat}-{processes}.toml", processes)
                profiles[processes] = profile = load_profile(str(Path(tmp) / f"cpu{repeat}-{processes}.toml"))
                tp = "".join(
                    f", TP {kind.replace('_', '-')} {bandwidth:.2f} GB/s + {latency:.0f} us"
                    for kind, bandwidth, latency in profile.intra_node[0].kinds
                )
                host = (
                    f", DTensor host work per block {profile.tp_layer_host_s[0] * 1e3:.1f} ms forward + "
                    f"{profile.tp_layer_host_s[1] * 1e3:.1f} ms backward"
                    if processes > 1
                    else ""
                )
                summaries.append(
                    f"{processes} process(es): peak {profile.device.peak_tflops_bf16 * 1e3:.1f} GFLOP/s, copy "
                    f"{profile.device.memory_bandwidth_gbs:.2f} GB/s, gloo all-reduce "
                    f"{profile.intra_node[0].bandwidth_gbs:.3f} GB/s, latency {profile.link_latency_us:.0f} us"
                    f"{tp}{host}"
                )
            for index, (name, (processes, overrides, layout)) in enumerate(LAYOUTS.items()):
                request = Request(MODEL, get_preset(MODEL), profiles[processes], processes, GLOBAL_BATCH, SEQ_LEN)
                predicted[name].append(evaluate(request, layout).step.total)
                measured[name].append(
                    measure(processes, overrides, layout.micro_batch_size, ns.steps, Path(tmp) / f"run{repeat}-{index}")
                )
                loads.append(os.getloadavg()[0])
                print(
                    f"repeat {repeat} {name}: "
                    f"predicted {predicted[name][-1]:.3f} s, measured {measured[name][-1]:.3f} s",
                    flush=True,
                )
    summary = "; ".join(f"repeat {i // 2}, {s}" for i, s in enumerate(summaries))
    rows = [
        f'[[row]]\nlayout = "{name}"\nprocesses = {LAYOUTS[name][0]}\n'
        f"predicted_s = {statistics.median(predicted[name]):.4f}\n"
        f"measured_s = {statistics.median(times):.4f}\n"
        f"measured_min_s = {min(times):.4f}\nmeasured_max_s = {max(times):.4f}\n"
        f"predicted_by_repeat = {[round(p, 4) for p in predicted[name]]}\n"
        f"measured_by_repeat = {[round(t, 4) for t in times]}\n"
        for name, times in measured.items()
    ]
    text = (
        f'command = "nice -n 10 python experiments/validation/cpu_check.py --repeats {ns.repeats} --steps {ns.steps}"\n'
        f'machine = "{socket.gethostname()}, {os.cpu_count()} cores"\n'
        f'date = "{time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}"\n'
        f"repeats = {ns.repeats}\n"
        f'load = "Load average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores '
        '(a machine shared with other work; each rank and the calibration run one thread)."\n'
        f'profile_summary = "{summary}"\n'
        f'note = "Debug model ({MODEL}), global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, no checkpointing, eager, '
        "fp32. Measured: the trainer's step_time_s, "
        f'median of steps {SKIP_STEPS + 1}-{ns.steps} of each run, then the median of the runs."\n\n' + "\n".join(rows)
    )
    (HERE / "cpu_results.toml").write_text(text)
    sys.path.insert(0, str(HERE))
    from validate import evaluate_all, render

    (HERE / "VALIDATION.md").write_text(render(evaluate_all()))
    print(text)


if __name__ == "__main__":
    main()
