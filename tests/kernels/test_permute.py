"""The fused token permutation (kernels/permute.py) on CPU through the Triton interpreter against the torch
reference it replaces (models/expert_rows.py's indexing and sum): in float32 bit for bit, forward and backward,
with dropped slots (a capacity's sentinel expert, sorted last, whose rows the experts leave zero): the permuted
rows, the combined output, the tokens' gradient, the routed rows' gradient. float16 to fp16 rounding. Dims are
multiples of 64, where torch's CPU sum over the top-k slots adds them in order (its vectorised loop over the dim;
past it, the tail groups the slots in fours)."""

import pytest
import torch

from trillion.kernels.permute import combine, inverse_order, permute

# (tokens, top_k, dim, experts): top_k up to DeepSeek-V3's 8, a dim spanning several of the interpreter's 16; top_k
# 3 and 6 (DeepSeek-V2-Lite's, Moonlight's) are not powers of two: the backward pads its slots past top_k
CASES = {
    "top2": (15, 2, 64, 4),
    "top8": (6, 8, 128, 16),
    "top1": (7, 1, 64, 3),
    "top6": (6, 6, 32, 8),
    "top3": (9, 3, 32, 5),
}


def _routing(tokens, top_k, experts, gen):
    """Slots' experts with drops: expert `experts` is the sentinel a dropped slot takes (sorted last)."""
    slots = torch.stack([torch.randperm(experts + 1, generator=gen)[:top_k] for _ in range(tokens)]).flatten()
    order = slots.argsort(stable=True)
    return order, inverse_order(order), int((slots == experts).sum())


def _run(impl, x, order, positions, top_k, routed_grad_rows, out_grad, dropped):
    x = x.clone().requires_grad_()
    rows = permute(x, order, positions, top_k, impl)
    # the experts' stand-in: a leaf, its rows of dropped slots zero as the experts leave them
    kept = torch.arange(rows.shape[0]) < rows.shape[0] - dropped
    routed = (rows.detach() * routed_grad_rows * kept.unsqueeze(1)).requires_grad_()
    out = combine(routed, positions.view(-1, top_k), impl)
    out.backward(out_grad)
    rows.backward(routed.grad)
    return {"rows": rows.detach(), "out": out.detach(), "dx": x.grad, "drouted": routed.grad}


@pytest.mark.parametrize("case, dtype", [(case, torch.float32) for case in CASES] + [("top8", torch.float16)], ids=str)
def test_the_fused_permutation_equals_torch_s(case, dtype):
    tokens, top_k, dim, experts = CASES[case]
    gen = torch.Generator().manual_seed(0)
    order, positions, dropped = _routing(tokens, top_k, experts, gen)
    assert dropped > 0
    x = (torch.randn(tokens, dim, generator=gen) * torch.logspace(-3, 3, dim)).to(dtype)
    scale_rows = torch.randn(tokens * top_k, 1, generator=gen).to(dtype)
    out_grad = torch.randn(tokens, dim, generator=gen).to(dtype)
    args = (x, order, positions, top_k, scale_rows, out_grad, dropped)
    fused, reference = _run("triton", *args), _run("torch", *args)
    for name in ("rows", "out", "dx", "drouted"):
        if dtype == torch.float32:
            assert torch.equal(fused[name], reference[name]), name
        else:
            torch.testing.assert_close(fused[name], reference[name], rtol=1e-3, atol=1e-3, msg=name)
    assert fused["drouted"][-dropped:].abs().sum() > 0  # dropped rows too


def test_auto_is_torch_on_a_cpu_and_triton_is_the_fused_kernel(monkeypatch):
    import trillion.kernels.permute as module

    calls = []
    monkeypatch.setattr(module, "_launch", lambda kernel, *a, **k: calls.append(kernel))
    x, order = torch.randn(4, 16), torch.arange(8)
    positions = inverse_order(order)
    permute(x, order, positions, 2, "auto")
    combine(torch.randn(8, 16), positions.view(4, 2), "auto")
    assert calls == []  # CPU: the reference is the plan
    permute(x, order, positions, 2, "triton")
    combine(torch.randn(8, 16), positions.view(4, 2), "triton")
    assert calls == ["permute_fwd", "combine_fwd"]


def test_an_moe_layer_with_the_fused_permutation_equals_its_torch_permutation():
    """models/moe.py with kernels.permutation=triton and =torch, a capacity that drops slots: the same output and
    experts' gradients in fp32, bit for bit (dim 64: torch's slot sum adds in order there); the input's gradient,
    which takes the routing weights' through the router, to fp32 rounding."""
    import dataclasses

    from trillion.models.moe import MoE
    from trillion.models.presets import get_preset

    spec = dataclasses.replace(get_preset("debug-moe").moe, capacity_factor=1.0, experts_impl="loop")
    torch.manual_seed(0)
    layer = MoE(64, spec)
    for weight in layer.experts.parameters():
        torch.nn.init.normal_(weight, std=0.1)
    x = torch.randn(2, 12, 64)
    results = []
    for impl in ("torch", "triton"):
        layer.moe = dataclasses.replace(spec, permute_impl=impl)
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.square().sum().backward()
        results.append((out.detach(), layer.experts.w2.grad.clone(), inputs.grad))
        layer.zero_grad()
    (out, w2, dx), (fused_out, fused_w2, fused_dx) = results
    assert torch.equal(fused_out, out) and torch.equal(fused_w2, w2)
    torch.testing.assert_close(fused_dx, dx, rtol=1e-5, atol=1e-6)
