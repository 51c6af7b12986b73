"""Under the paired Interleaved1F1B (parallel.ep_overlap, parallel/pipeline_pairing.py) the last stage's forward keeps
its outputs (the log-softmax its loss saved, the MTP module's) beside the backward it runs paired with: two
micro-batches' outputs at once where the unpaired schedule holds one. The planner counts the second (memory.py
rank_memory); the dry run measures it. debug-deepseek with an MTP module and a 32k vocabulary, so that the last
pipeline rank is the fullest and its outputs dominate, on pp 2 x dp_shard 2 x ep 2 with two stages a rank, full
recompute: the measured last rank and the planner's fullest rank agree within 5%, paired and unpaired, and what the
pairing adds agrees within 5% (without the second micro-batch's outputs the planner adds a twentieth of it)."""

import pytest

from trillion.parallel.planner.memory import FRAMEWORK_BYTES
from trillion.trainer.config.schema import load_config
from trillion.trainer.tools.estimate.dry_run import estimate

LAYOUT = ["--model.name=debug-deepseek", "--model.mtp_modules=1", "--model.vocab_size=32768"]
LAYOUT += ["--training.seq_len=256", "--training.global_batch_size=16", "--training.micro_batch_size=1"]
LAYOUT += ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B", "--parallel.dp_shard=2", "--parallel.ep=2"]
LAYOUT += ["--parallel.dp_shard_mode=zero1", "--parallel.activation_checkpoint=full"]


def _measured_and_planned(paired: bool) -> tuple[float, float]:
    """(the dry run's fullest rank, the planner's) in bytes, the planner's framework allowance left out of both."""
    config = load_config(None, [*LAYOUT, f"--parallel.ep_overlap={str(paired).lower()}"])
    ranks = estimate(config, 4, ranks="all").ranks
    held = {r.rank: r.parameters + r.gradients + r.optimizer + r.activations + r.buffers for r in ranks}
    fullest = max(held, key=held.get)
    assert fullest in (2, 3), held  # the last pipeline rank (pp index 1): its outputs dominate
    return held[fullest], ranks[0].planner["total"] - FRAMEWORK_BYTES


def test_the_paired_last_stage_keeps_two_micro_batches_outputs_as_planned():
    measured_paired, planned_paired = _measured_and_planned(True)
    measured, planned = _measured_and_planned(False)
    assert planned_paired == pytest.approx(measured_paired, rel=0.05)
    assert planned == pytest.approx(measured, rel=0.05)
    assert planned_paired - planned == pytest.approx(measured_paired - measured, rel=0.05)
