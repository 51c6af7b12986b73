"""Triton kernels of kernels/norm.py, on tiles of BLOCK_M rows x BLOCK_N (>= n) columns: wide rows
take one row per tile, narrow rows several, so that a program always has enough work."""

import triton
import triton.language as tl


@triton.jit
def norm_fwd(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_rows, n_cols, eps,
             IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, 1) / n_cols
        xc = tl.where(ok, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_ok)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def norm_bwd(X, W, DY, DX, DW, DB, MEAN, RSTD, stride_x, stride_dy, stride_dx, n_rows, n_cols, rows_per_program,
             IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each program takes a run of rows (a multiple of BLOCK_M), writes their dx, and one partial
    row of dw and db."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    for start in range(first, tl.minimum(first + rows_per_program, n_rows), BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None].to(tl.int64)
        x = tl.load(X + offs * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        if IS_RMS:
            x_hat = x * rstd
        else:
            x_hat = tl.where(ok, (x - tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]) * rstd, 0.0)
        if HAS_WEIGHT:
            w_dy = w * dy
            dw += dy * x_hat
        else:
            w_dy = dy
        if HAS_BIAS:
            db += dy
        c1 = tl.sum(x_hat * w_dy, 1)[:, None] / n_cols
        if IS_RMS:
            dx = (w_dy - x_hat * c1) * rstd
        else:
            dx = (w_dy - x_hat * c1 - tl.sum(w_dy, 1)[:, None] / n_cols) * rstd
        tl.store(DX + offs * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
    if HAS_WEIGHT:
        tl.store(DW + pid * n_cols + cols, tl.sum(dw, 0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB + pid * n_cols + cols, tl.sum(db, 0), mask=col_ok)
