"""Hot-spot kernels and their dispatch: attention (SDPA or a plain eager reference; Triton flash attention
where it can run) and the experts' grouped GEMM, with a plain-PyTorch fallback for every kernel."""

from trillion.kernels.attention_dispatch import ATTENTION_IMPLS, attention, flash_attention
from trillion.kernels.grouped_gemm import GROUPED_GEMM_IMPLS, grouped_mm

NORM_IMPLS = ("torch", "triton")

__all__ = ["ATTENTION_IMPLS", "GROUPED_GEMM_IMPLS", "NORM_IMPLS", "attention", "flash_attention", "grouped_mm"]
