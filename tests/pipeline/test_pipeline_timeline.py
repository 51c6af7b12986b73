"""With profiling on, a pipeline run writes a per-stage timeline of the profiler's active steps:
every stage's forward and backward of every micro-batch, one row per pipeline rank, no overlap."""

import json

from tests.helpers.runs import run
from tests.helpers.spawn import as_launched, run_ranks
from trillion.trainer.config.schema import Profiling
from trillion.trainer.metrics.pipeline_timeline import is_profiled_step

MICRO_BATCHES = 2  # flags.TINY: global batch 4 in micro-batches of 2


def test_profiled_steps_follow_the_profiler_schedule():
    cfg = Profiling(enabled=True, wait=1, warmup=1, active=2, repeat=2)
    assert [s for s in range(5, 20) if is_profiled_step(cfg, s, first_step=5)] == [7, 8, 11, 12]
    assert not any(is_profiled_step(Profiling(enabled=False), s, 1) for s in range(1, 10))


def _profiled_run(rank, world_size, root):
    as_launched(rank, world_size)
    run(
        root,
        "--model.n_layers=2",
        "--parallel.pp=2",
        "--parallel.pp_schedule=1F1B",
        "--profiling.enabled=true",
        "--profiling.wait=1",
        "--profiling.warmup=0",
        "--profiling.active=1",
        "--checkpoint.interval=0",
        "--checkpoint.save_final=false",
        steps=2,
    )


def test_pipeline_run_writes_a_per_stage_timeline(tmp_path):
    run_ranks(_profiled_run, 2, tmp_path)
    assert not (tmp_path / "profiles" / "pipeline-step1.json").exists()  # the profiler waits one step
    events = json.loads((tmp_path / "profiles" / "pipeline-step2.json").read_text())["traceEvents"]
    actions = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        mine = sorted((e for e in actions if e["pid"] == rank), key=lambda e: e["ts"])
        assert {e["args"]["stage"] for e in mine} == {rank}
        for kind in ("forward", "backward"):
            assert sorted(e["args"]["micro_batch"] for e in mine if e["cat"] == kind) == list(range(MICRO_BATCHES))
        assert all(e["ts"] >= 0 and e["dur"] > 0 for e in mine)
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(mine, mine[1:]))  # one action at a time
    # 1F1B on the last stage: each forward is followed by its own backward
    last = [e["name"] for e in sorted((e for e in actions if e["pid"] == 1), key=lambda e: e["ts"])]
    assert last == ["forward 0", "backward 0", "forward 1", "backward 1"]
