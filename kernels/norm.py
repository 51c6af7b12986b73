"""Fused RMSNorm and LayerNorm in Triton: one read of x forward, one of x and dy backward.

    y = rms_norm(x, weight, eps)            x * rsqrt(mean(x^2) + eps) * weight
    y = layer_norm(x, weight, bias, eps)    (x - mean) * rsqrt(var + eps) * weight + bias

Both normalize the last dimension, compute in fp32 whatever the input dtype, and return x's
dtype. The modules RMSNorm and LayerNorm are drop-in subclasses of torch.nn's (same parameters,
same state dict), so switching --kernels.norm changes no checkpoint. Where Triton cannot run, or
a row is too long to hold in one block, the functions fall back to torch.nn.functional and log
why once.

Weight and bias gradients are summed per program into an fp32 buffer, then over programs with
torch: deterministic, no atomics.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import triton
from torch import nn

from trillion.kernels._triton_setup import interpreting, next_power_of_2, use_triton

__all__ = ["rms_norm", "layer_norm", "RMSNorm", "LayerNorm", "MAX_FUSED_DIM"]

# A row lives in registers, fp32, in one program. The backward holds x, dy and the dw/db partial
# sums of its columns: rows of 12288 (GPT-175B) spill on sm80/sm90 and rows of 25600 (GPT-1T) on
# every target (experiments/kernels/RESOURCES.md), so wider rows than this take torch's kernels.
MAX_FUSED_DIM = 8192


def kernel_module():
    # Imported on first use: Triton decides between compiling and interpreting when a kernel is
    # defined, and TRITON_INTERPRET may be set after start-up but before the first call.
    from trillion.kernels import _norm_kernels

    return _norm_kernels


def _tile(n_rows: int, n_cols: int, interpreter: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a whole row per tile, and rows stacked up to a tile of 4096
    elements on GPUs (16384 in the interpreter, whose cost is per operation, not per element)."""
    block_n = next_power_of_2(n_cols)
    tile = 16384 if interpreter else 4096
    block_m = max(1, min(tile // block_n, next_power_of_2(n_rows)))
    return block_m, block_n, min(16, max(1, block_m * block_n // 512))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, n) with unit column stride; a copy only when the last dim is strided."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _device_context(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def kernel_args(
    kernel: str,
    x2,
    weight,
    bias,
    out,
    mean,
    rstd,
    eps: float,
    rms: bool,
    *,
    grad=None,
    dw_part=None,
    db_part=None,
    rows_per_program: int = 0,
    interpreter: bool | None = None,
) -> tuple[tuple, dict]:
    """(positional arguments, constexprs) of one launch of `kernel` ("fwd" or "bwd") on rows x2; for
    "bwd", `out` is dx, `grad` dy, and `bias` only says whether there is one. The launchers below and
    the ahead-of-time report (kernels/report.py) both build their launches here, so the report
    compiles what runs. The tile is the interpreter's when `interpreter` (default: whether Triton
    interprets here), else a GPU's."""
    rows, n = x2.shape
    block_m, block_n, warps = _tile(rows, n, interpreting() if interpreter is None else interpreter)
    meta = dict(
        IS_RMS=rms,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    if kernel == "fwd":
        return (x2, weight, bias, out, mean, rstd, x2.stride(0), n, rows, n, eps), meta
    return (
        x2,
        weight,
        grad,
        out,
        dw_part,
        db_part,
        mean,
        rstd,
        x2.stride(0),
        grad.stride(0),
        n,
        rows,
        n,
        rows_per_program,
    ), meta


def _forward(x, weight, bias, eps: float, rms: bool):
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    mean = rstd.new_empty(0 if rms else x.shape[:-1])
    if x2.shape[0] == 0:
        return y, mean, rstd
    args, meta = kernel_args("fwd", x2, weight, bias, y, mean, rstd, eps, rms)
    with _device_context(x):
        kernel_module().norm_fwd[(triton.cdiv(x2.shape[0], meta["BLOCK_M"]),)](*args, **meta)
    return y, mean, rstd


def _backward(grad_y, x, weight, mean, rstd, has_bias: bool, rms: bool):
    n = x.shape[-1]
    x2, dy2 = _rows(x), _rows(grad_y)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    block_m = _tile(rows, n, interpreting())[0]
    # Enough programs to fill the GPU, each with a run of whole tiles; fewer partial sums to add.
    programs = triton.cdiv(rows, block_m)
    if x.is_cuda:
        programs = min(programs, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
    rows_per_program = triton.cdiv(triton.cdiv(rows, max(programs, 1)), block_m) * block_m
    programs = triton.cdiv(rows, rows_per_program) if rows else 0
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if weight is not None else None
    db_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if has_bias else None
    if rows:
        args, meta = kernel_args(
            "bwd",
            x2,
            weight,
            db_part,
            dx,
            mean,
            rstd,
            0.0,
            rms,
            grad=dy2,
            dw_part=dw_part,
            db_part=db_part,
            rows_per_program=rows_per_program,
        )
        with _device_context(x):
            kernel_module().norm_bwd[(programs,)](*args, **meta)
    param_dtype = weight.dtype if weight is not None else x.dtype
    dw = dw_part.sum(0).to(param_dtype) if dw_part is not None else x.new_empty(0)
    db = db_part.sum(0).to(param_dtype) if db_part is not None else x.new_empty(0)
    return dx, dw, db


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("trillion::norm_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd); mean is empty for RMSNorm."""
    return _forward(x, weight, bias, eps, rms)


@_fwd_op.register_fake
def _(x, weight, bias, eps, rms):
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), rstd.new_empty(0 if rms else x.shape[:-1]), rstd


@torch.library.custom_op("trillion::norm_bwd", mutates_args=())
def _bwd_op(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); the last two are empty when there is no weight or bias."""
    return _backward(grad_y, x, weight, mean, rstd, has_bias, rms)


@_bwd_op.register_fake
def _(grad_y, x, weight, mean, rstd, has_bias, rms):
    param_dtype = weight.dtype if weight is not None else x.dtype
    n = x.shape[-1]
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty(n if weight is not None else 0, dtype=param_dtype),
        x.new_empty(n if has_bias else 0, dtype=param_dtype),
    )


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, rms = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias, ctx.rms = bias is not None, rms
    ctx.mark_non_differentiable(mean, rstd)


def _autograd_backward(ctx, grad_y, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _bwd_op(grad_y, x, weight, mean, rstd, ctx.has_bias, ctx.rms)
    return dx, dw if weight is not None else None, db if ctx.has_bias else None, None, None


_fwd_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _register_dtensor_sharding() -> None:
    """Rows are independent: x sharded on any dim but the last (sequence parallelism shards the
    sequence) gives y, mean and rstd sharded alike, with replicated weight and bias, whose
    gradients come back as partial sums."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def param(t, p):
        return None if t is None else p

    @register_sharding(torch.ops.trillion.norm_fwd.default)
    def _fwd_sharding(x, weight, bias, eps, rms):
        r = Replicate()
        rules = [([r, r, r], [r, param(weight, r), param(bias, r), None, None])]
        for dim in range(x.ndim - 1):
            s = Shard(dim)
            rules.append(([s, r if rms else s, s], [s, param(weight, r), param(bias, r), None, None]))
        return rules

    @register_sharding(torch.ops.trillion.norm_bwd.default)
    def _bwd_sharding(grad_y, x, weight, mean, rstd, has_bias, rms):
        r = Replicate()
        rules = [([r, r, r], [r, r, param(weight, r), r, r, None, None])]
        for dim in range(x.ndim - 1):
            s = Shard(dim)
            grads = [Partial() if weight is not None else r, Partial() if has_bias else r]
            rules.append(([s, *grads], [s, s, param(weight, r), r if rms else s, s, None, None]))
        return rules


_register_dtensor_sharding()


# ----------------------------------------------------------------------------- public API
def _use_triton(x: torch.Tensor, what: str) -> bool:
    too_long = x.shape[-1] > MAX_FUSED_DIM
    return use_triton(what, x.device.type, f"rows of {x.shape[-1]} exceed {MAX_FUSED_DIM} elements" if too_long else "")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """RMSNorm over the last dim; eps=None means torch.finfo(x.dtype).eps, as torch.nn.RMSNorm."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    if not _use_triton(x, "kernels.norm=triton (rms_norm)"):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return _fwd_op(x, weight, None, float(eps), True)[0]


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim."""
    if not _use_triton(x, "kernels.norm=triton (layer_norm)"):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return _fwd_op(x, weight, bias, float(eps), False)[0]


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm over one (last) dim, computed by the fused kernel."""

    def __init__(self, dim: int, eps: float | None = None, **kwargs):
        super().__init__(dim, eps=eps, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """torch.nn.LayerNorm over one (last) dim, computed by the fused kernel."""

    def __init__(self, dim: int, eps: float = 1e-5, **kwargs):
        super().__init__(dim, eps=eps, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
