"""Muon's state in checkpoints: a run resumed at dp_shard 2 is bitwise the run that never stopped (momentum
buffers included); a checkpoint saved at tp 2 resumes in one process on the same curve (1e-6), its momentum
resharded; and a checkpoint resumed with another optimizer is refused before any tensor is read."""

import json
import shutil

import pytest
import torch

from tests.helpers.runs import losses, read_checkpoint, run
from tests.helpers.spawn import as_launched, run_ranks
from trillion.errors import ConfigError

MUON = ["--optimizer.name=muon", "--eval.interval=0"]


def _two_ranks(rank, world_size, root):
    """At dp_shard 2: 3 steps straight, and 3 steps stopped after 2 and resumed; at tp 2: 3 steps, saving at 2."""
    as_launched(rank, world_size)
    # MuonClip on (its tau never reached here): a resume runs an optimizer step on zero gradients to make the state
    # it loads into, which the clip must leave alone
    dp = ["--parallel.dp_shard=2", "--optimizer.qk_clip=50"]
    saving = ["--checkpoint.interval=2", "--checkpoint.keep_latest=0"]
    run(root / "straight", *MUON, *dp, steps=3)
    run(root / "chained", *MUON, *dp, *saving, "--training.exit_interval=2", steps=3)
    run(root / "chained", *MUON, *dp, *saving, steps=3)
    run(root / "tp", *MUON, "--parallel.tp=2", *saving, steps=3)


def test_muon_resumes_bitwise_at_dp_2_and_from_tp_2_in_one_process(tmp_path):
    run_ranks(_two_ranks, 2, tmp_path)
    assert losses(tmp_path / "chained") == losses(tmp_path / "straight")
    logged = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    maxima = [r for r in logged if "attention/max_logit" in r]  # MuonClip's per-layer maxima, reduced over dp
    assert maxima and all(0 < r["attention/max_logit/layer0"] <= r["attention/max_logit"] for r in maxima)
    straight, chained = read_checkpoint(tmp_path / "straight", step=3), read_checkpoint(tmp_path / "chained", step=3)
    assert any(n.endswith("momentum_buffer") for n in straight) and any(n.endswith("exp_avg") for n in straight)
    for name, value in straight.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(chained[name], value), name

    shutil.copytree(tmp_path / "tp", tmp_path / "alone")
    shutil.rmtree(tmp_path / "alone" / "checkpoints" / "step-00000003")
    run(tmp_path / "alone", *MUON, steps=3)  # resumes the tp 2 checkpoint of step 2 in one process
    reference, resumed = losses(tmp_path / "tp"), losses(tmp_path / "alone")
    assert resumed[:2] == reference[:2] and resumed[2][0] == 3
    torch.testing.assert_close(resumed[2][1], reference[2][1], rtol=1e-6, atol=0)
    saved, continued = read_checkpoint(tmp_path / "tp", step=3), read_checkpoint(tmp_path / "alone", step=3)
    for name, value in saved.items():
        if name.startswith("model.") or name.endswith("momentum_buffer"):
            error = ((continued[name] - value).norm() / value.norm()).item()
            assert error <= 1e-6, f"{name}: {error:.2e} relative"


def test_a_checkpoint_resumed_with_another_optimizer_is_refused(tmp_path):
    run(tmp_path, "--eval.interval=0", steps=1)
    with pytest.raises(ConfigError) as refused:
        run(tmp_path, *MUON, steps=2)
    message = str(refused.value)
    assert "optimizer.name was 'adamw' there and is 'muon' now" in message and "--optimizer.name=adamw" in message
    assert "\n" not in message
