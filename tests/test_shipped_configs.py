"""Every shipped config passes the checks `trillion train` runs before any work, at the world
size it declares (one process when it declares none)."""

import re
from pathlib import Path

import pytest
import torch

from trillion.trainer.assemble import build_model_args, validate_training
from trillion.trainer.config.schema import load_config
from trillion.trainer.launch.env import LaunchEnv
from trillion.trainer.tools.estimate.dry_run import layout_dims

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "experiments/configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_passes_the_trainers_checks_at_its_world_size(path):
    config = load_config(str(path))
    declared = re.search(r"^# world_size = (\d+)$", path.read_text(), re.M)
    world = int(declared.group(1)) if declared else 1
    validate_training(config, LaunchEnv(rank=0, world_size=world, local_rank=0, device=torch.device("cpu")))
    # raises unless the layout fits: the degrees' product is the world size (ParallelDims refuses any
    # other, tests/layout/test_layout_errors.py), and model, batch and pipeline split accept it
    dims, _ = layout_dims(config, world)
    build_model_args(config, 257, dims.layout)  # the byte tokenizer's ids fit
