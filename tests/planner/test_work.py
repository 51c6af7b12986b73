"""The planner's count of element-wise work against every aten op of a real block, forward and backward."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trillion.models.presets import get_preset
from trillion.models.transformer import TransformerBlock, rope_cache
from trillion.parallel.planner.work import BACKWARD_ELEMENTWISE, elementwise_per_token

# GEMMs and attention are timed separately; views and allocations move no data
_NOT_ELEMENTWISE = {
    "mm",
    "addmm",
    "bmm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "expand",
    "detach",
    "permute",
    "unsqueeze",
    "squeeze",
    "split",
    "slice",
    "select",
    "alias",
    "as_strided",
    "empty",
    "empty_like",
    "ones_like",
    "zeros_like",
    "new_empty",
    "split_with_sizes",
    "unbind",
    "_reshape_alias",
}


class _ElementCount(TorchDispatchMode):
    """Elements read and written by the element-wise ops that run under it."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ not in _NOT_ELEMENTWISE:
            self.elements += sum(t.numel() for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("preset", ["debug", "debug-gpt"])
def test_eager_elementwise_count_matches_the_block(preset):
    args = dataclasses.replace(get_preset(preset), attention_impl="sdpa")
    torch.manual_seed(0)
    block = TransformerBlock(args)
    batch, seq = 2, 128
    x = torch.randn(batch, seq, args.dim, requires_grad=True)
    rope = rope_cache(args.head_dim, seq, args.rope_theta) if args.positions == "rope" else None
    with _ElementCount() as forward:
        y = block(x, rope)
    with _ElementCount() as backward:
        y.backward(torch.randn_like(y))
    planned = elementwise_per_token(args, tp=1, compiled=False)
    assert forward.elements / (batch * seq) == pytest.approx(planned, rel=0.1)
    assert backward.elements / forward.elements == pytest.approx(BACKWARD_ELEMENTWISE, rel=0.15)
    assert elementwise_per_token(args, tp=1, compiled=True) < planned
