"""The float8 dispatch's wire format (parallel/float8_dispatch.py): a row's float8 bytes and its float32 scales in
one byte tensor, which comes back as the rows the experts' own quantisation gives (so their second quantisation
changes nothing), at d + 4 x ceil(d / 128) bytes a row blockwise and d + 4 rowwise; the combine's gradient sent
back in it (float8.combine_gradient), counted at its post. Its all-to-all under expert parallelism is tested against
one process in tests/float8/test_experts_parity.py."""

import pytest
import torch

from tests.helpers.loopback import Loopback
from trillion.kernels import float8_scaling as scaling
from trillion.parallel.float8_dispatch import Float8Wire, from_wire, to_wire, wire_bytes_per_row

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("recipe", scaling.RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_come_back_as_the_experts_quantise_them(recipe, dtype):
    gen = torch.Generator().manual_seed(0)
    rows = (torch.randn(37, 300, generator=gen) * torch.logspace(-4, 4, 300)).to(dtype)
    wire = to_wire(rows, recipe, E4M3)
    assert wire.dtype == torch.uint8 and wire.shape == (37, wire_bytes_per_row(300, recipe))
    back = from_wire(wire, 300, recipe, E4M3, dtype)
    blocks = scaling.activation_blocks(recipe)
    # an independent check of the values: each block's elements are float8 values times one power of two
    expected = scaling.dequantize_blocks(*scaling.quantize_blocks(rows, *blocks, E4M3), *blocks, dtype)
    assert back.dtype == dtype and torch.equal(back, expected)
    assert not torch.equal(back, rows)  # it is float8 on the wire
    again = scaling.dequantize_blocks(*scaling.quantize_blocks(back, *blocks, E4M3), *blocks, dtype)
    assert torch.equal(again, back)  # the experts' quantisation of what arrives changes nothing


def test_bytes_per_row():
    assert wire_bytes_per_row(7168, "blockwise") == 7168 + 4 * 56  # half bf16's 14336, plus 1.6%
    assert wire_bytes_per_row(7168, "rowwise") == 7168 + 4
    assert wire_bytes_per_row(200, "blockwise") == 200 + 4 * 2  # a short last tile has its own scale


def test_the_combines_gradient_travels_back_in_float8_and_is_counted_so():
    """float8.combine_gradient: the combine's reverse carries the gradient in the dispatch's wire form, so the
    experts get it as their own quantisation gives it, and its bytes, counted where it is posted, are the wire's:
    about half the forward combine's in bf16 (here a quarter of fp32's)."""
    exchange, wire = Loopback(members=2), Float8Wire("blockwise", emulate=True)  # member 1 on another node
    out = torch.randn(6, 256, requires_grad=True)
    back = exchange.rows(out, [3, 3], [3, 3], "combine", back_wire=wire).wait()
    grad = torch.randn(6, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 256)
    back.backward(grad)
    blocks = scaling.activation_blocks("blockwise")
    expected = scaling.dequantize_blocks(*scaling.quantize_blocks(grad, *blocks, E4M3), *blocks, torch.float32)
    assert torch.equal(out.grad, expected)
    assert not torch.equal(out.grad, grad)
    sent = exchange.traffic.sent_bytes
    assert sent["combine gradient", "inter-node"] == 3 * wire_bytes_per_row(256, "blockwise") == 3 * (256 + 8)
    assert sent["combine", "inter-node"] == 3 * 256 * 4  # the forward's fp32 rows to the other member
