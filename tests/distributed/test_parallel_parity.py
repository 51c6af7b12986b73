"""Every supported layout reproduces the one-process run: losses, gradient norms, every gradient
(full_tensor) and the initial weights, over several optimizer steps with gradient accumulation,
fp32 on gloo, for both model families. Cases share a process group to amortize start-up.

Compile cases use the aot_eager backend in the default run (dynamo + AOTAutograd, where DTensor
composition can break, without inductor's C++ build time on two cores); the slow test runs
inductor itself."""

import pytest

from tests.helpers.parity import check_cases
from tests.helpers.spawn import run_ranks

FAMILIES = ("llama", "gpt")


def test_two_ranks_fsdp_modes_and_tensor_parallel():
    cases = [
        {"name": f"{f}-fsdp2-{m}", "family": f, "dp_shard": 2, "mode": m}
        for f in FAMILIES
        for m in ("zero1", "zero2", "zero3")
    ]
    cases += [{"name": f"{f}-tp2", "family": f, "tp": 2} for f in FAMILIES]
    # activation checkpointing changes nothing: bit-identical to the same layout without it
    cases += [
        {"name": "llama-tp2-ac-selective", "family": "llama", "tp": 2, "ac": "selective", "same_as": "llama-tp2"},
        {
            "name": "gpt-fsdp2-ac-full",
            "family": "gpt",
            "dp_shard": 2,
            "mode": "zero2",
            "ac": "full",
            "same_as": "gpt-fsdp2-zero2",
        },
    ]
    run_ranks(check_cases, 2, cases)


def test_four_ranks_hsdp_and_fsdp_x_tp():
    cases = [{"name": f"{f}-hsdp2x2", "family": f, "dp_replicate": 2, "dp_shard": 2} for f in FAMILIES]
    cases += [{"name": f"{f}-fsdp2xtp2", "family": f, "dp_shard": 2, "tp": 2} for f in FAMILIES]
    cases += [
        {
            "name": "llama-fsdp2xtp2-ac-full",
            "family": "llama",
            "dp_shard": 2,
            "tp": 2,
            "ac": "full",
            "same_as": "llama-fsdp2xtp2",
        },
        {
            "name": "gpt-fsdp2xtp2-zero1-ac-op",
            "family": "gpt",
            "dp_shard": 2,
            "tp": 2,
            "mode": "zero1",
            "ac": "selective:op",
        },
        {
            "name": "gpt-replicate2xtp2-zero1",
            "family": "gpt",
            "dp_replicate": 2,
            "dp_shard": 1,
            "tp": 2,
            "mode": "zero1",
        },
        # compile per block, TP inside, FSDP outside: within tolerance of eager one-process
        {"name": "llama-fsdp2xtp2-compile", "family": "llama", "dp_shard": 2, "tp": 2, "compile": "aot_eager"},
    ]
    run_ranks(check_cases, 4, cases)


HSDP_X_TP = [
    {"name": f"{f}-hsdp2x2xtp2", "family": f, "dp_replicate": 2, "dp_shard": 2, "tp": 2, "mode": "zero2"}
    for f in FAMILIES
]


def test_eight_ranks_hsdp_x_tp():  # the parallelism guide's HSDP 2 x 2 x TP 2 command, one family
    run_ranks(check_cases, 8, HSDP_X_TP[:1])


@pytest.mark.slow
def test_eight_ranks_hsdp_x_tp_and_plain_replication():
    cases = HSDP_X_TP[1:] + [
        {"name": "llama-replicate8", "family": "llama", "dp_replicate": 8, "dp_shard": 1, "mode": "zero3"}
    ]
    run_ranks(check_cases, 8, cases)


@pytest.mark.slow
def test_four_ranks_fsdp_x_tp_compiled_with_inductor():
    cases = [
        {
            "name": f"{f}-fsdp2xtp2-inductor",
            "family": f,
            "dp_shard": 2,
            "tp": 2,
            "compile": "inductor",
            "ac": "selective:op" if f == "gpt" else "none",
        }
        for f in FAMILIES
    ]
    run_ranks(check_cases, 4, cases)


@pytest.mark.slow
def test_two_ranks_compile_with_activation_checkpointing():
    cases = [
        {"name": "llama-tp2-ac-op-compile", "family": "llama", "tp": 2, "ac": "selective:op", "compile": "aot_eager"},
        {"name": "gpt-fsdp2-ac-full-compile", "family": "gpt", "dp_shard": 2, "ac": "full", "compile": "aot_eager"},
    ]
    run_ranks(check_cases, 2, cases)
