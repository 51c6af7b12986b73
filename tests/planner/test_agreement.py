"""The planner proposes exactly the pipeline layouts the trainer runs: for every schedule, pipeline
degree, micro-batch count and compile setting, `trillion plan` with that layout fixed finds it
valid if and only if the trainer's pipeline checks accept it (tests/helpers/schedules.py)."""

import itertools

import pytest

from tests.helpers.schedules import trainer_pipeline
from trillion.errors import ConfigError
from trillion.models.presets import get_preset
from trillion.parallel.modes import SCHEDULES
from trillion.parallel.planner.hardware import load_profile
from trillion.parallel.planner.search import Request, search

MODEL = "gpt-1.4b"  # 24 layers: room for pp 4 x 2 stages


def _trainer_accepts(schedule: str, pp: int, microbatches: int, compile_enabled: bool) -> bool:
    try:
        trainer_pipeline(pp, schedule, get_preset(MODEL).n_layers, microbatches, compile=compile_enabled)
    except ConfigError:
        return False
    return True


def _planner_accepts(schedule: str, pp: int, microbatches: int, compile_enabled: bool) -> bool:
    fixed = {
        "tp": 1,
        "pp": pp,
        "dp_shard": 1,
        "dp_replicate": 1,
        "micro_batch_size": 1,
        "pp_schedule": schedule,
        "activation_checkpoint": "none",
        "compile": compile_enabled,
    }
    request = Request(MODEL, get_preset(MODEL), load_profile("dgx-h100"), pp, microbatches, 2048, fixed=fixed)
    try:
        return bool(search(request).ranked)
    except ConfigError as error:
        assert "runs in the trainer" in str(error), str(error)  # refused for the trainer's reason, not memory
        return False


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_planner_refuses_exactly_what_the_trainer_refuses(schedule):
    outcomes = set()
    for pp, compile_enabled in itertools.product((2, 4), (False, True)):
        for microbatches in (pp - 1, pp, pp + 1, 2 * pp, 2 * pp + 1):
            trainer = _trainer_accepts(schedule, pp, microbatches, compile_enabled)
            assert _planner_accepts(schedule, pp, microbatches, compile_enabled) == trainer, (
                schedule,
                pp,
                microbatches,
                compile_enabled,
                trainer,
            )
            outcomes.add(trainer)
    # every schedule but GPipe (no rule on micro-batches or compile) has layouts on both sides
    assert outcomes == ({True} if schedule == "GPipe" else {True, False})
