"""Tiny in-process training runs (flags.TINY: one layer, 64 wide, 32-token windows) and what they leave:
logged losses, checkpoints, a Hugging Face export."""

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers.flags import TINY
from trillion.trainer.config.schema import load_config
from trillion.trainer.train import RunHooks, train


def config(out: Path, *extra: str, steps: int = 6):
    return load_config(None, [*TINY, f"--training.steps={steps}", f"--job.output_dir={out}", *extra])


def run(out: Path, *extra: str, steps: int = 6, hooks: RunHooks | None = None) -> dict:
    return train(config(out, *extra, steps=steps), hooks=hooks)


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


def read_checkpoint(run_dir, step: int = 6) -> dict:
    """Everything a checkpoint holds, flat: tensors full, other values (counters, schedule, data position) as saved."""
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None for k, m in metadata.items()
    }
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state
