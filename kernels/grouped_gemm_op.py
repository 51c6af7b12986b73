"""The Triton grouped GEMM of the routed experts, as PyTorch custom ops with autograd, for GPUs where
torch._grouped_mm does not run (ROCm, A100):

    out = triton_grouped_mm(x, weight, offsets)   # out[rows of g] = x[rows of g] @ weight[g]

x (rows, K) sorted by group, weight (groups, K, N), offsets (groups,) int32: each group's end row;
rows past the last group's end come out zero, and get zero gradients. No host read of the group
sizes: the kernels find their group on the device (kernels/_grouped_gemm_kernels.py). The backward
is the same kernel against weight transposed (dx) and a per-group x^T @ dy (dweight). dtype fp16,
bf16 or fp32 (fp32 with IEEE fp32 dot products, not TF32), x and weight of one dtype.
"""

from __future__ import annotations

import functools

import torch
import triton

from trillion.kernels._triton_setup import device_arch, interpreting

__all__ = ["triton_grouped_mm", "DTYPES"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- configs
# Per architecture, the configs the autotuner times for the product ("mm": the forward and dx) and
# the weight gradient ("dw"): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, AMD options]).
# In "dw" the output tile is BLOCK_K x BLOCK_N and BLOCK_M is the stride over the group's rows.
# Each compiles without spills or scratch within the chip's shared memory / LDS
# (experiments/kernels/RESOURCES.md, tests/kernels/test_aot.py).
def _amd(waves: int) -> dict:
    return {"waves_per_eu": waves, "matrix_instr_nonkdim": 16}


_CONFIGS: dict[str, dict[str, list[tuple]]] = {
    "sm80": {
        "mm": [(128, 128, 32, 8, 4), (128, 64, 32, 4, 4), (64, 128, 64, 4, 3)],
        "dw": [(32, 128, 128, 8, 4), (64, 64, 128, 4, 3), (32, 64, 64, 4, 4)],
    },
    "sm90": {
        "mm": [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)],
        "dw": [(64, 128, 128, 8, 3), (32, 128, 128, 8, 4), (64, 64, 128, 4, 3)],
        "mm8": [(128, 128, 64, 8, 4), (64, 128, 128, 4, 4), (128, 64, 128, 4, 3)],
        "dw8": [(64, 128, 128, 8, 3), (64, 64, 128, 4, 3)],
    },
    # Blackwell: sm90's, less the float8 products that spill on sm100 with rowwise scales (RESOURCES.md)
    "sm100": {
        "mm": [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4)],
        "dw": [(64, 128, 128, 8, 3), (32, 128, 128, 8, 4), (64, 64, 128, 4, 3)],
        "mm8": [(64, 128, 128, 4, 4)],
        "dw8": [(64, 128, 128, 8, 3), (64, 64, 128, 4, 3)],
    },
    "gfx90a": {
        "mm": [(128, 128, 32, 8, 2, _amd(1)), (128, 64, 32, 4, 2, _amd(2)), (64, 64, 64, 4, 2, _amd(2))],
        "dw": [(32, 128, 128, 8, 2, _amd(1)), (32, 64, 64, 4, 2, _amd(2))],
    },
    "gfx942": {
        "mm": [(128, 128, 64, 8, 2, _amd(1)), (128, 128, 32, 4, 2, _amd(2)), (64, 128, 64, 4, 2, _amd(2))],
        "dw": [(64, 128, 128, 8, 2, _amd(1)), (32, 64, 128, 4, 2, _amd(2))],
        "mm8": [(128, 128, 128, 8, 2, _amd(1)), (64, 128, 128, 4, 2, _amd(2))],
        "dw8": [(64, 128, 128, 8, 2, _amd(1)), (64, 64, 128, 4, 2, _amd(2))],
    },
    # The interpreter runs one small config, so that test shapes span several tiles in every dim.
    "interpreter": {kernel: [(16, 16, 16, 4, 1)] for kernel in ("mm", "dw", "mm8", "dw8")},
}
# The float8 kernels ("mm8", "dw8": SCALED) run where float8 matrix units are (sm90 stands for sm89 and later;
# parallel/float8.py refuses the rest); their BLOCK_K divides the 128 of a scale block.
_KERNEL_NAMES = {"mm": "grouped_mm_fwd", "dw": "grouped_mm_dw", "mm8": "grouped_mm_fwd", "dw8": "grouped_mm_dw"}
SCALE_BLOCK = 128  # the float8 scales' block along the reduction (kernels/float8_scaling.py BLOCK)
# The groups a program searches for its own at a time: a constant, so one binary serves every expert
# count; the interpreter's is small, so that tests with a few groups search several blocks.
GROUP_SEARCH_BLOCK, INTERPRETER_GROUP_SEARCH_BLOCK = 128, 8


def kernel_fn(kernel: str):
    # Imported on first use: Triton decides between compiling and interpreting when a kernel is defined.
    from trillion.kernels import _grouped_gemm_kernels

    return getattr(_grouped_gemm_kernels, _KERNEL_NAMES[kernel])


def configs(kernel: str, arch: str) -> list[triton.Config]:
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **(extra[0] if extra else {})}, num_warps=w, num_stages=s
        )
        for bm, bn, bk, w, s, *extra in _CONFIGS[arch][kernel]
    ]


@functools.cache
def _tuned(kernel: str, arch: str):
    return triton.autotune(configs(kernel, arch), key=["K", "N"])(kernel_fn(kernel))


def kernel_args(kernel: str, x, weight, offsets, out, scales: tuple = ()) -> tuple[tuple, dict]:
    """(positional arguments, constexprs) of one launch, block sizes excluded. "mm": out = x @ weight
    per group (weight (groups, K, N), any strides: dx passes weight transposed); "dw": out (groups,
    K, N) = x^T @ weight per group, where `weight` is dy (rows, N). The float8 kernels ("mm8", "dw8") take
    `scales`: (x's (rows, K blocks), weight's (groups, K blocks, N blocks), columns per weight scale) for
    "mm8", (x's (tiles, K), dy's (tiles, N), kernels/float8_scaling.py's TokenTiles) for "dw8". The
    launchers below and the ahead-of-time report (kernels/aot.py) both build their launches here."""
    groups, scaled = offsets.shape[0], kernel.endswith("8")
    if kernel.startswith("mm"):
        rows, k = x.shape
        n = weight.shape[2]
        x_scale, w_scale, columns = scales if scaled else (offsets[:1].view(1, 1), offsets[:1].view(1, 1, 1), 1)
        strides = (*x.stride(), *weight.stride(), *out.stride(), *_scale_strides(x_scale), *_scale_strides(w_scale))
        meta = {"BLOCK_G": GROUP_SEARCH_BLOCK, "SCALED": scaled, "SCALE_BLOCK": SCALE_BLOCK, "W_SCALE_COLUMNS": columns}
        return (x, weight, out, offsets, x_scale, w_scale, rows, groups, k, n, *strides), meta
    dy = weight
    x_scale, dy_scale, tiles = scales if scaled else (offsets[:1].view(1, 1), offsets[:1].view(1, 1), None)
    bounds = (tiles.start, tiles.end, tiles.group_end) if scaled else (offsets, offsets, offsets)
    strides = (*x.stride(), *dy.stride(), *out.stride(), x_scale.stride(0), dy_scale.stride(0))
    meta = {"SCALED": scaled}
    return (x, dy, out, offsets, x_scale, dy_scale, *bounds, groups, x.shape[1], dy.shape[1], *strides), meta


def _scale_strides(scale) -> tuple:
    """A scale tensor's strides, 0 along a dim of one block (one scale spans it, whatever its length)."""
    return tuple(0 if size == 1 else stride for size, stride in zip(scale.shape, scale.stride()))


def _grid(kernel: str, x, weight, offsets):
    """The launch grid as a function of the config: an upper bound from the shapes alone."""
    if kernel.startswith("mm"):
        rows, n, groups = x.shape[0], weight.shape[2], offsets.shape[0]
        return lambda c: (triton.cdiv(rows, c["BLOCK_M"]) + groups, triton.cdiv(n, c["BLOCK_N"]))
    k, n, groups = x.shape[1], weight.shape[1], offsets.shape[0]
    return lambda c: (triton.cdiv(k, c["BLOCK_K"]) * triton.cdiv(n, c["BLOCK_N"]), groups)


def _launch(kernel: str, x, weight, offsets, out, scales: tuple = ()) -> torch.Tensor:
    args, meta = kernel_args(kernel, x, weight, offsets, out, scales)
    grid = _grid(kernel, x, weight, offsets)
    if interpreting():
        (config,) = configs(kernel, "interpreter")
        meta = {**meta, "BLOCK_G": INTERPRETER_GROUP_SEARCH_BLOCK} if "BLOCK_G" in meta else meta
        kernel_fn(kernel)[grid(config.kwargs)](*args, **meta, **config.kwargs)
        return out
    arch = device_arch(x.device)
    if (
        kernel.endswith("8") and arch == "sm80"
    ):  # float8 on sm89 (Ada): the sm90 set; its autotuner drops what won't fit
        arch = "sm90"
    with torch.cuda.device(x.device):
        _tuned(kernel, arch)[grid](*args, **meta)
    return out


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("trillion::grouped_mm", mutates_args=())
def _mm_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[2])
    if out.numel() == 0:
        return out
    return _launch("mm", x, weight, offsets, out)


@_mm_op.register_fake
def _(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("trillion::grouped_mm_dw", mutates_args=())
def _dw_op(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    dw = x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1])
    if dw.numel() == 0:
        return dw
    return _launch("dw", x, dy, offsets, dw)


@_dw_op.register_fake
def _(x, dy, offsets):
    return x.new_empty(offsets.shape[0], x.shape[1], dy.shape[1])


def _setup_context(ctx, inputs, output):
    x, weight, offsets = inputs
    ctx.save_for_backward(x, weight, offsets)


def _backward(ctx, dy):
    x, weight, offsets = ctx.saved_tensors
    dx = _mm_op(dy, weight.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    dw = _dw_op(x, dy, offsets) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_mm_op.register_autograd(_backward, setup_context=_setup_context)


def triton_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The contract of kernels/grouped_gemm.py:grouped_mm, run by the Triton kernels."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1] or offsets.shape != weight.shape[:1]:
        raise ValueError(
            f"grouped GEMM takes x (rows, K), weight (groups, K, N) and offsets (groups,); got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, offsets {tuple(offsets.shape)}"
        )
    if x.dtype != weight.dtype or x.dtype not in DTYPES or offsets.dtype != torch.int32:
        raise ValueError(
            f"grouped GEMM needs x and weight of one dtype among fp16, bf16, fp32 and int32 offsets; got {x.dtype}, "
            f"{weight.dtype}, {offsets.dtype}"
        )
    return _mm_op(x, weight, offsets)
