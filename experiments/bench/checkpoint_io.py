"""What checkpoints cost: save and load time of a model, and what a save costs the training steps,
synchronous against `--checkpoint.async_mode=async`.

    python experiments/bench/checkpoint_io.py            # the debug model, 40 steps, a save every 10
    python experiments/bench/checkpoint_io.py --smoke    # seconds, for the test suite

Three runs of the same steps from the same seed: without checkpoints, with synchronous saves and
with async saves. For each: the wall time per step over the whole run (saves included), the
median step time (the trainer's `step_time_s`) of the steps just after a save, when an async write
is still going on, against the other steps, and per save the seconds training was blocked and the
seconds until the checkpoint was published, from the trainer's own log. A resume of the last run
gives the load time.
"""

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

from trillion.trainer.config.schema import load_config
from trillion.trainer.train import train

DEBUG_CONFIG = str(Path(__file__).parents[1] / "configs" / "debug.toml")
SMOKE = [
    "--model.n_layers=1",
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=128",
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=2",
]


class TrainerLog(logging.Handler):
    """The figures the checkpoint manager logs, taken from the log records' arguments."""

    def __init__(self):
        super().__init__()
        self.saves, self.loads = [], []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("saved checkpoint"):
            self.saves.append({"blocked_s": record.args[1], "published_s": record.args[2]})
        elif record.msg.startswith("resumed from"):
            self.loads.append(record.args[3])


def measure(
    mode: str, config: str | None, overrides: list[str], steps: int, interval: int, root: Path, log: TrainerLog
) -> dict:
    out = root / mode
    checkpointing = {
        "none": ["--checkpoint.interval=0", "--checkpoint.save_final=false"],
        "sync": [f"--checkpoint.interval={interval}", "--checkpoint.save_final=false"],
        "async": [
            f"--checkpoint.interval={interval}",
            "--checkpoint.save_final=false",
            "--checkpoint.async_mode=async",
        ],
    }[mode]
    log.saves.clear()
    train(
        load_config(
            config,
            [
                *overrides,
                *checkpointing,
                f"--training.steps={steps}",
                f"--job.output_dir={out}",
                "--metrics.log_freq=1",
                "--logging.wandb=false",
                "--logging.progress_bar=lines",
            ],
        )
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    just_after = {r["step"] for r in records if r["step"] > interval and (r["step"] - 1) % interval < 2}
    after_save = [r["step_time_s"] for r in records if r["step"] in just_after]
    others = [r["step_time_s"] for r in records[1:] if r["step"] not in just_after]  # step 1 warms up
    return {
        "mode": mode,
        "wall_s_per_step": (records[-1]["time"] - records[0]["time"]) / (steps - 1),
        "step_s_after_save": statistics.median(after_save),
        "step_s_other": statistics.median(others),
        "save_blocked_s": statistics.median(s["blocked_s"] for s in log.saves) if log.saves else None,
        "save_published_s": statistics.median(s["published_s"] for s in log.saves) if log.saves else None,
        "saves": len(log.saves),
        "out": out,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few steps, for the tests")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=10)
    args = parser.parse_args(argv)
    config, overrides = (None, SMOKE) if args.smoke else (DEBUG_CONFIG, [])
    steps, interval = (6, 2) if args.smoke else (args.steps, args.interval)
    log = TrainerLog()
    logging.getLogger("trillion").addHandler(log)
    logging.getLogger("trillion").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as folder:
        rows = [
            measure(mode, config, overrides, steps, interval, Path(folder), log) for mode in ("none", "sync", "async")
        ]
        train(
            load_config(
                config,
                [
                    *overrides,
                    f"--training.steps={steps + 1}",
                    f"--job.output_dir={rows[-1]['out']}",
                    "--checkpoint.interval=0",
                    "--checkpoint.save_final=false",
                    "--logging.wandb=false",
                    "--logging.progress_bar=lines",
                    "--checkpoint.async_mode=async",
                ],
            )
        )
    size = "smoke model" if args.smoke else "debug model"
    print(f"\n{size}, {steps} steps, a save every {interval}; load (resume) {log.loads[-1]:.3f}s\n")
    print("| saves | wall s/step | step s just after a save | other steps s | save blocks s | save published s |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(
            f"| {row['mode']} | {fmt(row['wall_s_per_step'])} | {fmt(row['step_s_after_save'])} | "
            f"{fmt(row['step_s_other'])} | {fmt(row['save_blocked_s'])} | {fmt(row['save_published_s'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
