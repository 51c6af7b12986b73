"""DeepSeek-V3's multi-token prediction under every layout reproduces one process (tests/moe/harness.py: losses,
the MTP loss, gradient norms, every gradient, fp32 on gloo): its module and the output head on a pipeline's last
stage with a copy of the embedding whose gradient is summed with the first stage's (parallel/pipeline_ahead.py),
its block tensor-parallel like the trunk's, its positions under context parallelism, its experts under ep."""

import pytest

from tests.helpers.spawn import run_ranks
from tests.moe.harness import check_cases


def test_mtp_with_pp2_tp2_and_cp2():
    run_ranks(
        check_cases,
        2,
        [
            {"name": "mtp-pp2", "pp": 2, "dp_shard": 1, "variant": "mtp"},
            {"name": "mtp-tp2", "dp_shard": 1, "tp": 2, "variant": "mtp"},
            {"name": "mtp-cp2", "dp_shard": 1, "cp": 2, "variant": "mtp"},
        ],
    )


@pytest.mark.slow  # about a minute on two cores
def test_mtp_with_pp2_x_ep2_and_pp4():
    run_ranks(
        check_cases,
        4,
        [
            {"name": "mtp-pp2xep2", "pp": 2, "dp_shard": 2, "ep": 2, "variant": "mtp"},
            # the first and last stage two ranks apart: their own group sums the embedding's gradients
            {"name": "mtp-pp4", "pp": 4, "dp_shard": 1, "variant": "mtp"},
        ],
    )
