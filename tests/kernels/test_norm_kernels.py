"""Fused RMSNorm / LayerNorm kernels against torch, forward and every gradient, on CPU through the
Triton interpreter."""

import logging

import pytest
import torch
import torch.nn.functional as F

from trillion.kernels import norm as norm_module
from trillion.kernels.norm import LayerNorm, RMSNorm, layer_norm, rms_norm

# (kind, weight, bias): the affine variants each module can have.
VARIANTS = [
    ("rms", True, False),
    ("rms", False, False),
    ("layer", True, True),
    ("layer", True, False),
    ("layer", False, False),
]


def _torch_norm(kind, x, w, b, eps):
    if kind == "rms":
        return F.rms_norm(x, x.shape[-1:], w, eps)
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def _ours(kind, x, w, b, eps):
    return rms_norm(x, w, eps) if kind == "rms" else layer_norm(x, w, b, eps)


def _value_and_grads(fn, kind, x, w, b, grad, eps, dtype=None):
    leaves = [t if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, w, b)]
    y = fn(kind, *leaves, eps)
    y.backward(grad.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves if t is not None]


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(3, 7, 80), (5, 128), (1, 17)], ids=["3x7x80", "5x128", "1x17"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-w{int(v[1])}-b{int(v[2])}")
def test_matches_torch_forward_and_all_gradients(variant, shape, dtype):
    kind, has_w, has_b = variant
    gen = torch.Generator().manual_seed(0)
    n = shape[-1]
    # Weights stay fp32, as under mixed precision; x's mean is off zero to test the centring.
    x = (torch.randn(shape, generator=gen) + 0.5).to(dtype)
    w = 1 + 0.1 * torch.randn(n, generator=gen) if has_w else None
    b = 0.1 * torch.randn(n, generator=gen) if has_b else None
    grad = torch.randn(shape, generator=gen).to(dtype)
    eps = 1e-5
    ours = _value_and_grads(_ours, kind, x, w, b, grad, eps)
    exact = _value_and_grads(_torch_norm, kind, x, w, b, grad, eps, dtype=torch.float64)
    if dtype == torch.float32:
        for name, mine, truth in zip(("y", "dx", "dw", "db"), ours, exact):
            assert mine.dtype == torch.float32
            assert _max_err(mine, truth) <= 1e-5 * max(1.0, truth.abs().max().item()), name
        return
    # fp16: at most twice torch's own fp16 error (it upcasts inside too) plus one fp16 ulp of the
    # tensor's scale, since the kernel rounds once to fp16 at the end.
    theirs = _value_and_grads(_torch_norm, kind, x, w, b, grad, eps)
    for name, mine, truth, them in zip(("y", "dx", "dw", "db"), ours, exact, theirs):
        assert mine.dtype == them.dtype, name
        bound = 2 * _max_err(them, truth) + torch.finfo(torch.float16).eps * truth.abs().max().item()
        assert _max_err(mine, truth) <= bound, f"{name}: {_max_err(mine, truth):.3g} > {bound:.3g}"


def test_strided_inputs_read_only_their_view():
    # Rows of a wider NaN-filled buffer (row stride != n), and a transposed tensor whose last
    # dim is strided (copied to rows first).
    buf = torch.full((6, 50), float("nan"))
    x = buf[:, 5:45]
    x.copy_(torch.randn(6, 40))
    w = torch.randn(40)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (40,), w, 1e-6))
    xt = torch.randn(40, 6).t()
    torch.testing.assert_close(layer_norm(xt, w, None), F.layer_norm(xt, (40,), w, None))


def test_modules_are_drop_in_replacements_for_torch_modules():
    for ours, theirs in (
        (RMSNorm(48, eps=1e-6), torch.nn.RMSNorm(48, eps=1e-6)),
        (LayerNorm(48, bias=False), torch.nn.LayerNorm(48, bias=False)),
    ):
        with torch.no_grad():
            ours.weight.normal_()
        theirs.load_state_dict(ours.state_dict())
        x = torch.randn(2, 5, 48)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    # eps=None means the dtype's epsilon, as in torch.nn.RMSNorm.
    x = torch.randn(3, 16) * 1e-4
    torch.testing.assert_close(RMSNorm(16)(x), torch.nn.RMSNorm(16)(x), atol=1e-5, rtol=1e-5)


def test_falls_back_to_torch_with_a_logged_reason(monkeypatch, caplog):
    x, w, b = torch.randn(4, 64), torch.randn(64), torch.randn(64)
    monkeypatch.setattr(norm_module, "MAX_FUSED_DIM", 32)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        y = layer_norm(x, w, b)
    assert "rows of 64 exceed 32 elements" in caplog.text
    torch.testing.assert_close(y, F.layer_norm(x, (64,), w, b))
    monkeypatch.setattr(norm_module, "MAX_FUSED_DIM", 4096)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor, no interpreter: Triton cannot run
    with caplog.at_level(logging.WARNING, logger="kernels"):
        y = rms_norm(x, w)
    assert "Triton needs a CUDA or ROCm GPU" in caplog.text
    torch.testing.assert_close(y, F.rms_norm(x, (64,), w, torch.finfo(x.dtype).eps))


def test_norm_custom_op_passes_opcheck():
    # Schema, fake implementation, autograd registration, AOT dispatch: what torch.compile needs.
    x = torch.randn(3, 5, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    torch.library.opcheck(torch.ops.trillion.norm_fwd.default, (x, w, b, 1e-5, False))
