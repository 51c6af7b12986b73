"""Rotary positions: the cos/sin table (plain, or YaRN-scaled as DeepSeek's configs give it) and its
application in the half-split layout. Both attentions (models/transformer.py, models/mla.py) read them."""

import math

import torch

from trillion.models.args import ModelArgs, YaRNArgs


def rope_cache(
    head_dim: int, max_seq_len: int, theta: float, device=None, yarn: YaRNArgs | None = None
) -> torch.Tensor:
    """cos and sin of the rotary angles, shape (2, max_seq_len, head_dim), half-split layout. With `yarn`
    the frequencies are YaRN's and both are multiplied by its attention factor (as transformers' and
    DeepSeek's yarn rope multiply their cos and sin)."""
    wavelengths = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    inv_freq = 1.0 / wavelengths if yarn is None else _yarn_frequencies(wavelengths, head_dim, theta, yarn)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    table = torch.stack([angles.cos(), angles.sin()])
    return table * yarn_attention_factor(yarn) if yarn is not None else table


def model_rope_cache(args: ModelArgs, device=None) -> torch.Tensor:
    """The model's table: over its rotary part (MLA's qk_rope_head_dim, else the whole head), YaRN if set."""
    head_dim = args.mla.qk_rope_head_dim if args.mla is not None else args.head_dim
    return rope_cache(head_dim, args.max_seq_len, args.rope_theta, device=device, yarn=args.yarn)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by the first `seq` positions of the cache: (2, positions,
    head_dim), or (2, batch, 1, positions, head_dim) where each sequence has positions of its own.

    The half-split ("rotate_half") convention is the one Hugging Face Llama checkpoints use,
    so weights move between the two without permuting rows.
    """
    cos, sin = rope[0][..., : x.shape[-2], :].to(x.dtype), rope[1][..., : x.shape[-2], :].to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos + rotated * sin


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(yarn: YaRNArgs) -> float:
    """What cos and sin are multiplied by: the mscale ratio when both are given, else that of mscale 1
    (transformers' rule; DeepSeek's own code differs only for an mscale other than 1 without mscale_all_dim)."""
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor, 1.0)


def _yarn_frequencies(wavelengths: torch.Tensor, dim: int, theta: float, yarn: YaRNArgs) -> torch.Tensor:
    """Interpolated (divided by the factor) below the beta_slow rotations over the original context,
    extrapolated (kept) above beta_fast, a linear ramp between: the dimensions found as whole numbers."""

    def dimension_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension_of(yarn.beta_fast)), 0)
    high = min(math.ceil(dimension_of(yarn.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high  # a step, not a division by zero
    ramp = ((torch.arange(dim // 2, device=wavelengths.device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # written as transformers writes it, so that float32 rounds the same way
    return 1.0 / (yarn.factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept
