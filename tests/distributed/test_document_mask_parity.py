"""Document masking under every layout: fsdp (dp 2), tp 2, pp 2 and cp 2 (the all-gather path, masking by
global positions in the load-balanced split) reproduce the one-process masked run, fp32 on gloo, over several
steps with gradient accumulation, with activation checkpointing and compile, and with positions restarting at
each document: the loss of every step, and the gradient norm and every gradient of the first, within 1e-6
relative (a tensor's: the norm of the difference over its norm), every gradient and norm of every step within the
parity tests' elementwise tolerance. Later steps' gradients and norms are not held to 1e-6: AdamW's first step
moves a weight whose gradient is near its eps by an amount linear in that gradient's last bits, which differ with
the reduction order (tests/helpers/parity.py `_compare_relative` has the measurement). A run whose
attention drops the document ids must differ (the masks reach the attention)."""

import pytest

from tests.helpers.parity import check_cases
from tests.helpers.pp_parity import check_pipeline_cases
from tests.helpers.spawn import run_ranks
from trillion.kernels import attention

RELATIVE = 1e-6  # each loss, gradient norm and gradient tensor: the norm of the difference over the norm


def unmasked(q, k, v, *, impl="sdpa", causal=True, softmax_scale=None, document_ids=None):
    """Attention that ignores the documents it is given."""
    return attention(q, k, v, impl=impl, causal=causal, softmax_scale=softmax_scale)


DOCUMENTS = {"documents": True, "relative": RELATIVE}


def test_fsdp_tp_and_cp_mask_documents_as_one_process():
    cases = [
        {
            "name": "gpt-fsdp2-docs-reset-ac-full-compile",
            "family": "gpt",
            "dp_shard": 2,
            "reset": True,
            "ac": "full",
            "compile": "aot_eager",
            **DOCUMENTS,
        },
        {"name": "gpt-tp2-docs-reset", "family": "gpt", "tp": 2, "reset": True, **DOCUMENTS},
        {"name": "llama-cp2-docs", "family": "llama", "cp": 2, **DOCUMENTS},
        {
            "name": "llama-tp2-docs-dropped",
            "family": "llama",
            "tp": 2,
            "attend": unmasked,
            "differs": True,
            **DOCUMENTS,
        },
    ]
    run_ranks(check_cases, 2, cases)


def test_pipeline_carries_the_document_ids_with_each_micro_batch():
    run_ranks(
        check_pipeline_cases,
        2,
        [{"name": "llama-pp2-1f1b-docs", "family": "llama", "pp": 2, "schedule": "1F1B", **DOCUMENTS}],
    )


@pytest.mark.slow
def test_more_layouts_mask_documents_as_one_process():
    cases = [
        {"name": "llama-fsdp2-docs", "family": "llama", "dp_shard": 2, **DOCUMENTS},
        {"name": "llama-tp2-docs", "family": "llama", "tp": 2, **DOCUMENTS},
        {"name": "gpt-cp2-docs-reset", "family": "gpt", "cp": 2, "reset": True, **DOCUMENTS},
        {
            "name": "llama-tp2-docs-ac-op-compile",
            "family": "llama",
            "tp": 2,
            "ac": "selective:op",
            "compile": "aot_eager",
            **DOCUMENTS,
        },
    ]
    run_ranks(check_cases, 2, cases)


@pytest.mark.slow
def test_an_interleaved_pipeline_carries_the_document_ids_and_positions():
    case = {
        "name": "gpt-pp2-interleaved-docs-reset",
        "family": "gpt",
        "pp": 2,
        "schedule": "Interleaved1F1B",
        "virtual": 2,
        "micro": 1,
        "reset": True,
        **DOCUMENTS,
    }
    run_ranks(check_pipeline_cases, 2, [case])
