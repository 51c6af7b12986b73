"""Hot-spot kernels and their dispatch: attention (SDPA or a plain eager reference; Triton
flash attention where it can run) with a plain-PyTorch fallback for every kernel."""

from trillion.kernels.attention_dispatch import ATTENTION_IMPLS, attention, flash_attention

NORM_IMPLS = ("torch", "triton")

__all__ = ["ATTENTION_IMPLS", "NORM_IMPLS", "attention", "flash_attention"]
