"""Triton kernels of the experts' grouped GEMM: out[rows of g] = x[rows of g] @ w[g] and its weight
gradient dw[g] = x[rows of g]^T @ dy[rows of g], in high precision or, with SCALED, in float8 with scales
(kernels/float8_scaling.py): each BLOCK_K step's product, accumulated in fp32, is multiplied by its rows' and
columns' scales and added to an fp32 total, so the scaling is applied every SCALE_BLOCK of the reduction at
most (DeepSeek-V3's promotion to higher precision every 128 elements, arXiv 2412.19437 section 3.3.2).

The rows of `x` are sorted by group; OFFSETS holds each group's end row (int32, a running sum of
the group sizes). No kernel needs the sizes on the host: the launch grid is an upper bound known
from the shapes alone, and each program finds its group on the device from OFFSETS. Rows past the
last group's end get zeros. Dots take input_precision="ieee" (fp32 inputs get fp32 math, not TF32,
as PyTorch's default), float8 dots e4m3 operands; accumulation is in fp32. The row and group counts are
not specialized on (do_not_specialize): they change with the routing and the expert-parallel degree, and would
otherwise recompile when one stops being a multiple of 16; nor are the scales' strides, which follow the dims
in 128-blocks (56 for DeepSeek-V3's 7168, 32 for Mixtral's 4096): every preset runs the reported binaries.
"""

import triton
import triton.language as tl


@triton.jit
def _group_bounds(OFFSETS, g):
    """(first row, end row) of group g."""
    start = tl.load(OFFSETS + g - 1, mask=g > 0, other=0)
    end = tl.load(OFFSETS + g)
    return start, end


@triton.jit
def _tile_group(tile, OFFSETS, n_groups, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """(g, the tiles of the groups before g, the tiles of all groups) for row tile `tile`: group g owns
    cdiv(size_g, BLOCK_M) row tiles, numbered group after group; g == n_groups past them. The groups are
    searched BLOCK_G at a time, so one binary serves every expert count."""
    g = tile * 0  # the number of groups whose tiles all come before `tile`
    first_tile = tile * 0
    done = tile * 0  # the tiles of the groups searched so far
    for g0 in range(0, n_groups, BLOCK_G):
        offs_g = g0 + tl.arange(0, BLOCK_G)
        in_range = offs_g < n_groups
        ends = tl.load(OFFSETS + offs_g, mask=in_range, other=0)
        starts = tl.load(OFFSETS + offs_g - 1, mask=in_range & (offs_g > 0), other=0)
        tiles = tl.where(in_range, tl.cdiv(ends - starts, BLOCK_M), 0)
        past = done + tl.cumsum(tiles, 0)  # one past each group's last tile
        before = in_range & (past <= tile)
        g += tl.sum(before.to(tl.int32), 0)
        first_tile = tl.maximum(first_tile, tl.max(tl.where(before, past, 0), 0))
        done += tl.sum(tiles, 0)
    return g, first_tile, done


@triton.jit(
    do_not_specialize=["rows", "n_groups", "stride_xsm", "stride_xsk", "stride_wsg", "stride_wsk", "stride_wsn"]
)
def grouped_mm_fwd(
    X,
    W,
    OUT,
    OFFSETS,
    X_SCALE,
    W_SCALE,
    rows,
    n_groups,
    K,
    N,
    stride_xm,
    stride_xk,
    stride_wg,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    stride_xsm,
    stride_xsk,
    stride_wsg,
    stride_wsk,
    stride_wsn,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    W_SCALE_COLUMNS: tl.constexpr,
):
    """Grid (cdiv(rows, BLOCK_M) + n_groups, cdiv(N, BLOCK_N)): group g owns cdiv(size_g, BLOCK_M)
    row tiles, numbered group after group; the tiles after the groups' zero the rows past them.
    Both fit the grid, whatever the sizes, since each group adds at most one partial tile.
    SCALED: X and W are float8, x ~ X x X_SCALE[row, k // SCALE_BLOCK] and w[g] ~ W x W_SCALE[g, k //
    SCALE_BLOCK, n // W_SCALE_COLUMNS] (a zero stride: one scale along that dim); BLOCK_K divides SCALE_BLOCK."""
    tile = tl.program_id(0)
    g, first_tile, done = _tile_group(tile, OFFSETS, n_groups, BLOCK_G, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if g < n_groups:
        start, end = _group_bounds(OFFSETS, g)
        offs_m = start + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < end
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = W + g.to(tl.int64) * stride_wg + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        for k in range(0, K, BLOCK_K):
            k_ok = offs_k + k < K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
            if SCALED:
                x_scale = tl.load(
                    X_SCALE + offs_m.to(tl.int64) * stride_xsm + (k // SCALE_BLOCK) * stride_xsk, mask=row_ok, other=0.0
                )
                w_scale = tl.load(
                    W_SCALE
                    + g * stride_wsg
                    + (k // SCALE_BLOCK) * stride_wsk
                    + (offs_n // W_SCALE_COLUMNS) * stride_wsn,
                    mask=offs_n < N,
                    other=0.0,
                )
                acc += tl.dot(a, b) * x_scale[:, None] * w_scale[None, :]
            else:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    else:  # a tile of the rows past the last group, or none left
        used = tl.load(OFFSETS + n_groups - 1)
        offs_m = used + (tile - done) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows
    o_ptrs = OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["n_groups", "stride_xst", "stride_dyst"])
def grouped_mm_dw(
    X,
    DY,
    DW,
    OFFSETS,
    X_SCALE,
    DY_SCALE,
    TILE_START,
    TILE_END,
    GROUP_TILE_END,
    n_groups,
    K,
    N,
    stride_xm,
    stride_xk,
    stride_dym,
    stride_dyn,
    stride_dwg,
    stride_dwk,
    stride_dwn,
    stride_xst,
    stride_dyst,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Grid (cdiv(K, BLOCK_K) * cdiv(N, BLOCK_N), n_groups): one (K, N) tile of dw[g], summed over
    the group's rows; an empty group's tile is zeros. SCALED: X and DY are float8 scaled per (token tile,
    column): group g's tiles are GROUP_TILE_END[g - 1] .. GROUP_TILE_END[g] - 1, tile t the rows TILE_START[t]
    .. TILE_END[t] - 1 with scales X_SCALE[t, k] and DY_SCALE[t, n] (kernels/float8_scaling.py token_tiles).
    Unscaled, the group is one tile."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_k = (tl.program_id(0) // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    if SCALED:
        first = tl.load(GROUP_TILE_END + g - 1, mask=g > 0, other=0)
        last = tl.load(GROUP_TILE_END + g)
    else:
        first, last = g, g + 1
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for t in range(first, last):
        if SCALED:
            start, end = tl.load(TILE_START + t), tl.load(TILE_END + t)
            part = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        else:
            start, end = _group_bounds(OFFSETS, g)
            part = acc
        offs_m = start + tl.arange(0, BLOCK_M)
        x_ptrs = X + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None] * stride_xk
        dy_ptrs = DY + offs_m[:, None].to(tl.int64) * stride_dym + offs_n[None, :] * stride_dyn
        for m in range(start, end, BLOCK_M):
            row_ok = offs_m + (m - start) < end
            xt = tl.load(x_ptrs, mask=row_ok[None, :] & (offs_k[:, None] < K), other=0.0)  # x^T: (BLOCK_K, BLOCK_M)
            dy = tl.load(dy_ptrs, mask=row_ok[:, None] & (offs_n[None, :] < N), other=0.0)
            if SCALED:
                part = tl.dot(xt, dy, part)
            else:
                part = tl.dot(xt, dy, part, input_precision="ieee")
            x_ptrs += BLOCK_M * stride_xm
            dy_ptrs += BLOCK_M * stride_dym
        if SCALED:
            x_scale = tl.load(X_SCALE + t * stride_xst + offs_k, mask=offs_k < K, other=0.0)
            dy_scale = tl.load(DY_SCALE + t * stride_dyst + offs_n, mask=offs_n < N, other=0.0)
            acc += part * x_scale[:, None] * dy_scale[None, :]
        else:
            acc = part
    dw_ptrs = DW + g.to(tl.int64) * stride_dwg + offs_k[:, None] * stride_dwk + offs_n[None, :] * stride_dwn
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))
