"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Modes (`parallel.activation_checkpoint`):
- none: keep everything.
- full: every block keeps only its input; its forward runs again in backward.
- selective: every second block (half the memory saved for half the recompute);
  selective:N checkpoints every N-th block.
- selective:op: every block, but an op-level policy saves the outputs of matmuls, attention and
  tensor-parallel reduce-scatters and recomputes only the cheap elementwise work (norms,
  activations, rotary, residual adds) - most of full's savings on the big intermediates at a
  few percent of its recompute.

Applied from outside by wrapping each block's forward in place, so parameter names do not change
(checkpoint_wrapper would add a prefix to them), and before compile and FSDP (parallelize.py).
"""

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trillion.errors import ConfigError

MODES = ("none", "full", "selective", "selective:N", "selective:op")
SELECTIVE_EVERY = 2

_aten = torch.ops.aten
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.linear.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _parse(mode: str) -> tuple[str, int]:
    """(kind, every): kind is none | full | blocks | op."""
    if mode in ("none", "full"):
        return mode, 1
    if mode == "selective":
        return "blocks", SELECTIVE_EVERY
    if mode == "selective:op":
        return "op", 1
    if mode.startswith("selective:") and mode.split(":", 1)[1].isdigit() and int(mode.split(":", 1)[1]) > 0:
        return "blocks", int(mode.split(":", 1)[1])
    raise ConfigError(f"parallel.activation_checkpoint={mode!r} is not known. Use none, full, selective "
                      f"(every {SELECTIVE_EVERY}nd block), selective:N (every N-th block, e.g. selective:3) or "
                      "selective:op (save matmul outputs, recompute the rest).")


def _checkpointed_blocks(mode: str, n_layers: int) -> list[int]:
    kind, every = _parse(mode)
    if kind == "none":
        return []
    return list(range(0, n_layers, every))


def recompute_fraction(mode: str, n_layers: int) -> float:
    """Share of the blocks' forward FLOPs that run twice (for hardware FLOPs). The op-level policy
    recomputes no matmul, and matmuls are nearly all of a block's FLOPs."""
    if _parse(mode)[0] == "op":
        return 0.0
    return len(_checkpointed_blocks(mode, n_layers)) / n_layers


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpointed_forward(block: nn.Module, op_level: bool):
    plain_forward = block.forward
    extra = {"context_fn": _op_context} if op_level else {}

    def forward(*args, **kwargs):
        return checkpoint(plain_forward, *args, use_reentrant=False, **extra, **kwargs)

    return forward


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    kind, _ = _parse(mode)
    blocks = list(model.layers.values())
    for index in _checkpointed_blocks(mode, len(blocks)):
        blocks[index].forward = _checkpointed_forward(blocks[index], op_level=kind == "op")
