"""Float8 quantisation of the routed experts' GEMM operands, in plain PyTorch: the reference every float8
path is checked against, and the casts the Triton float8 grouped GEMM consumes (kernels/float8_grouped_gemm.py).

A tensor is cut into scale blocks; each block's values are divided by one scale and cast to e4m3. Scales are
powers of two (the smallest with |x| / scale <= the format's largest finite value, e4m3fn 448, e4m3fnuz 240),
as torchao's rowwise recipe and DeepSeek's later UE8M0 scales make them: multiplying by one is exact, so a
dequantised block quantises again to the same bytes (float8 dispatch relies on it) and the GEMM's rescaling adds
no rounding. Blocks of a dimension that is not a multiple of the block size end short, as if zero-padded:
zeros change no maximum.

The recipes by GEMM operand (x the expert-sorted tokens (rows, K), w (experts, K, N), dy the output's
gradient (rows, N); arXiv 2412.19437 section 3.3 for blockwise, torchao.prototype.moe_training for rowwise, the OCP
MX specification v1.0 and torchao's MXFP8 grouped GEMM for mxfp8):

    GEMM             operands       blockwise (DeepSeek-V3)               rowwise (torchao)
    out = x w        x, w           1 x 128 tiles, 128 x 128 blocks       per row; per (expert, column)
    dx = dy w^T      dy, w^T        1 x 128 tiles, w's blocks transposed  per row; per (expert, row of w)
    dw = x^T dy      x, dy          128 x 1 tiles along the tokens        per column over the tokens

    mxfp8: every operand in blocks of 32 along its reduction dim: x and dy 1 x 32 along K (N), w 32 x 1 along K per
    column, w^T along N, and the weight gradient's 32 x 1 tiles along the tokens.

An MXFP8 block's scale is an e8m0 power of two: the smallest with |x| / scale <= 448, which is torchao's RCEIL
rounding of the OCP scale (tests/float8/test_mxfp8.py checks the bytes against torchao's MXTensor.to_mx); so mxfp8
is this module's power_of_two_scale at 32-element blocks, and its dequantisation is as exact as the others'.

The weight gradient's operands are quantised along the tokens of each *segment*: an expert's rows from one
source (one process: the expert's group; expert parallelism: the rows each ep rank sent), tiles restarting
at every segment's first row. A tile then holds the tokens it holds in one process, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 128  # DeepSeek-V3's tile and block edge
MX_BLOCK = 32  # the OCP MX formats' block: 32 elements share one e8m0 scale
RECIPES = ("blockwise", "rowwise", "mxfp8")


def float8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def power_of_two_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest power of two s with amax / s <= float8_max(dtype), in float32; 1 where amax is 0."""
    ratio = amax.float() / float8_max(dtype)
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    scale = torch.ldexp(torch.ones_like(ratio), exponent.clamp(min=-126))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale clamped to the format and cast, through one float32 copy of x (divided and clamped in place: at
    DeepSeek-V3's shape an expert operand's copies are 0.9 GB each)."""
    limit = float8_max(dtype)
    values = x.to(torch.float32, copy=True)
    return values.div_(scale).clamp_(-limit, limit).to(dtype)


def _blocked(x: torch.Tensor, rows: int | None, cols: int | None) -> tuple[torch.Tensor, tuple]:
    """x (..., R, C) viewed as (..., R / rows, rows, C / cols, cols), zero-padded where a block is short (None:
    the whole dim), and the slice back to (..., R, C) from its (..., R', C') reshape."""
    r, c = x.shape[-2:]
    rows, cols = rows or max(r, 1), cols or max(c, 1)
    padded = F.pad(x, (0, -c % cols, 0, -r % rows)) if r % rows or c % cols else x
    blocks = padded.reshape(*x.shape[:-2], padded.shape[-2] // rows, rows, padded.shape[-1] // cols, cols)
    return blocks, (..., slice(0, r), slice(0, c))


def _unblocked(blocks: torch.Tensor, back: tuple) -> torch.Tensor:
    *lead, n_r, rows, n_c, cols = blocks.shape
    return blocks.reshape(*lead, n_r * rows, n_c * cols)[back]


def quantize_blocks(
    x: torch.Tensor, rows: int | None, cols: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., R, C) in blocks of rows x cols (None: the whole dim): (float8 data like x, scales (..., ceil(R /
    rows), ceil(C / cols)) in float32), x ~ data x its block's scale."""
    blocks, back = _blocked(x, rows, cols)
    scale = power_of_two_scale(blocks.abs().amax(dim=(-3, -1)), dtype)
    data = _cast(blocks, scale.unsqueeze(-2).unsqueeze(-1), dtype)
    return _unblocked(data, back).contiguous(), scale


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, rows: int | None, cols: int | None, dtype):
    blocks, back = _blocked(data.view(torch.uint8), rows, cols)  # pad bytes: F.pad has no float8 kernel
    values = blocks.view(data.dtype).float().mul_(scale.unsqueeze(-2).unsqueeze(-1))  # float(): a new tensor
    return _unblocked(values, back).to(dtype)


@dataclass
class TokenTiles:
    """How the rows of a weight gradient's operands split into tiles along the tokens (module docstring):
    `of_row` (rows,) each row's tile (rows past the last segment: one tile of their own, never read),
    `start`/`end` (tiles,) each tile's rows, `group_end` (groups,) one past each group's last tile."""

    of_row: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    group_end: torch.Tensor

    @property
    def count(self) -> int:
        return self.start.shape[0]


def token_tiles(rows: int, offsets: torch.Tensor, segment_ends: torch.Tensor, tile: int | None) -> TokenTiles:
    """Tiles of `tile` consecutive rows (None: a whole segment) restarting at every segment; `segment_ends`
    (int32, non-decreasing, every group end among them) and `offsets` the groups' ends. On the device, no host
    read: the tile count is bounded by the shapes (rows / tile + one per segment, + the rows past them)."""
    device, seg_ends = offsets.device, segment_ends.long()
    seg_starts = torch.cat([seg_ends.new_zeros(1), seg_ends[:-1]])
    sizes = seg_ends - seg_starts
    per_segment = (sizes + tile - 1) // tile if tile else (sizes > 0).long()
    first = torch.cumsum(per_segment, 0) - per_segment
    bound = (rows // tile if tile else 0) + seg_ends.shape[0] + 1
    row = torch.arange(rows, device=device)
    segment = torch.searchsorted(seg_ends, row, right=True)
    inside = segment < seg_ends.shape[0]
    segment = segment.clamp(max=seg_ends.shape[0] - 1)
    within = (row - seg_starts[segment]) // tile if tile else torch.zeros_like(row)
    of_row = torch.where(inside, first[segment] + within, bound - 1)
    start = torch.full((bound,), rows, device=device).scatter_reduce(0, of_row, row, "amin")
    end = torch.zeros(bound, dtype=torch.long, device=device).scatter_reduce(0, of_row, row + 1, "amax")
    end = torch.maximum(end, start)  # a tile no row falls in is empty
    segments_before = torch.searchsorted(seg_ends, offsets.long(), right=True)
    ends_of_tiles = torch.cat([per_segment.new_zeros(1), torch.cumsum(per_segment, 0)])
    return TokenTiles(of_row, start, end, ends_of_tiles[segments_before])


def quantize_token_tiles(x: torch.Tensor, tiles: TokenTiles, dtype: torch.dtype):
    """x (rows, C) scaled per (tile, column): (float8 data like x, scales (tiles, C) in float32). A tile's rows are
    consecutive and the tiles in row order, so the maxima are a segment reduction."""
    magnitude = x.to(torch.float32, copy=True).abs_()
    amax = torch.segment_reduce(magnitude, "max", lengths=tiles.end - tiles.start, unsafe=True, initial=0)
    del magnitude
    scale = power_of_two_scale(amax, dtype)
    data = torch.empty_like(x, dtype=dtype)
    for rows in _row_slices(x.shape[0]):  # each slice's scales gathered per row (float32, like x's copy)
        data[rows] = _cast(x[rows], scale[tiles.of_row[rows]], dtype)
    return data, scale


def dequantize_token_tiles(data: torch.Tensor, scale: torch.Tensor, tiles: TokenTiles, dtype) -> torch.Tensor:
    values = torch.empty_like(data, dtype=dtype)
    for rows in _row_slices(data.shape[0]):
        values[rows] = data[rows].float().mul_(scale[tiles.of_row[rows]]).to(dtype)
    return values


ROWS_AT_ONCE = 8192  # rows a token-tile cast scales at once: its float32 temporaries stay under 2 x 8192 x width


def _row_slices(rows: int) -> list[slice]:
    return [slice(start, min(start + ROWS_AT_ONCE, rows)) for start in range(0, rows, ROWS_AT_ONCE)]


# --- the recipes, operand by operand ------------------------------------------------------------------------
def activation_blocks(recipe: str) -> tuple[int | None, int | None]:
    """Scale blocks of a token-major operand (x for out, dy for dx): one row by 128 columns (blockwise) or by 32
    (mxfp8), or the whole row."""
    return {"blockwise": (1, BLOCK), "mxfp8": (1, MX_BLOCK)}.get(recipe, (1, None))


def weight_blocks(recipe: str) -> tuple[int | None, int | None]:
    """Scale blocks of a GEMM's (K, N) right operand: 128 x 128, 32 along K per column (mxfp8), or each column
    over the whole K."""
    return {"blockwise": (BLOCK, BLOCK), "mxfp8": (MX_BLOCK, 1)}.get(recipe, (None, 1))


def token_tile(recipe: str) -> int | None:
    """Rows per tile of the weight gradient's operands: 128 (blockwise), 32 (mxfp8), or the whole segment."""
    return {"blockwise": BLOCK, "mxfp8": MX_BLOCK}.get(recipe)
