"""The mixture-of-experts kernels' launches for the ahead-of-time report (kernels/aot.py, which owns the cases,
the compiling and the gates): the experts' grouped GEMM in high precision (forward, dx, dweight), the same in
float8 with scales (blockwise, and rowwise for the products whose scale strides differ) on the targets with
float8 matrix units, and the fused token permutation (kernels/permute.py), both ways, forward and backward.

Each launch is built on meta tensors by the launchers' own argument builders (grouped_gemm_op.kernel_args,
permute.kernel_args), as the trainer makes it for DeepSeek-V3 / Kimi K2's shapes; sizes and counts are
run-time arguments, so other presets' launches compile to the same binaries.
"""

from __future__ import annotations

import torch

from trillion.kernels import grouped_gemm_op, permute
from trillion.kernels._triton_setup import config_set
from trillion.kernels.float8_scaling import BLOCK, TokenTiles

GEMM_KERNELS = ("gmm_fwd", "gmm_dx", "gmm_dw")
FLOAT8_GEMM_KERNELS = ("gmm8_fwd", "gmm8_dx", "gmm8_dw", "gmm8_fwd_rowwise", "gmm8_dx_rowwise")
# The float8 format each float8 target's matrix units take (kernels/float8_grouped_gemm.py float8_dtype): CDNA4
# (gfx950) moved to the OCP e4m3fn that NVIDIA uses
FLOAT8_ARCHS = {
    "sm90": torch.float8_e4m3fn,
    "sm100": torch.float8_e4m3fn,
    "gfx942": torch.float8_e4m3fnuz,
    "gfx950": torch.float8_e4m3fn,
}
PERMUTATION_KERNELS = ("perm_fwd", "perm_bwd", "comb_fwd")
# The permutation's launch: 8192 tokens, DeepSeek-V3's top-8 of dim 7168
PERMUTE_TOKENS, PERMUTE_TOP_K, PERMUTE_DIM = 8192, 8, 7168
_PERMUTE_KERNEL_NAMES = dict(zip(PERMUTATION_KERNELS, permute.KERNELS))


def gemm_configs(kernel: str, arch: str) -> list:
    """The configs the grouped GEMM's autotuner may pick for `kernel` (high precision or float8) on `arch`."""
    name = "dw" if kernel.startswith(("gmm_dw", "gmm8_dw")) else "mm"
    return grouped_gemm_op.configs(name + ("8" if kernel.startswith("gmm8") else ""), config_set(arch))


def gemm_launch(kernel: str, dtype: torch.dtype, arch: str, rows: int, groups: int, k: int, n: int):
    """(jit function, positional args, constexprs) of one grouped GEMM launch, as models/moe.py makes it: x (rows,
    k) times (groups, k, n) weights, dy (rows, n); float8 kernels take float8 operands, an output in `dtype`."""
    operand = FLOAT8_ARCHS[arch] if kernel.startswith("gmm8") else dtype
    x, dy = (torch.empty(rows, width, device="meta", dtype=operand) for width in (k, n))
    weight = torch.empty(groups, k, n, device="meta", dtype=operand)
    offsets = torch.empty(groups, device="meta", dtype=torch.int32)
    out_x, out_dy = (torch.empty(rows, width, device="meta", dtype=dtype) for width in (k, n))
    if not kernel.startswith("gmm8"):
        if kernel == "gmm_dw":
            return _gemm("dw", x, dy, offsets, torch.empty(groups, k, n, device="meta", dtype=dtype))
        a, b, out = (x, weight, out_dy) if kernel == "gmm_fwd" else (dy, weight.transpose(1, 2), out_x)
        return _gemm("mm", a, b, offsets, out)
    if kernel == "gmm8_dw":
        tiles = rows // BLOCK + groups + 1  # kernels/float8_scaling.py token_tiles' bound
        bounds = [torch.empty(size, device="meta", dtype=torch.long) for size in (rows, tiles, tiles, groups)]
        scales = (_scales(tiles, k), _scales(tiles, n), TokenTiles(*bounds))
        return _gemm("dw8", x, dy, offsets, torch.empty(groups, k, n, device="meta", dtype=torch.float32), scales)
    rowwise = kernel.endswith("rowwise")
    if kernel.startswith("gmm8_fwd"):
        a, b, out, reduced, columns = x, weight, out_dy, k, n
    else:  # dx: dy times the weight transposed, whose scales are the forward's transposed (blockwise)
        a, b, out, reduced, columns = dy, weight.transpose(1, 2), out_x, n, k
    a_scale = _scales(rows, 1 if rowwise else -(-reduced // BLOCK))
    b_scale = _scales(groups, 1, columns) if rowwise else _scales(groups, -(-reduced // BLOCK), -(-columns // BLOCK))
    return _gemm("mm8", a, b, offsets, out, (a_scale, b_scale, 1 if rowwise else BLOCK))


def _scales(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=torch.float32)


def _gemm(name: str, x, weight, offsets, out, scales: tuple = ()):
    args, meta = grouped_gemm_op.kernel_args(name, x, weight, offsets, out, scales)
    return grouped_gemm_op.kernel_fn(name), args, meta


def permutation_launch(kernel: str, dtype: torch.dtype):
    """(jit function, positional args, constexprs) of one launch of the fused permutation (kernels/permute.py)."""
    tokens, rows = PERMUTE_TOKENS, PERMUTE_TOKENS * PERMUTE_TOP_K
    x, routed = (torch.empty(count, PERMUTE_DIM, device="meta", dtype=dtype) for count in (tokens, rows))
    positions = torch.empty(tokens, PERMUTE_TOP_K, device="meta", dtype=torch.long)
    name = _PERMUTE_KERNEL_NAMES[kernel]
    if name == "permute_fwd":
        args, meta = permute.kernel_args(name, x, positions, torch.empty_like(routed))
    else:  # permute_bwd, combine_fwd: the routed rows into the tokens'
        args, meta = permute.kernel_args(name, routed, positions, torch.empty_like(x))
    return permute.kernel_fn(name), args, meta
