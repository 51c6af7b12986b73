"""The experts' float8 grouped GEMM (kernels/float8_grouped_gemm.py) against a reference written here: each
operand quantised block by block in plain torch (a power-of-two scale per block, e4m3 cast, dequantised) and
multiplied group by group in float64. Forward, input gradient and weight gradient, for both recipes, emulated
and on the Triton kernels under the interpreter (Triton's float8 dots run there), on uneven, empty and
short groups, rows past the groups, and dims that are not multiples of 128 (short blocks). Tolerance: fp32
accumulation of exact float8 products against float64, 1e-5 relative to the largest value. The float8 result
differs from the high-precision product by float8's own error (a few percent), so the reference is not the
high-precision one in disguise."""

import logging
import math

import pytest
import torch

from trillion.kernels import float8_grouped_gemm as f8
from trillion.kernels import float8_scaling as scaling

E4M3 = torch.float8_e4m3fn
# (group sizes, rows, K, N): N, then K, spans two 128-blocks, the second short; a group spans two 128-row tiles
CASES = {
    "uneven-and-empty": ([5, 0, 131, 9, 0], 150, 24, 136),
    "rows-past-the-groups": ([3, 0, 19], 40, 136, 24),
    "empty-first-and-all-short": ([0, 7, 1], 8, 40, 17),
}


def _scale(amax: float) -> float:
    """The smallest power of two s with amax / s <= 448 (1 for zeros), written out."""
    return 1.0 if amax == 0 else 2.0 ** math.ceil(math.log2(amax / 448))


def _qdq(block: torch.Tensor) -> torch.Tensor:
    s = _scale(block.abs().max().item())
    return (block.double() / s).float().to(E4M3).double() * s


def _reference_blocks(t: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """t (..., R, C) quantised and dequantised block by block (None: the whole dim), float64."""
    out = torch.empty(t.shape, dtype=torch.float64)
    r, c = t.shape[-2:]
    rows, cols = rows or r, cols or c
    for i in range(0, r, rows):
        for j in range(0, c, cols):
            if t.dim() == 3:
                for g in range(t.shape[0]):
                    out[g, i : i + rows, j : j + cols] = _qdq(t[g, i : i + rows, j : j + cols])
            else:
                out[i : i + rows, j : j + cols] = _qdq(t[i : i + rows, j : j + cols])
    return out


def _reference(recipe: str, x, weight, dy, sizes):
    """(out, dx, dweight) as the recipe quantises each GEMM's operands (kernels/float8_scaling.py's table)."""
    act, wts = ((1, 128), (128, 128)) if recipe == "blockwise" else ((1, None), (None, 1))
    tile = 128 if recipe == "blockwise" else None
    xq, dyq = _reference_blocks(x, *act), _reference_blocks(dy, *act)
    wq, wtq = _reference_blocks(weight, *wts), _reference_blocks(weight.transpose(1, 2), *wts)
    out, dx = torch.zeros(x.shape[0], weight.shape[2], dtype=torch.float64), torch.zeros_like(xq)
    dw = torch.zeros(weight.shape, dtype=torch.float64)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        out[rows], dx[rows] = xq[rows] @ wq[g], dyq[rows] @ wtq[g]
        for t in range(start, start + size, tile or max(size, 1)):  # token tiles: 128 rows, or the group
            tile_rows = slice(t, min(t + (tile or size), start + size))
            xt, dyt = _reference_blocks(x[tile_rows], None, 1), _reference_blocks(dy[tile_rows], None, 1)
            dw[g] += xt.T @ dyt
        start += size
    return out, dx, dw


def _run(product, x, weight, dy, offsets, segments=None):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = product(x, weight, offsets, segments)
    out.backward(dy)
    return out.detach(), x.grad, weight.grad


def _data(case: str, seed: int = 0):
    sizes, rows, k, n = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    # rows and columns of different magnitudes, so that blocks get different scales
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=gen)]
    weight = torch.randn(len(sizes), k, n, generator=gen) * torch.logspace(-1, 1, n)
    dy = torch.randn(rows, n, generator=gen) * torch.logspace(-3, 1, rows).unsqueeze(1)
    return sizes, x, weight, dy, torch.tensor(sizes).cumsum(0).to(torch.int32)


# rowwise on the Triton kernel (only where torchao's grouped GEMM does not run) in the slow tier: the interpreter's
# minutes go to the default recipe's kernel launches
# mxfp8 through the Triton kernel gives a wrong dx, and in two cases a wrong out, on the CPU interpreter: an open bug.
# The trainer never takes that path (choose() runs mxfp8 in torchao's MX GEMM, or emulated), so it is held as a
# strict xfail: the day the kernel is fixed, this fails and the mark must go.
MXFP8_TRITON_WRONG = pytest.mark.xfail(reason="mxfp8 through the Triton kernel: wrong out or dx (open)", strict=True)
BACKENDS = [
    (
        recipe,
        backend,
        {("rowwise", "triton"): pytest.mark.slow, ("mxfp8", "triton"): MXFP8_TRITON_WRONG}.get((recipe, backend), ()),
    )
    for recipe in scaling.RECIPES
    for backend in ("emulated", "triton")
]


@pytest.mark.parametrize("recipe, backend", [pytest.param(r, b, marks=m) for r, b, m in BACKENDS])
@pytest.mark.parametrize("case", list(CASES))
def test_each_recipe_matches_a_torch_quantize_dequantize_reference(case, recipe, backend):
    sizes, x, weight, dy, offsets = _data(case)
    product = (
        f8.Float8GroupedMM(recipe, emulate=True)
        if backend == "emulated"
        else lambda *a: f8._Float8GroupedMM.apply(*a[:3], a[2], f8._Product(recipe, "triton", "auto", E4M3))
    )
    ours = _run(product, x, weight, dy, offsets)
    reference = _reference(recipe, x, weight, dy, sizes)
    for name, mine, want in zip(("out", "dx", "dweight"), ours, reference):
        bound = 1e-5 * want.abs().max().item() + 1e-30
        assert (mine.double() - want).abs().max().item() <= bound, name
    used = int(offsets[-1])
    assert not ours[0][used:].any() and not ours[1][used:].any()  # rows past the groups: zeros, zero gradients
    assert not ours[2][[g for g, s in enumerate(sizes) if s == 0]].any()  # an empty group: a zero gradient
    high = torch.zeros_like(ours[0])
    start = 0
    for g, size in enumerate(sizes):
        high[start : start + size] = x[start : start + size] @ weight[g]
        start += size
    error = (ours[0] - high).norm() / high.norm()
    assert 1e-3 < error < 0.1, error  # float8's own error: visible, and only that


def test_the_weight_gradient_tiles_restart_at_every_source():
    """An expert's rows from two sources (two ep ranks) with segments give the sum of each source's own weight
    gradient, what one process computes micro-batch by micro-batch; one tile over both sources would not."""
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(40, 136, generator=gen), torch.randn(40, 24, generator=gen)
    x[16:] *= 100  # the second source's tokens are larger: a shared tile would take their scale
    weight = torch.randn(1, 136, 24, generator=gen)
    for recipe in scaling.RECIPES:
        product = f8.Float8GroupedMM(recipe, emulate=True)
        together = _run(product, x, weight, dy, torch.tensor([40], dtype=torch.int32), torch.tensor([16, 40]).int())
        first = _run(product, x[:16], weight, dy[:16], torch.tensor([16], dtype=torch.int32))
        second = _run(product, x[16:], weight, dy[16:], torch.tensor([24], dtype=torch.int32))
        torch.testing.assert_close(together[2], first[2] + second[2], rtol=1e-6, atol=1e-4)
        one_tile = _run(product, x, weight, dy, torch.tensor([40], dtype=torch.int32))
        assert not torch.allclose(one_tile[2], together[2], rtol=1e-4, atol=1e-4), recipe


def test_scales_are_powers_of_two_and_quantising_again_gives_the_same_values():
    """What float8 dispatch relies on: the experts quantise the dispatched (dequantised) rows again."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(33, 300, generator=gen) * torch.logspace(-6, 6, 300)
    x[3] = 0  # an all-zero row: scale 1
    for recipe in scaling.RECIPES:
        blocks = scaling.activation_blocks(recipe)
        data, scale = scaling.quantize_blocks(x, *blocks, E4M3)
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round())) and scale[3].eq(1).all()
        once = scaling.dequantize_blocks(data, scale, *blocks, torch.float32)
        twice = scaling.dequantize_blocks(*scaling.quantize_blocks(once, *blocks, E4M3), *blocks, torch.float32)
        assert torch.equal(once, twice), recipe
        assert data.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0].min() > 448 / 2 - 32  # the range is used


def test_the_choice_of_backend_and_its_reasons(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert f8.choose("auto", cpu, emulate=True)[:2] == ("blockwise", "emulated")
    assert f8.choose("rowwise", cpu, emulate=True)[:2] == ("rowwise", "emulated")
    with pytest.raises(ValueError, match="float8.experts=blockwise cannot run here"):
        f8.choose("blockwise", cpu, emulate=False)
    gpu = torch.device("cuda", 0)  # a float8 GPU: torchao there or not, Triton there
    monkeypatch.setattr(f8, "triton_unavailable", lambda device: None)
    monkeypatch.setattr(f8, "torchao_unavailable", lambda device: None)
    assert f8.choose("auto", gpu, emulate=False)[:2] == ("rowwise", "torchao")
    assert f8.choose("blockwise", gpu, emulate=False)[:2] == ("blockwise", "triton")
    monkeypatch.setattr(f8, "torchao_unavailable", lambda device: "torch._scaled_grouped_mm needs sm90 or later")
    recipe, backend, why = f8.choose("auto", gpu, emulate=False)
    assert (recipe, backend) == ("blockwise", "triton") and "sm90" in why
    f8.resolved.cache_clear()
    with caplog.at_level(logging.INFO, logger="trillion"):
        f8.resolved("auto", True, cpu)
    assert "float8.experts=auto runs the blockwise recipe" in caplog.text


def test_torchao_s_groups_are_padded_to_its_alignment(monkeypatch):
    """torchao's grouped GEMM takes groups of multiples of 16 rows: the padding around it (emulated here by the
    rowwise recipe, which is what torchao computes) gives the unpadded product and gradients."""
    import torchao.prototype.moe_training.fp8_grouped_mm as torchao_mm

    def aligned_rowwise(a, b_t, offs, out_dtype, float8_dtype, pad_token_groups_for_grouped_mm):
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        assert not (sizes % f8.TORCHAO_GROUP_ROWS).any() and b_t.stride(1) == 1  # aligned, column-major
        return f8.Float8GroupedMM("rowwise", emulate=True)(a, b_t, offs)

    monkeypatch.setattr(torchao_mm, "_to_fp8_rowwise_then_scaled_grouped_mm", aligned_rowwise)
    sizes, x, weight, dy, offsets = _data("rows-past-the-groups")
    padded = _run(lambda *a: f8._torchao_rowwise(*a[:3], E4M3), x, weight, dy, offsets)
    plain = _run(f8.Float8GroupedMM("rowwise", emulate=True), x, weight, dy, offsets)
    for mine, want in zip(padded, plain):
        torch.testing.assert_close(mine, want, rtol=1e-6, atol=1e-6)
