"""The routed experts' grouped GEMM in float8: out = x @ w per group, its input gradient dy @ w^T and its weight
gradient x^T @ dy, all three with float8 operands scaled by a recipe (kernels/float8_scaling.py: blockwise,
DeepSeek-V3's 1 x 128 / 128 x 128; rowwise, torchao's), accumulated in fp32, outputs in the operands'
high-precision dtype. The master weights stay in high precision, and so does the saved input unless the product
keeps its float8 (float8.cache_activations, `keep_float8`).

    product = Float8GroupedMM("auto")                   # float8.experts; parallel/float8_experts.py installs it
    out = product(x, weight, offsets, segment_ends)     # the contract of kernels/grouped_gemm.py's grouped_mm

Backends, chosen by `choose` on the first call's device, the reason logged once (as kernels.grouped_gemm's):
- torchao: `torchao.prototype.moe_training`'s rowwise float8 grouped GEMM (torch._scaled_grouped_mm, CUTLASS on
  sm90 and later, hipBLASLt on gfx942 and later), rowwise only. It needs token groups of a multiple of 16 rows:
  they are padded on the device and the padding dropped after. Its weight-gradient scales span a group's
  rows whatever their source (module docstring of float8_scaling.py), so under expert parallelism it is not
  one process's quantisation, as the other backends are.
- triton: the project's grouped GEMM with float8 operands and scales (kernels/float8_grouped_gemm_op.py),
  either recipe, on GPUs with float8 matrix units (sm89 and later, gfx942 and later).
- emulated: the same quantisation, dequantised exactly (power-of-two scales) and multiplied in high precision
  by the high-precision grouped GEMM (kernels.grouped_gemm's backend): anywhere, a CPU included, not faster.
- torchao_mx (the mxfp8 recipe, float8.recipe=mxfp8's experts): torchao's `_to_mxfp8_then_scaled_grouped_mm`
  (torchao.prototype.moe_training: CUTLASS MXFP8 grouped GEMMs on sm100, its token groups padded to 32 rows). Like
  torchao's rowwise backend its weight-gradient blocks span a group's rows whatever their source; no GPU of this
  project's has run it yet (the emulated backend is the one its tests check).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trillion.kernels import float8_scaling as scaling
from trillion.kernels._triton_setup import has_triton, unavailable_reason
from trillion.kernels.grouped_gemm import grouped_mm, grouped_weight_grad

FLOAT8_EXPERT_CHOICES = ("auto", *scaling.RECIPES, "off")  # float8.experts
BACKENDS = ("torchao", "triton", "emulated", "torchao_mx")
TORCHAO_GROUP_ROWS = 16  # torch._scaled_grouped_mm's row alignment of a token group (fp8: 16 bytes)
NVIDIA_FLOAT8, NVIDIA_SCALED_GROUPED_MM = (8, 9), (9, 0)  # float8 matrix units; torch's CUTLASS grouped kernel
NVIDIA_MX = (10, 0)  # block-scaled (MX) tensor-core instructions: Blackwell
AMD_FLOAT8 = ("gfx942", "gfx950")


def float8_dtype(device: torch.device) -> torch.dtype:
    """e4m3 as the device's matrix units take it: e4m3fnuz on gfx942 (MI300X), e4m3fn elsewhere."""
    if device.type == "cuda" and torch.version.hip and _arch(device) == "gfx942":
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _arch(device: torch.device) -> str:
    if torch.version.hip:
        return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def _has_float8_units(device: torch.device) -> bool:
    if torch.version.hip:
        return _arch(device) in AMD_FLOAT8
    return torch.cuda.get_device_capability(device) >= NVIDIA_FLOAT8


def torchao_unavailable(device: torch.device) -> str | None:
    """Why torchao's rowwise float8 grouped GEMM cannot run on `device` (None when it can)."""
    if device.type != "cuda":
        return f"torchao's float8 grouped GEMM (torch._scaled_grouped_mm) runs on GPUs, not {device.type}"
    if not torch.version.hip and torch.cuda.get_device_capability(device) < NVIDIA_SCALED_GROUPED_MM:
        return f"torch._scaled_grouped_mm needs sm90 or later (this is {_arch(device)})"
    if torch.version.hip and _arch(device) not in AMD_FLOAT8:
        return f"torch._scaled_grouped_mm needs gfx942 or later (this is {_arch(device)})"
    try:
        import torchao.prototype.moe_training.fp8_grouped_mm  # noqa: F401
    except ImportError as error:
        return f"torchao.prototype.moe_training is not importable ({error})"
    return None


def mx_unavailable(device: torch.device) -> str | None:
    """Why torchao's MXFP8 grouped GEMM cannot run on `device` (None when it can)."""
    if device.type != "cuda":
        return f"torchao's MXFP8 grouped GEMM runs on GPUs, not {device.type}"
    if torch.version.hip or torch.cuda.get_device_capability(device) < NVIDIA_MX:
        return f"torchao's MXFP8 grouped GEMM (CUTLASS) needs NVIDIA sm100 or later (this is {_arch(device)})"
    try:
        import torchao.prototype.moe_training.mxfp8_grouped_mm  # noqa: F401
    except ImportError as error:
        return f"torchao.prototype.moe_training is not importable ({error})"
    return None


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton float8 grouped GEMM cannot run on `device` (None when it can)."""
    if not has_triton():
        return "the triton package is not installed"
    if device.type != "cuda":
        return unavailable_reason(device) or f"Triton's float8 dots need a GPU's float8 matrix units, not {device.type}"
    if not _has_float8_units(device):
        return f"{_arch(device)} has no float8 matrix units (NVIDIA sm89 or later, AMD gfx942 or later)"
    return unavailable_reason(device)


def choose(setting: str, device: torch.device, emulate: bool, keep_float8: bool = False) -> tuple[str, str, str]:
    """(recipe, backend, why) for `float8.experts=setting` on `device`: auto takes torchao's rowwise GEMM where it
    runs (not where the product keeps its float8 input, `keep_float8`: torchao's keeps its own), else blockwise in
    the Triton kernel; emulated, auto is blockwise (DeepSeek-V3's). A ValueError saying why where neither backend
    of the recipe runs (the trainer refuses those devices before any work)."""
    if emulate or device.type == "meta":  # meta: shapes only (trillion estimate), no numbers to get right
        recipe = "blockwise" if setting == "auto" else setting
        return recipe, "emulated", "emulated: the recipe's quantisation with high-precision matmuls, not faster"
    if setting == "mxfp8":
        why_not = mx_unavailable(device)
        if why_not is not None:
            raise ValueError(f"float8.experts=mxfp8 cannot run here: {why_not}")
        return "mxfp8", "torchao_mx", "torchao's MXFP8 grouped GEMM runs here"
    recipe = "rowwise" if setting == "auto" else setting
    no_torchao = torchao_unavailable(device) if recipe == "rowwise" else "torchao's grouped GEMM is rowwise only"
    if keep_float8 and no_torchao is None:
        no_torchao = "float8.cache_activations keeps the quantised input, which torchao's grouped GEMM keeps itself"
    if no_torchao is None:
        return recipe, "torchao", "torchao's rowwise float8 grouped GEMM runs here"
    no_triton = triton_unavailable(device)
    if no_triton is not None:
        raise ValueError(f"float8.experts={setting} cannot run here: {no_torchao}; {no_triton}")
    recipe = "blockwise" if setting == "auto" else recipe
    return recipe, "triton", f"the Triton float8 grouped GEMM, not torchao's: {no_torchao}"


@functools.cache
def resolved(setting: str, emulate: bool, device: torch.device, keep_float8: bool = False) -> tuple[str, str]:
    """(recipe, backend) of `setting` on `device`, its reason logged once (as kernels.grouped_gemm's choice)."""
    recipe, backend, why = choose(setting, device, emulate, keep_float8)
    if device.type != "meta":
        logging.getLogger("trillion").info("float8.experts=%s runs the %s recipe: %s", setting, recipe, why)
    return recipe, backend


resolved._dynamo_marked_constant = True  # as kernels/_triton_setup.py's use_triton: a constant to torch.compile


@dataclass(frozen=True)
class Float8GroupedMM:
    """The float8 grouped product of `float8.experts=setting` (parallel/float8_experts.py installs one per MoE
    layer), recipe and backend chosen on the first call's device; `impl` the high-precision grouped GEMM an
    emulated product runs (kernels.grouped_gemm)."""

    setting: str = "auto"
    emulate: bool = False
    impl: str = "auto"
    # float8.cache_activations: keep for backward the input as quantised for the forward (float8 data and scales,
    # about half the bytes) instead of the high-precision input; lossy, the weight gradient quantising the
    # dequantised input again along its token tiles. torchao's products keep their own, so it runs the Triton one.
    keep_float8: bool = False
    # defer(weight, gradient) -> the gradient now, or None where it queued it for later (parallel/
    # deferred_weight_grads.py); the Triton and emulated products only, torchao's compute theirs with the input's
    defer: Callable[[torch.Tensor, Callable[[], torch.Tensor]], None] | None = None

    def __call__(
        self, x, weight, offsets, segment_ends: torch.Tensor | None = None, quantized=None, rebuild=None
    ) -> torch.Tensor:
        """grouped_mm's contract; `segment_ends` (int32, every group end among them; default: the groups) bound
        the weight gradient's token tiles (kernels/float8_scaling.py); `quantized`: x's (data, scales) from
        `quantize_input`, shared by the products of one input so that backward keeps them once; `rebuild`: (function,
        tensors) giving x again in backward, function(*tensors), tensors another op keeps anyway: the product then
        keeps nothing of x (the down projection's input under DeepSeek's recompute, kernels/swiglu.py)."""
        recipe, backend = resolved(self.setting, self.emulate, x.device, self.keep_float8)
        if backend == "torchao":
            return _torchao_rowwise(x, weight, offsets, float8_dtype(x.device))
        if backend == "torchao_mx":
            return _torchao_mxfp8(x, weight, offsets)
        segments = offsets if segment_ends is None else segment_ends
        product = _Product(recipe, backend, self.impl, float8_dtype(x.device), self.keep_float8, self.defer)
        return _Float8GroupedMM.apply(x, weight, offsets, segments, product, *(quantized or (None, None)), rebuild)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's float8 data and scales as this product's forward quantises it (outside autograd: recorded, the
        quantisation's ops would keep x itself for a backward that never comes)."""
        recipe, _ = resolved(self.setting, self.emulate, x.device, self.keep_float8)
        return scaling.quantize_blocks(x.detach(), *scaling.activation_blocks(recipe), float8_dtype(x.device))


@dataclass(frozen=True)
class _Product:
    """What one call computes with: the recipe, the backend, the emulation's grouped GEMM, the float8 format."""

    recipe: str
    backend: str
    impl: str
    dtype: torch.dtype
    keep_float8: bool = False
    defer: Callable | None = None


class _Float8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets, segment_ends, product: _Product, xq=None, x_scale=None, rebuild=None):
        x_blocks, w_blocks = scaling.activation_blocks(product.recipe), scaling.weight_blocks(product.recipe)
        if xq is None:
            xq, x_scale = scaling.quantize_blocks(x, *x_blocks, product.dtype)
        wq, w_scale = scaling.quantize_blocks(weight, *w_blocks, product.dtype)
        kept = rebuild[1] if rebuild else (xq, x_scale) if product.keep_float8 else (x,)
        ctx.save_for_backward(weight, offsets, segment_ends, *kept)
        ctx.product, ctx.x_dtype, ctx.rebuild = product, x.dtype, rebuild[0] if rebuild else None
        ctx.weight = weight if product.defer else None  # where a deferred gradient goes
        return _product(product, (xq, x_scale, x_blocks), (wq, w_scale, w_blocks), offsets, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        weight, offsets, segment_ends, *kept = ctx.saved_tensors
        product, dy = ctx.product, dy.contiguous()
        blocks = scaling.activation_blocks(product.recipe)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt_blocks = scaling.weight_blocks(product.recipe)
            dyq, dy_scale = scaling.quantize_blocks(dy, *blocks, product.dtype)
            wtq, wt_scale = scaling.quantize_blocks(weight.transpose(1, 2), *wt_blocks, product.dtype)
            dx = _product(product, (dyq, dy_scale, blocks), (wtq, wt_scale, wt_blocks), offsets, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            rebuild, x_dtype, w_dtype = ctx.rebuild, ctx.x_dtype, weight.dtype

            def weight_grad() -> torch.Tensor:
                if rebuild is not None:
                    x = rebuild(*kept)
                else:
                    x = scaling.dequantize_blocks(*kept, *blocks, x_dtype) if product.keep_float8 else kept[0]
                tiles = scaling.token_tiles(x.shape[0], offsets, segment_ends, scaling.token_tile(product.recipe))
                xq, x_scale = scaling.quantize_token_tiles(x, tiles, product.dtype)
                dyq, dy_scale = scaling.quantize_token_tiles(dy, tiles, product.dtype)
                return _weight_grad(product, (xq, x_scale, x.dtype), (dyq, dy_scale), tiles, offsets, w_dtype)

            dw = weight_grad() if product.defer is None else product.defer(ctx.weight, weight_grad)
        return dx, dw, None, None, None, None, None, None


def _product(product: _Product, x: tuple, weight: tuple, offsets, out_dtype) -> torch.Tensor:
    """(data, scales, blocks) of x and of the weight -> the grouped product in out_dtype."""
    (xq, x_scale, x_blocks), (wq, w_scale, w_blocks) = x, weight
    if product.backend == "triton":
        from trillion.kernels.float8_grouped_gemm_op import float8_mm

        return float8_mm(xq, x_scale, wq, w_scale, offsets, w_blocks[1], out_dtype)
    xd = scaling.dequantize_blocks(xq, x_scale, *x_blocks, out_dtype)
    wd = scaling.dequantize_blocks(wq, w_scale, *w_blocks, out_dtype)
    return grouped_mm(xd, wd, offsets, product.impl)


def _weight_grad(product: _Product, x: tuple, dy: tuple, tiles, offsets, out_dtype) -> torch.Tensor:
    (xq, x_scale, x_dtype), (dyq, dy_scale) = x, dy
    if product.backend == "triton":
        from trillion.kernels.float8_grouped_gemm_op import float8_mm_dw

        return float8_mm_dw(xq, x_scale, dyq, dy_scale, offsets, tiles.start, tiles.end, tiles.group_end, out_dtype)
    xd = scaling.dequantize_token_tiles(xq, x_scale, tiles, x_dtype)  # exact in bf16 too (power-of-two scales)
    dyd = scaling.dequantize_token_tiles(dyq, dy_scale, tiles, x_dtype)
    return grouped_weight_grad(xd, dyd, offsets, product.impl).to(out_dtype)


# --- torchao's rowwise grouped GEMM, on token groups padded to its alignment -----------------------------------
def padded_groups(offsets: torch.Tensor, rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source, destination, padded offsets) of the groups padded to multiples of `align` rows, on the device:
    padded row p holds row source[p] (`rows`: a zero row), row r lands at destination[r] (rows past the groups:
    the last padded row, never one a group writes)."""
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded_ends = torch.cumsum((ends - starts + align - 1) // align * align, 0)
    padded_starts = padded_ends - (ends - starts + align - 1) // align * align
    bound = rows + (align - 1) * offsets.shape[0] + 1
    slot = torch.arange(bound, device=offsets.device)
    group = torch.searchsorted(padded_ends, slot, right=True).clamp(max=offsets.shape[0] - 1)
    within = slot - padded_starts[group]
    source = torch.where(within < ends[group] - starts[group], starts[group] + within, rows)
    row = torch.arange(rows, device=offsets.device)
    group_of_row = torch.searchsorted(ends, row, right=True)
    inside = group_of_row < offsets.shape[0]
    group_of_row = group_of_row.clamp(max=offsets.shape[0] - 1)
    destination = torch.where(inside, padded_starts[group_of_row] + row - starts[group_of_row], bound - 1)
    return source, destination, padded_ends.to(torch.int32)


def _torchao_mxfp8(x, weight, offsets) -> torch.Tensor:
    """torchao's MXFP8 grouped GEMM, its groups padded to 32 rows by torchao itself; rows past the groups 0."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

    out = _to_mxfp8_then_scaled_grouped_mm(
        x, weight, offs=offsets, out_dtype=x.dtype, pad_token_groups_for_grouped_mm=True
    )
    past_the_groups = torch.arange(x.shape[0], device=x.device) >= offsets[-1]
    return out.masked_fill(past_the_groups.unsqueeze(1), 0)


def _torchao_rowwise(x, weight, offsets, dtype) -> torch.Tensor:
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    source, destination, padded_offsets = padded_groups(offsets, x.shape[0], TORCHAO_GROUP_ROWS)
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])[source]
    column_major = weight.transpose(1, 2).contiguous().transpose(1, 2)  # the layout its right operand needs
    out = _to_fp8_rowwise_then_scaled_grouped_mm(
        padded, column_major, padded_offsets, out_dtype=x.dtype, float8_dtype=dtype,
        pad_token_groups_for_grouped_mm=False,
    )  # fmt: skip
    past_the_groups = torch.arange(x.shape[0], device=x.device) >= offsets[-1]
    return out[destination].masked_fill(past_the_groups.unsqueeze(1), 0)
