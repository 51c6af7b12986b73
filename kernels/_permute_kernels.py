"""Triton kernels of the fused token permutation around the routed experts (kernels/permute.py): a token's row
copied to its TOP_K slots in expert order (forward and backward), and the experts' rows (already weighted by the
router inside the experts: models/expert_rows.py) summed back into their token, whose backward is the permutation's
forward; each one pass over the rows with no intermediate tensor.

POSITIONS (tokens x TOP_K, int64) holds where slot t * TOP_K + j sits in expert order. The sums follow
torch's reference (kernels/permute.py) term by term, so that float32 results are bitwise equal to it: a
token's gradient adds its slots' in the order of their positions (torch's index backward accumulates in index
order), the combine adds slot 0, 1, ... with fp32 accumulation where torch's reductions accumulate in fp32.
"""

import triton
import triton.language as tl


@triton.jit
def permute_fwd(X, POSITIONS, OUT, D, stride_x, stride_o, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (tokens, cdiv(D, BLOCK_D)): out[positions[t, j]] = x[t] for each j."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    row = tl.load(X + t.to(tl.int64) * stride_x + offs, mask=ok)
    for j in tl.static_range(TOP_K):
        position = tl.load(POSITIONS + t * TOP_K + j)
        tl.store(OUT + position * stride_o + offs, row, mask=ok)


@triton.jit
def permute_bwd(
    DOUT, POSITIONS, DX, D, stride_do, stride_dx, TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Grid (tokens, cdiv(D, BLOCK_D)): dx[t] = the sum of dout over t's positions, smallest first, in dx's
    dtype. SLOTS: TOP_K rounded up to a power of two."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    slots = tl.arange(0, SLOTS)
    past = tl.full([SLOTS], 0x7FFFFFFFFFFFFFFF, tl.int64)  # beyond every position
    positions = tl.load(POSITIONS + t * TOP_K + slots, mask=slots < TOP_K, other=0x7FFFFFFFFFFFFFFF)
    acc = tl.zeros([BLOCK_D], dtype=DX.dtype.element_ty)
    previous = -1
    for _ in tl.static_range(TOP_K):
        position = tl.min(tl.where(positions > previous, positions, past), 0)
        acc += tl.load(DOUT + position * stride_do + offs, mask=ok, other=0.0)
        previous = position
    tl.store(DX + t.to(tl.int64) * stride_dx + offs, acc, mask=ok)


@triton.jit
def combine_fwd(ROUTED, POSITIONS, OUT, D, stride_r, stride_o, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (tokens, cdiv(D, BLOCK_D)): out[t] = the sum over j of routed[positions[t, j]], accumulated in fp32 in
    slot order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        position = tl.load(POSITIONS + t * TOP_K + j)
        acc += tl.load(ROUTED + position * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + t.to(tl.int64) * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=ok)
