"""Every shipped config parses, and its layout is consistent with the world size it declares."""
import re
from pathlib import Path

import pytest

from parallel.dims import ParallelDims
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.train import build_model_args

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "experiments/configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_layout_fits_its_world_size(path):
    config = load_config(str(path))
    declared = re.search(r"^# world_size = (\d+)$", path.read_text(), re.M)
    world = int(declared.group(1)) if declared else 1
    p = config.parallel
    dims = ParallelDims(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, world_size=world)
    t = config.training
    assert t.global_batch_size % (t.micro_batch_size * dims.dp_size) == 0, "micro-batches per step must be whole"
    args = build_model_args(config, tokenizer_vocab=257)
    try:
        dims.validate(args, t.seq_len, gpus_per_node=8)
    except ConfigError as error:  # the one refusal allowed: a pipeline layout before pipelining exists
        assert p.pp > 1 and "pipeline parallelism is not available" in str(error), error
