"""Context parallelism on gloo, fp32: attention across sequence shards equals attention over the
whole sequence (forward and every input's gradient, on each backend), and cp layouts reproduce the
one-process run (losses, gradient norms, every parameter's gradient) for both model families,
alone and with FSDP, TP, activation checkpointing and compile. One spawn per world size."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers.parity import check_cases
from tests.helpers.spawn import run_ranks
from trillion.kernels import attention
from trillion.kernels.flash_attention_op import reference_attention
from trillion.parallel.context_parallel import attention_across_shards, positions_of, shard_sequence

FAMILIES = ("llama", "gpt")


def _attention_matches_the_whole_sequence(rank: int, cp: int) -> None:
    generator = torch.Generator().manual_seed(5)
    batch, q_heads, kv_heads, seq, head_dim = 2, 4, 2, 24, 16
    q = torch.randn(batch, q_heads, seq, head_dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=generator, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(batch, q_heads, seq, head_dim, generator=generator, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = reference_attention(*full, causal=True)
    reference.backward(grad)
    for impl in ("eager", "sdpa", "triton"):
        mine = [shard_sequence(t, rank, cp, dim=2).float().requires_grad_() for t in (q, k, v)]
        out = attention_across_shards(*mine, group=dist.group.WORLD, rank=rank, cp=cp, impl=impl)
        out.backward(shard_sequence(grad, rank, cp, dim=2).float())
        torch.testing.assert_close(
            out.double(),
            shard_sequence(reference, rank, cp, dim=2),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m: f"{impl} output: {m}",
        )
        for name, got, want in zip("qkv", mine, full):
            torch.testing.assert_close(
                got.grad.double(),
                shard_sequence(want.grad, rank, cp, dim=2),
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m: f"{impl} d{name}: {m}",
            )


def _two_ranks(rank: int, world_size: int, cases: list[dict]) -> None:
    _attention_matches_the_whole_sequence(rank, world_size)
    check_cases(rank, world_size, cases)


def test_positions_and_shards_are_load_balanced():
    # 4 ranks, 16 tokens: chunks of 2, rank r holds chunks r and 7 - r
    assert positions_of(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert positions_of(16, 3, 4).tolist() == [6, 7, 8, 9]
    tokens = torch.arange(16)[None]
    shards = [shard_sequence(tokens, r, 4) for r in range(4)]
    assert [s[0].tolist() for s in shards] == [positions_of(16, r, 4).tolist() for r in range(4)]
    assert sorted(torch.cat(shards, dim=1)[0].tolist()) == list(range(16))
    # every rank gets the same number of causal query-key pairs
    assert len({sum(p + 1 for p in positions_of(16, r, 4).tolist()) for r in range(4)}) == 1


def test_cp2_equals_one_process():
    cases = [{"name": f"{f}-cp2", "family": f, "cp": 2} for f in FAMILIES]
    # attention that stays inside each rank's shard (global positions kept) must not pass for it
    cases += [{"name": "llama-cp2-local-attention", "family": "llama", "cp": 2, "attend": attention, "differs": True}]
    cases += [
        {"name": "gpt-cp2-ac-full", "family": "gpt", "cp": 2, "ac": "full", "same_as": "gpt-cp2"},
        {"name": "llama-cp2-ac-op-compile", "family": "llama", "cp": 2, "ac": "selective:op", "compile": "aot_eager"},
    ]
    run_ranks(_two_ranks, 2, cases)


def test_cp2_with_fsdp_and_with_tensor_parallelism():
    cases = [{"name": f"{f}-cp2xfsdp2", "family": f, "cp": 2, "dp_shard": 2} for f in FAMILIES]
    cases += [{"name": f"{f}-cp2xtp2", "family": f, "cp": 2, "tp": 2} for f in FAMILIES]
    run_ranks(check_cases, 4, cases)


@pytest.mark.slow
def test_cp2_with_hsdp_and_zero_modes():
    cases = [
        {
            "name": "llama-hsdp2xcp2-zero2",
            "family": "llama",
            "dp_replicate": 2,
            "dp_shard": 1,
            "cp": 2,
            "mode": "zero2",
        },
        {"name": "gpt-cp2xfsdp2-zero1", "family": "gpt", "cp": 2, "dp_shard": 2, "mode": "zero1"},
    ]
    run_ranks(check_cases, 4, cases)


@pytest.mark.slow  # the Triton kernel under the interpreter
def test_cp2_on_the_triton_kernel():
    run_ranks(
        check_cases,
        2,
        [
            {"name": "llama-cp2-triton", "family": "llama", "cp": 2, "attention": "triton"},
            {"name": "gpt-cp2-triton", "family": "gpt", "cp": 2, "attention": "triton"},
        ],
    )
