"""The estimate (fake process group, meta device) against real gloo runs of the same layout on CPU:
parameter, gradient and optimizer-state bytes per rank equal exactly; the activation peak measured
on meta tensors is within 10% of the same measurement on real tensors."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
from spawn import run_ranks  # noqa: E402

from parallel.estimate import estimate  # noqa: E402
from trainer.config import load_config  # noqa: E402
from real_run import measure_rank  # noqa: E402

# fp32 on CPU; dp_shard 3 would not divide the vocabulary: 2 and 4 ranks keep the run short
BASE = ["--job.device=cpu", "--model.name=debug", "--model.n_layers=2", "--training.seq_len=64",
        "--training.global_batch_size=4", "--training.micro_batch_size=2", "--optimizer.implementation=foreach"]
LAYOUTS = {
    "dp_shard2": (2, ["--parallel.dp_shard=2"]),
    "tp2": (2, ["--parallel.dp_shard=1", "--parallel.tp=2"]),
    "dp_shard2xtp2": (4, ["--parallel.dp_shard=2", "--parallel.tp=2"]),
    "dp_shard2-ac-full": (2, ["--parallel.dp_shard=2", "--parallel.activation_checkpoint=full"]),
    "tp2-ac-full-gpt": (2, ["--parallel.dp_shard=1", "--parallel.tp=2", "--parallel.activation_checkpoint=full",
                            "--model.name=debug-gpt"]),
    "dp_shard2xtp2-zero1-gpt": (4, ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.dp_shard_mode=zero1",
                                    "--model.name=debug-gpt"]),
}


DEFAULT = ("dp_shard2xtp2", "dp_shard2-ac-full")  # the rest are slow: about 40 s each on two cores


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_estimate_equals_real_gloo_run(name, tmp_path):
    world, layout = LAYOUTS[name]
    overrides = BASE + layout
    out = str(tmp_path / "real")
    run_ranks(measure_rank, world, overrides, out)
    real = [json.load(open(f"{out}.{rank}")) for rank in range(world)]
    result = estimate(load_config(None, overrides), world, ranks="all")
    for rank, (measured, predicted) in enumerate(zip(real, result.ranks)):
        assert predicted.rank == rank and predicted.activations_source == "measured"
        for kind in ("parameters", "gradients", "optimizer"):
            assert getattr(predicted, kind) == measured[kind], (name, rank, kind, getattr(predicted, kind), measured[kind])
        ratio = predicted.activations / measured["activations"]
        assert 0.9 <= ratio <= 1.1, (name, rank, predicted.activations, measured["activations"])
