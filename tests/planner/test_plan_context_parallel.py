"""The planner's context parallelism: each rank's activations fall ~1/cp, the K/V exchange is
costed, and `trillion plan` picks cp when a long sequence needs it, writing a config that trains."""

import json

from trillion.models.presets import get_preset
from trillion.parallel.layout import Layout
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.search import Request, evaluate
from trillion.trainer.cli.main import main as trillion
from trillion.trainer.config.schema import load_config


def test_activations_divide_by_cp_and_the_exchange_is_costed():
    request = Request("llama3-8b", get_preset("llama3-8b"), load_profile("dgx-h100"), 8, 8, 131072)
    one, four = (
        evaluate(
            request,
            Layout(dp_shard=8 // cp, microbatches=8 // (8 // cp), activation_checkpoint="full", cp=cp),
        )
        for cp in (1, 4)
    )
    assert one.memory.activations / 4 <= four.memory.activations < 1.05 * one.memory.activations / 4
    assert four.memory.parameters == one.memory.parameters  # FSDP shards over dp_shard x cp: 8 ranks either way
    assert one.step.cp_exposed == 0 < four.step.cp_exposed < 0.05 * four.step.total


def test_plan_picks_cp_for_a_long_sequence(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert (
        trillion(
            [
                "plan",
                "--model",
                "llama3-8b",
                "--seq-len",
                "131072",
                "--gpus",
                "8",
                "--hardware",
                "dgx-h100",
                "--global-batch",
                "8",
                "--format",
                "json",
                "--top",
                "3",
                "--config-out",
                str(out),
            ]
        )
        == 0
    )
    best = json.loads(capsys.readouterr().out)["candidates"][0]
    assert best["cp"] > 1 and best["fits"]
    config = load_config(str(out))
    assert (config.parallel.cp, config.model.max_seq_len, config.training.seq_len) == (best["cp"], 131072, 131072)
