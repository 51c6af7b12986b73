"""One entry point for the grouped matrix product of the routed experts, so the model never names a
backend: rows of `x` sorted by group, group g's rows times `weight[g]`.

Backends: `torch` is `torch._grouped_mm`, one kernel for all groups, which needs no host sync; it runs
on CUDA from sm90 (bf16) and on CPU in float32/16 when every row is a multiple of 16 bytes, with a
contiguous incoming gradient (both measured on torch 2.13; `_ContiguousGrad` supplies the second).
`loop` is the reference and the fallback: one matmul per group, which reads the group sizes on the
host. `auto` takes `torch` where it runs, else `loop`.
"""

import logging

import torch

GROUPED_GEMM_IMPLS = ("auto", "torch", "loop")

log = logging.getLogger("trillion")


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (rows, k) sorted by group, weight (groups, k, n), offsets (groups,) int32: the end row of each
    group (a running sum of the group sizes; the last may be short of `rows`, the rest are zeros)."""
    if impl == "loop" or (impl == "auto" and grouped_mm_unavailable(x, weight) is not None):
        return loop_grouped_mm(x, weight, offsets)
    # torch._grouped_mm leaves rows past the last group unwritten (garbage, in forward and backward): the
    # last group runs them, and they are zeroed after, so nothing reads memory it never wrote
    all_rows = torch.cat([offsets[:-1], offsets.new_full((1,), x.shape[0])])
    out = _ContiguousGrad.apply(torch._grouped_mm(x, weight, offs=all_rows))
    past_the_groups = torch.arange(x.shape[0], device=x.device) >= offsets[-1]
    return out.masked_fill(past_the_groups.unsqueeze(1), 0)


def loop_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    parts = [x[start:end] @ weight[group] for group, (start, end) in enumerate(zip(starts, ends))]
    rest = x.new_zeros(x.shape[0] - ends[-1], weight.shape[-1])
    return torch.cat([*parts, rest])


def grouped_mm_unavailable(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why torch._grouped_mm cannot take these operands here, or None when it can."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm takes float32, bfloat16 or float16, not {x.dtype}"
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (9, 0) or x.dtype != torch.bfloat16:
            return "torch._grouped_mm on CUDA needs sm90 or later and bfloat16"
        return None
    if x.device.type != "cpu":
        return f"torch._grouped_mm has no {x.device.type} kernel"
    row_bytes = [size * x.element_size() for size in (x.shape[-1], weight.shape[-1])]
    if any(size % 16 for size in row_bytes):
        return f"torch._grouped_mm on CPU needs rows of a multiple of 16 bytes (these are {row_bytes})"
    return None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (a sum's expanded gradient is not one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()
