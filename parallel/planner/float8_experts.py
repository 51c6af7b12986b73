"""The routed experts in low precision as the planner prices them (moe.py costs the layer): the grouped GEMMs' rate
by recipe, as a share of the device's fp8 plateau, the recipe float8.experts resolves to, the number format it
multiplies in, and the bytes of a row on float8 dispatch's wire."""

from trillion.parallel.float8_recipes import FLOAT8_RECIPES, Float8Recipe

# The routed experts' float8 grouped GEMMs (float8_experts) as a share of the device's dense fp8 GEMM plateau
# (devices.toml fp8_gemm_efficiency), by recipe:
# - rowwise, torchao's _scaled_grouped_mm (what float8.experts=auto runs on sm90 and gfx942): pytorch/ao PR 2490
#   on an H100, 0.885 ms against bf16 torch._grouped_mm's 1.31 ms at M 8192, K 5120, N 8192, 16 experts: 1.48 x
#   the bf16 grouped rate, 1.48 x 794.5 / 1402.6 = 0.838 of the H100's fp8 plateau (both [mamf], devices.toml);
# - blockwise, DeepSeek-V3's 1 x 128 / 128 x 128 scales (the Triton kernel): DeepGEMM's contiguous grouped GEMMs at
#   DeepSeek-V3's expert shapes on an H800 (deepseek-ai/DeepGEMM README, February 2025: 1297, 1099, 1288 and
#   1093 TFLOP/s), mean 1194 = 0.851 of the same plateau. ASSUMED for Trillion's Triton kernel, which no GPU
#   has timed yet: DeepGEMM's rate is what the recipe reaches on Hopper.
# On gfx942 no grouped float8 figure is published: the same shares of its fp8 plateau (itself assumed, devices.toml).
# - mxfp8, torchao's _to_mxfp8_then_scaled_grouped_mm (float8.recipe=mxfp8's experts): pytorch/ao
#   torchao/prototype/moe_training/README.md, "MXFP8 Kernel Breakdown by Pass", DeepSeek-V3 shapes (131072 tokens x
#   7168 x 2048, 8 groups) on a B200: the 2D-3D scaled grouped GEMM (forward, input gradient) 1838.1 us each, the
#   2D-2D one (weight gradient) 2412.4 us, 3 x 3.848 TFLOP in 6088.6 us = 1896 TFLOP/s, 0.421 of the 4500 MXFP8 peak,
#   0.552 of the B200's fp8 plateau (0.763, [mamf]; the MXFP8 plateau assumed equal, devices.toml). Its quantisation
#   kernels are the casts below, at memory bandwidth.
# - nvfp4, mxfp4: no grouped 4-bit figure found: ASSUMED mxfp8's share of their own plateaus.
FLOAT8_EXPERT_SHARE = {"rowwise": 0.838, "blockwise": 0.851, "mxfp8": 0.552, "nvfp4": 0.552, "mxfp4": 0.552}
BLOCKWISE_TILE, SCALE_BYTES = 128, 4  # a dispatched row's float32 scale per 1 x 128 tile (or per row)


def float8_expert_recipe(float8) -> str | None:
    """The recipe a layout's float8 (a Float8Training, None: off) runs the routed experts in on a float8 GPU (None:
    they stay bf16): float8.experts=auto is torchao's rowwise, which runs wherever the planner prices float8 (sm90
    and later, gfx942 and later); under a block-scaled recipe resolve_float8 has already made auto that recipe
    (float8.recipe=mxfp8: torchao's MXFP8 grouped GEMM)."""
    if float8 is None or float8.experts == "off":
        return None
    return "rowwise" if float8.experts == "auto" else float8.experts


def expert_number_format(recipe: str) -> Float8Recipe:
    """The number format an expert recipe multiplies in (parallel/float8_recipes.py): a block-scaled one's own;
    rowwise and blockwise (DeepSeek-V3's 1 x 128 / 128 x 128, fp32 scales the GEMM applies itself) plain fp8."""
    named = FLOAT8_RECIPES.get(recipe)
    return named if named is not None and named.block else FLOAT8_RECIPES["tensorwise"]


def dispatch_row_bytes(dim: int, recipe: str) -> float:
    """Bytes of one token row on a float8 dispatch's wire (parallel/float8_dispatch.py): a byte per element and
    a float32 scale per 1 x 128 tile (blockwise) or per row (rowwise), against 2 per element in bf16; a block-scaled
    recipe's elements and a scale per block (MXFP8: a byte and an e8m0 per 32)."""
    if expert_number_format(recipe).block:
        return expert_number_format(recipe).quantised_bytes(dim)
    return dim + SCALE_BYTES * (-(-dim // BLOCKWISE_TILE) if recipe == "blockwise" else 1)
