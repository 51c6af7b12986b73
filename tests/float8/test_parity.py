"""Emulated float8 on gloo, fp32 master weights: one process = dp_shard 2 = tp 2 = dp_shard 2 x tp 2 for
tensorwise (FSDP float8 all-gather, torchao's float8 TP styles, tp 2 also compiled with aot_eager) and
rowwise, and rowwise_with_gw_hp at tp 2, within the plain parity harness's tolerance
(tests/float8/layouts.py says why it can be that tight)."""

from tests.float8.layouts import check_layouts
from tests.helpers.spawn import run_ranks


def test_two_ranks_fsdp_and_tensor_parallel():
    cases = [
        {"name": "tensorwise-fsdp2", "recipe": "tensorwise", "dp_shard": 2, "expect_gather": True},
        {"name": "tensorwise-tp2", "recipe": "tensorwise", "tp": 2},  # torchao's float8 TP styles
        {"name": "tensorwise-tp2-compiled", "recipe": "tensorwise", "tp": 2, "compile": True},  # styles traced
        {"name": "rowwise-fsdp2", "recipe": "rowwise", "dp_shard": 2},  # high-precision all-gather
        {"name": "gw_hp-tp2", "recipe": "rowwise_with_gw_hp", "tp": 2},  # plain TP styles
    ]
    run_ranks(check_layouts, 2, cases)


def test_four_ranks_fsdp_x_tensor_parallel():
    cases = [
        {"name": "tensorwise-fsdp2xtp2", "recipe": "tensorwise", "dp_shard": 2, "tp": 2, "expect_gather": True},
        {"name": "rowwise-fsdp2xtp2", "recipe": "rowwise", "dp_shard": 2, "tp": 2},
    ]
    run_ranks(check_layouts, 4, cases, False)
