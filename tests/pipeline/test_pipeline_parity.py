"""Pipeline layouts reproduce the one-process run: losses, gradient norms (clipped across stages),
every parameter's gradient and the initial weights, over several optimizer steps, fp32 on gloo.
The parity models have 2 layers: 4 units (embedding, 2 layers, output), so pp 2 with 2 virtual
stages per rank puts one unit on each stage: under tensor parallelism the embedding-only stage
hands the next one the sequence-sharded residual stream.

The zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) split each backward into
input- and weight-gradient passes; under FSDP zero3 they once dropped the weight gradients of every
micro-batch whose input pass ran while a block was resharded (parallel/pipeline.py explains why):
the pp 2 x FSDP 2 zero3 cases are the regression tests."""

import pytest

from tests.helpers.pp_parity import check_pipeline_cases
from tests.helpers.spawn import run_ranks


def test_two_stages_gpipe_and_1f1b():
    cases = [
        {"name": f"{f}-pp2-{s}", "family": f, "pp": 2, "schedule": s}
        for f in ("llama", "gpt")
        for s in ("GPipe", "1F1B")
    ]
    cases.append(_case("llama", "1F1B", compile="aot_eager"))  # each stage's blocks compiled
    # parallel.pp_layout's uneven splits: a stage with the embedding alone, and one with the output head alone
    cases += [
        _case("llama", "1F1B", pp_layout="E | 2+O", blocks=[0, 2]),
        _case("gpt", "GPipe", pp_layout="E+2 | O", blocks=[2, 0]),
    ]
    run_ranks(check_pipeline_cases, 2, cases)


def test_two_ranks_looped_schedules_with_two_virtual_stages():
    cases = [
        {"name": "llama-pp2-interleaved1f1b", "family": "llama", "pp": 2, "schedule": "Interleaved1F1B"},
        {"name": "gpt-pp2-loopedbfs", "family": "gpt", "pp": 2, "schedule": "LoopedBFS"},
    ]
    run_ranks(check_pipeline_cases, 2, cases)


def test_two_ranks_zero_bubble_schedules():
    cases = [_case("llama", "ZBVZeroBubble"), _case("gpt", "InterleavedZeroBubble"), _case("gpt", "DualPipeV")]
    run_ranks(check_pipeline_cases, 2, cases)


def test_pp2_zero_bubble_with_fsdp_zero3_zero2_tp_and_checkpointing():
    """The planner's favourite layouts: zero-bubble schedules under FSDP (zero3, and zero2 with full
    activation checkpointing) and under TP; the breadth is in the -m slow tests below."""
    run_ranks(
        check_pipeline_cases,
        4,
        [
            _case("llama", "ZBVZeroBubble", dp_shard=2),
            _case("gpt", "InterleavedZeroBubble", dp_shard=2, mode="zero2", ac="full"),
            _case("llama", "ZBVZeroBubble", tp=2),
        ],
    )


@pytest.mark.slow  # about a minute on two cores
def test_pp2_x_fsdp2_zero_bubble_schedules():
    cases = [
        _case("gpt", "InterleavedZeroBubble", dp_shard=2),
        _case("llama", "DualPipeV", dp_shard=2, micro=1),  # 4 micro-batches: DualPipeV needs one per stage
        _case("gpt", "ZBVZeroBubble", dp_shard=2, mode="zero2"),
    ]
    run_ranks(check_pipeline_cases, 4, cases)


@pytest.mark.slow  # about a minute on two cores
def test_pp2_x_tp2_zero_bubble_schedules():
    cases = [_case("llama", "ZBVZeroBubble", tp=2), _case("gpt", "InterleavedZeroBubble", tp=2)]
    run_ranks(check_pipeline_cases, 4, cases)


def test_pp2_x_fsdp2_1f1b():
    run_ranks(
        check_pipeline_cases,
        4,
        [{"name": "llama-pp2xfsdp2-1f1b", "family": "llama", "pp": 2, "dp_shard": 2, "schedule": "1F1B"}],
    )


@pytest.mark.slow  # about a minute on two cores
def test_pp2_x_fsdp2_more_schedules_modes_and_activation_checkpointing():
    cases = [
        {"name": "gpt-pp2xfsdp2-1f1b", "family": "gpt", "pp": 2, "dp_shard": 2, "schedule": "1F1B"},
        {
            "name": "gpt-pp2xfsdp2-gpipe-zero1",
            "family": "gpt",
            "pp": 2,
            "dp_shard": 2,
            "schedule": "GPipe",
            "mode": "zero1",
        },
        {
            "name": "llama-pp2xfsdp2-interleaved1f1b-zero2",
            "family": "llama",
            "pp": 2,
            "dp_shard": 2,
            "schedule": "Interleaved1F1B",
            "mode": "zero2",
        },
        {
            "name": "gpt-pp2xfsdp2-interleaved1f1b-ac-full",
            "family": "gpt",
            "pp": 2,
            "dp_shard": 2,
            "schedule": "Interleaved1F1B",
            "ac": "full",
        },
    ]
    run_ranks(check_pipeline_cases, 4, cases)


def _case(family: str, schedule: str, **layout) -> dict:
    """A pp 2 case; `layout` adds dp_shard, tp, ac, ... and names it."""
    name = "-".join([family, "pp2", schedule.lower(), *(f"{key}={value}" for key, value in layout.items())])
    return {"name": name, "family": family, "pp": 2, "schedule": schedule, **layout}


def test_3d_pp2_x_fsdp2_x_tp2():
    """The paper's layout in miniature on 8 ranks, one case per family and schedule kind; the 1F1B
    case sizes its stages explicitly (the last holds only the final norm and output)."""
    run_ranks(
        check_pipeline_cases,
        8,
        [
            _case("llama", "1F1B", dp_shard=2, tp=2, last_stage_layers=0),
            _case("gpt", "Interleaved1F1B", dp_shard=2, tp=2),
            _case("gpt", "GPipe", dp_shard=2, tp=2),
            _case("llama", "LoopedBFS", dp_shard=2, tp=2),
            _case("gpt", "ZBVZeroBubble", dp_shard=2, tp=2),
        ],
    )


@pytest.mark.slow  # about 1.5 minutes on two cores
def test_3d_other_pairs_and_activation_checkpointing_inside_stages():
    run_ranks(
        check_pipeline_cases,
        8,
        [
            _case("gpt", "1F1B", dp_shard=2, tp=2),
            _case("llama", "Interleaved1F1B", dp_shard=2, tp=2),
            _case("llama", "1F1B", dp_shard=2, tp=2, ac="selective:op"),
            _case("gpt", "Interleaved1F1B", dp_shard=2, tp=2, ac="full"),
        ],
    )


def test_pp2_x_tp2():  # each single- and multi-stage schedule under TP (the zero-bubble ones above)
    run_ranks(
        check_pipeline_cases,
        4,
        [
            _case("llama", "1F1B", tp=2),
            _case("gpt", "GPipe", tp=2),
            _case("gpt", "LoopedBFS", tp=2, ac="selective:op"),
            _case("llama", "Interleaved1F1B", tp=2, ac="full"),
        ],
    )
