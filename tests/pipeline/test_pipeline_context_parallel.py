"""Pipeline stages hand on the cp-sharded hidden state: pp x cp (x tp) reproduce the one-process run,
every parameter's gradient included, fp32 on gloo (harness: tests/helpers/pp_parity.py)."""

import pytest

from tests.helpers.pp_parity import check_pipeline_cases
from tests.helpers.spawn import run_ranks


def test_pp2_x_cp2():
    run_ranks(
        check_pipeline_cases, 4, [{"name": "gpt-pp2xcp2-1f1b", "family": "gpt", "pp": 2, "cp": 2, "schedule": "1F1B"}]
    )


@pytest.mark.slow  # 8 ranks on two cores: a few minutes
def test_4d_pp2_x_cp2_x_tp2():
    run_ranks(
        check_pipeline_cases,
        8,
        [
            {"name": "llama-pp2xcp2xtp2-1f1b", "family": "llama", "pp": 2, "cp": 2, "tp": 2, "schedule": "1F1B"},
            {
                "name": "gpt-pp2xcp2xtp2-interleaved",
                "family": "gpt",
                "pp": 2,
                "cp": 2,
                "tp": 2,
                "schedule": "Interleaved1F1B",
                "ac": "full",
            },
        ],
    )
