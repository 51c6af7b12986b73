"""The routed experts in float8 (float8.experts), applied from outside the model with the float8 swap of the
linears (parallel/float8.py, first in parallelize): every MoE layer's RoutedExperts computes its three grouped
GEMMs (w1, w3, w2: forward, input gradient and weight gradient) with kernels/float8_grouped_gemm.py's
Float8GroupedMM instead of the high-precision grouped_mm. Where almost all of a DeepSeek-V3 or Kimi K2
step's FLOPs are.

What it composes with, and why:
- expert parallelism: each rank's product sees its own experts' local weights and the rows they receive; the
  weight gradient's token tiles restart at each source rank's rows (models/moe.py RoutedExperts), so a
  tile holds the tokens it holds in one process: ep over data-parallel ranks gives one process's numbers
  (tests/float8/test_experts_parity.py). Under ep over cp ranks an expert's tokens of one sequence arrive
  from several ranks, so the tiles differ from one process's (float8-close, not equal).
- FSDP: the expert weights are gathered in high precision and quantised after the gather (torchao's own MoE
  path does the same; a float8 all-gather of 128 x 128 blocks is not implemented).
- tensor parallelism: the routed experts stay whole on their rank (tensor_parallel.py); nothing changes.
- pipeline stages, activation checkpointing (a recompute quantises the same values the same way) and
  torch.compile (the product is an autograd.Function of torch ops and Triton custom ops).
The routers stay in high precision (float8.py's ROUTER_NAMES: nn.Linear gates, never converted).
"""

import logging

import torch
from torch import nn

from trillion.errors import ConfigError
from trillion.kernels.float8_grouped_gemm import Float8GroupedMM, choose
from trillion.kernels.float8_scaling import BLOCK, activation_blocks
from trillion.models.moe import routed_expert_stacks

log = logging.getLogger("trillion")

EXPERT_PROJECTIONS = ("w1", "w3", "w2")


def convert_experts(model: nn.Module, setting: str, emulate: bool, cache_activations: bool = False) -> int:
    """Give every routed-expert stack of `model` the float8 product of `float8.experts=setting` (in place, on the
    meta device); returns the number of grouped GEMMs now in float8 (three per stack), which the log says.
    `cache_activations` (float8.cache_activations): the products keep their float8 inputs for backward, and SwiGLU
    its inputs in float8 (models/moe.py RoutedExperts)."""
    stacks = routed_expert_stacks(model)
    if setting == "off" or not stacks:
        if stacks:
            log.info("float8.experts=off: the routed experts' %d grouped GEMMs stay high precision", 3 * len(stacks))
        return 0
    for stack in stacks:
        stack.float8 = Float8GroupedMM(setting, emulate, stack.impl, keep_float8=cache_activations)
    count = len(EXPERT_PROJECTIONS) * len(stacks)
    _, dim, width = stacks[0].w1.shape
    block = activation_blocks(setting)[1] or BLOCK  # the recipe's scale block along a reduction (blockwise, mxfp8)
    short = [f"{name} {size}" for name, size in (("dim", dim), ("expert width", width)) if size % block]
    log.info(
        "float8 experts (float8.experts=%s%s): %d grouped GEMMs in float8 (%s of %d MoE layers; each "
        "forward, input and weight gradient), the routers in high precision%s%s",
        setting,
        ", emulated" if emulate else "",
        count,
        ", ".join(EXPERT_PROJECTIONS),
        len(stacks),
        f"; {setting} scales: {', '.join(short)} not a multiple of {block}, the last block of each row is short "
        "(as if zero-padded; not refused)"
        if short and setting != "rowwise"
        else "",
        "; their activations kept for backward in float8 (float8.cache_activations)" if cache_activations else "",
    )
    return count


def check_experts(setting: str, device: torch.device, emulate: bool, cache_activations: bool = False) -> None:
    """Refuse, before any work, float8.experts where neither backend of its recipe runs on `device`."""
    if setting == "off":
        return
    try:
        choose(setting, device, emulate, cache_activations)
    except ValueError as error:
        raise ConfigError(
            f"{error}. Use --float8.experts=auto (torchao's rowwise grouped GEMM where it runs, else the Triton "
            "blockwise one), --float8.experts=off to keep the routed experts in high precision, or "
            "--float8.emulate=true to check the numerics (not faster)."
        ) from None
