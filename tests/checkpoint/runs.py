"""Tiny in-process training runs for the checkpoint tests: one layer, 64 wide, 32-token windows."""

import json
from pathlib import Path

from trillion.trainer.config.schema import load_config
from trillion.trainer.train import train

TINY = [
    "--model.n_layers=1",
    "--model.dim=64",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn_dim=128",
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.micro_batch_size=2",
    "--lr_schedule.warmup_steps=2",
    "--metrics.log_freq=1",
    "--logging.wandb=false",
    "--logging.progress_bar=lines",
]


def config(out: Path, *extra: str, steps: int = 6):
    return load_config(None, [*TINY, f"--training.steps={steps}", f"--job.output_dir={out}", *extra])


def run(out: Path, *extra: str, steps: int = 6) -> dict:
    return train(config(out, *extra, steps=steps))


FAMILIES = {  # extra flags on top of TINY for each model family Hugging Face export supports
    "llama": [],
    "gpt": ["--model.name=debug-gpt", "--model.n_kv_heads=0", "--model.ffn_dim=0"],
}


def trained_and_exported(root: Path, family: str) -> tuple[Path, Path]:
    """A 2-step run of `family` under root/source and its `trillion export --format hf` under root/hf."""
    from trillion.trainer.cli.main import main

    source, out = root / "source", root / "hf"
    run(source, *FAMILIES[family], steps=2)
    assert main(["export", "--checkpoint", str(source), "--format", "hf", str(out)]) == 0
    return source, out


def losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training record in metrics.jsonl, in file order."""
    return [
        (r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())
