"""Latent attention at its real head dims (DeepSeek-V3, Kimi K2: q/k 192 = 128 + 64 rotary, v 128): the kernels
run q/k's 192 as two dot products per tile over blocks of 128 and 64, not one over 192 padded to 256. The
unpadded kernel equals the padded one and a float64 reference, forward and backward, on CPU through the Triton
interpreter; the ahead-of-time report's tile FLOPs for 192/128 hold no padding."""

import math

import pytest
import torch

from trillion.kernels import flash_attention_launch
from trillion.kernels.flash_attention_op import flash_attention, reference_attention
from trillion.kernels.head_dims import block_d_for, block_dims_for
from trillion.kernels.report import tile_flops


def test_latent_attention_runs_unpadded_and_other_dims_pad_no_more_than_before():
    assert block_dims_for(192) == (128, 64)
    for head_dim in range(1, 257):
        blocks = block_dims_for(head_dim)
        assert sum(blocks) >= head_dim and sum(blocks) <= block_d_for(head_dim)
        assert all(b == 0 or (b >= 16 and b & (b - 1) == 0) for b in blocks)  # tl.dot's power-of-two blocks
    assert block_dims_for(128) == (128, 0) and block_dims_for(64) == (64, 0)  # powers of two: one block, as before


def run(q, k, v, grad, dtype=None, **kw):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, **kw) if dtype is None else reference_attention(*leaves, **kw)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_unpadded_kernel_equals_the_padded_one_and_float64(monkeypatch, dtype, causal):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 90, 192, generator=gen, dtype=dtype) for _ in range(2))
    v, grad = (torch.randn(1, 2, 90, 128, generator=gen, dtype=dtype) for _ in range(2))
    scale = 192**-0.5 * (0.1 * math.log(40) + 1) ** 2  # DeepSeek-V3's, with YaRN's correction
    unpadded = run(q, k, v, grad, causal=causal, softmax_scale=scale)
    exact = run(q, k, v, grad, dtype=torch.float64, causal=causal, softmax_scale=scale)
    monkeypatch.setattr(flash_attention_launch, "block_dims_for", lambda head_dim: (block_d_for(head_dim), 0))
    padded = run(q, k, v, grad, causal=causal, softmax_scale=scale)
    if dtype == torch.float32:  # two kernels ran: their sums round apart
        assert any(not torch.equal(mine, theirs) for mine, theirs in zip(unpadded, padded))
    for name, mine, theirs, truth in zip(("out", "dq", "dk", "dv"), unpadded, padded, exact):
        scale_of = truth.abs().max().item()
        same = 2e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        assert (mine.double() - theirs.double()).abs().max().item() <= same * scale_of, name  # summation order only
        bound = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * scale_of
        assert (mine.double() - truth).abs().max().item() <= bound, name


def test_the_report_counts_no_padded_work_for_latent_attention():
    tile = {"BLOCK_M": 64, "BLOCK_N": 32}
    for kernel in ("fwd", "dkdv", "dq"):
        executed, useful = tile_flops({"kernel": kernel, "size": 192, "out_size": 128, "config": tile})
        assert executed == useful
    padded, useful = tile_flops({"kernel": "fwd", "size": 96, "out_size": None, "config": tile})
    assert padded == 2 * 64 * 32 * (96 + 128) and useful == 2 * 64 * 32 * (96 + 96)  # v's 96 pads to 128
