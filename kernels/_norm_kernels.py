"""Triton kernels of kernels/norm.py: one program per row forward; backward programs take runs of
rows and write one partial row of the weight and bias gradients each."""

import triton
import triton.language as tl


@triton.jit
def norm_fwd(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, n_cols, eps,
             IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, 0) / n_cols
        xc = tl.where(ok, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def norm_bwd(X, W, DY, DX, DW, DB, MEAN, RSTD, stride_x, stride_dy, stride_dx, n_rows, n_cols, rows_per_program,
             IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each program takes a run of rows, writes their dx, and one partial row of dw and db."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    # Pointers advance row by row, in 64 bits, so huge tensors address correctly.
    x_ptrs = X + first.to(tl.int64) * stride_x + cols
    dy_ptrs = DY + first.to(tl.int64) * stride_dy + cols
    dx_ptrs = DX + first.to(tl.int64) * stride_dx + cols
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        x = tl.load(x_ptrs, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptrs, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            x_hat = x * rstd
        else:
            x_hat = tl.where(ok, (x - tl.load(MEAN + row)) * rstd, 0.0)
        if HAS_WEIGHT:
            w_dy = w * dy
            dw += dy * x_hat
        else:
            w_dy = dy
        if HAS_BIAS:
            db += dy
        c1 = tl.sum(x_hat * w_dy, 0) / n_cols
        if IS_RMS:
            dx = (w_dy - x_hat * c1) * rstd
        else:
            dx = (w_dy - x_hat * c1 - tl.sum(w_dy, 0) / n_cols) * rstd
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=ok)
        x_ptrs += stride_x
        dy_ptrs += stride_dy
        dx_ptrs += stride_dx
    if HAS_WEIGHT:
        tl.store(DW + pid * n_cols + cols, dw, mask=ok)
    if HAS_BIAS:
        tl.store(DB + pid * n_cols + cols, db, mask=ok)
