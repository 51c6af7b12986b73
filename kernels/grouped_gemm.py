"""One entry point for the grouped matrix product of the routed experts, so the model never names a
backend: rows of `x` sorted by group, group g's rows times `weight[g]`.

Backends: `torch` is `torch._grouped_mm`, one kernel for all groups, which needs no host sync; it runs
on CUDA from sm90 (bf16) and on CPU in float32/16 when every row is a multiple of 16 bytes, with a
contiguous incoming gradient (both measured on torch 2.13; `_ContiguousGrad` supplies the second).
`triton` is the project's own kernel (kernels/grouped_gemm_op.py), also without a host sync, for the
GPUs torch's does not take (ROCm, A100); it falls back to `loop`, saying why once, where Triton
cannot run. `loop` is the reference and the fallback: one matmul per group, which reads the group
sizes on the host. `auto` takes `torch` where it runs, else `triton` on a CUDA or ROCm GPU, else
`loop`, logging once on a GPU why it did not take `torch`.
"""

import torch

from trillion.kernels._triton_setup import has_triton, log_once, unavailable_reason, use_triton

GROUPED_GEMM_IMPLS = ("auto", "torch", "triton", "loop")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if has_triton():
    from trillion.kernels import grouped_gemm_op
    from trillion.kernels.grouped_gemm_op import triton_grouped_mm


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x (rows, k) sorted by group, weight (groups, k, n), offsets (groups,) int32: the end row of each
    group (a running sum of the group sizes; the last may be short of `rows`, the rest are zeros)."""
    impl = _choose(impl, x, weight)
    if impl == "loop":
        return loop_grouped_mm(x, weight, offsets)
    if impl == "triton":
        return triton_grouped_mm(x, weight, offsets)
    # torch._grouped_mm leaves rows past the last group unwritten (garbage, in forward and backward): the
    # last group runs them, and they are zeroed after, so nothing reads memory it never wrote
    all_rows = torch.cat([offsets[:-1], offsets.new_full((1,), x.shape[0])])
    out = _ContiguousGrad.apply(torch._grouped_mm(x, weight, offs=all_rows))
    past_the_groups = torch.arange(x.shape[0], device=x.device) >= offsets[-1]
    return out.masked_fill(past_the_groups.unsqueeze(1), 0)


def _choose(impl: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    """The backend that runs `impl` on these operands."""
    if impl in ("torch", "loop"):
        return impl
    if impl == "triton":
        return (
            "triton" if use_triton("kernels.grouped_gemm=triton", x.device.type, _triton_dtype(x, weight)) else "loop"
        )
    why_not_torch = grouped_mm_unavailable(x, weight)
    if why_not_torch is None:
        return "torch"
    if x.device.type != "cuda":  # on CPU (and meta) the loop is the plan, not a fallback: nothing to say
        return "loop"
    if use_triton("kernels.grouped_gemm=auto", "cuda", _triton_dtype(x, weight)):
        log_once("kernels", f"kernels.grouped_gemm=auto runs the Triton grouped GEMM: {why_not_torch}")
        return "triton"
    log_once("kernels", f"kernels.grouped_gemm=auto runs one matmul per group: {why_not_torch}")
    return "loop"


def backend_unavailable(impl: str, x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why kernels.grouped_gemm=`impl` cannot run on these operands (None when it can); auto and loop always run."""
    if impl == "torch":
        return grouped_mm_unavailable(x, weight)
    if impl == "triton":
        return unavailable_reason(x.device) or _triton_dtype(x, weight) or None
    return None


def _triton_dtype(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Why the Triton grouped GEMM cannot take these dtypes ("" when it can)."""
    if x.dtype != weight.dtype or x.dtype not in _TRITON_DTYPES:
        return f"the Triton grouped GEMM takes float16, bfloat16 or float32, not {x.dtype} x {weight.dtype}"
    return ""


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """(groups, k, n): each group's x^T @ dy over its rows (x (rows, k), dy (rows, n)), what grouped_mm's weight
    gradient is; rows past the last group take no part. Run by the backend `impl` chooses for (x, dy)."""
    impl = _choose(impl, x, dy.unsqueeze(0))
    if impl == "triton":
        return grouped_gemm_op._dw_op(x, dy, offsets)
    if impl == "torch":
        return torch._grouped_mm(x.t(), dy, offs=offsets)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.stack([x[start:end].t() @ dy[start:end] for start, end in zip(starts, ends)])


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
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # its meta function, which compile traces with
        return "torch._grouped_mm under torch.compile takes bfloat16 only (its meta function, torch 2.13)"
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
