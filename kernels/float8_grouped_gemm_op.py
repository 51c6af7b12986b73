"""The Triton float8 grouped GEMM as PyTorch custom ops (no autograd of their own: the float8 grouped product,
kernels/float8_grouped_gemm.py, calls them for its forward and both gradients):

    out = float8_mm(x, x_scale, weight, w_scale, offsets, w_scale_columns, out_dtype)
    dw = float8_mm_dw(x, x_scale, dy, dy_scale, offsets, tile_start, tile_end, group_tile_end, out_dtype)

Operands float8 (e4m3fn, or e4m3fnuz on gfx942) with float32 scales as kernels/float8_scaling.py makes them;
the kernels are the grouped GEMM's own with SCALED set (kernels/_grouped_gemm_kernels.py), fp32
accumulation, rows past the last group zero, no host read of the group sizes.
"""

from __future__ import annotations

import torch

from trillion.kernels.float8_scaling import TokenTiles
from trillion.kernels.grouped_gemm_op import _launch


@torch.library.custom_op("trillion::float8_grouped_mm", mutates_args=())
def float8_mm(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    w_scale_columns: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out[rows of g] = (x x its scales)[rows of g] @ (weight[g] x its scales), weight (groups, K, N) any strides."""
    out = torch.empty(x.shape[0], weight.shape[2], device=x.device, dtype=out_dtype)
    if out.numel() == 0:
        return out
    return _launch("mm8", x, weight, offsets, out, (x_scale, w_scale, w_scale_columns))


@float8_mm.register_fake
def _(x, x_scale, weight, w_scale, offsets, w_scale_columns, out_dtype):
    return torch.empty(x.shape[0], weight.shape[2], device=x.device, dtype=out_dtype)


@torch.library.custom_op("trillion::float8_grouped_mm_dw", mutates_args=())
def float8_mm_dw(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    dy: torch.Tensor,
    dy_scale: torch.Tensor,
    offsets: torch.Tensor,
    tile_start: torch.Tensor,
    tile_end: torch.Tensor,
    group_tile_end: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dw[g] = sum over the token tiles t of group g of (x^T dy over t's rows) x x_scale[t] x dy_scale[t]."""
    dw = torch.empty(offsets.shape[0], x.shape[1], dy.shape[1], device=x.device, dtype=out_dtype)
    if dw.numel() == 0:
        return dw
    tiles = TokenTiles(None, tile_start, tile_end, group_tile_end)
    return _launch("dw8", x, dy, offsets, dw, (x_scale, dy_scale, tiles))


@float8_mm_dw.register_fake
def _(x, x_scale, dy, dy_scale, offsets, tile_start, tile_end, group_tile_end, out_dtype):
    return torch.empty(offsets.shape[0], x.shape[1], dy.shape[1], device=x.device, dtype=out_dtype)
