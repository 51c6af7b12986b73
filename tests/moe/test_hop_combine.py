"""A dispatch hop's combine (parallel/ep_routing.py): each row's returns summed as the gathered reference sums them,
bit for bit, with the gradient autograd gives the reference, and without the reference's (rows, top_k, dim) gather:
the slot-by-slot sum (torch) and the fused combine a GPU runs (triton, here through the interpreter)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trillion.kernels.permute import fused
from trillion.parallel.ep_routing import Hop, combine, place

ROWS, TOP_K, MEMBERS, DIM = 48, 6, 4, 64


def _placement(capacity: int = 0):
    ids = torch.randint(0, 16, (ROWS, TOP_K), generator=torch.Generator().manual_seed(3))
    ids[::5, -2:] = -1  # slots routed elsewhere by an earlier hop
    ids[::7] = -1  # rows with none here
    hop = Hop.plan(ids, lambda e: e // 4, MEMBERS)
    send = [capacity] * MEMBERS if capacity else hop.counts()[:, 0].tolist()
    return place(hop, send, capacity)


def _reference(returned, placement):
    padded = torch.cat([returned, returned.new_zeros(1, returned.shape[1])])
    return padded[placement.combine_index].sum(dim=1)


@pytest.mark.parametrize(
    ("impl", "dtype"), [("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.float32)], ids=str
)
@pytest.mark.parametrize("capacity", [0, 7], ids=["dropless", "capacity"])
def test_sums_and_gradients_equal_the_gathered_reference_bit_for_bit(impl, dtype, capacity):
    placement = _placement(capacity)
    returned = torch.randn(placement.total, DIM, dtype=dtype, requires_grad=True)
    grad = torch.randn(ROWS, DIM, dtype=dtype)
    expected = _reference(returned, placement)
    (expected_grad,) = torch.autograd.grad(expected, returned, grad)
    assert fused(impl, returned) == (impl == "triton")  # the kernel runs (the interpreter here), not the fallback
    out = combine(returned, placement, impl)
    (out_grad,) = torch.autograd.grad(out, returned, grad)
    assert torch.equal(out, expected) and torch.equal(out_grad, expected_grad)
    assert placement.combine_index.lt(placement.total).any(dim=1).sum() < ROWS  # some rows got nothing back


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


def test_no_buffer_outgrows_one_float32_row_per_row():
    """The reference gathers top_k rows for each row (bf16: 2 x top_k x dim bytes a row); the combine's largest
    buffer is its float32 accumulator, 4 x dim a row, and backward's the send slots' gradient."""
    placement = _placement()
    returned = torch.randn(placement.total, DIM, dtype=torch.bfloat16, requires_grad=True)
    with _Largest() as measured:
        combine(returned, placement, "torch").sum().backward()
    assert measured.largest == max(4 * ROWS * DIM, 2 * placement.total * DIM)
    with _Largest() as reference:
        _reference(returned, placement).sum().backward()
    assert reference.largest == 2 * ROWS * TOP_K * DIM
