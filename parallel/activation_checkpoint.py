"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

none: keep everything. full: every block. selective: every second block (half the memory
saved for half the recompute). Applied from outside, by wrapping blocks in place, so parameter
names do not change (checkpoint_wrapper would add a prefix to them).
"""
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.errors import ConfigError

MODES = ("none", "full", "selective")
SELECTIVE_EVERY = 2


def _checkpointed_blocks(mode: str, n_layers: int) -> list[int]:
    if mode not in MODES:
        raise ConfigError(f"parallel.activation_checkpoint={mode!r} is not known. Use {', '.join(MODES)}.")
    if mode == "none":
        return []
    return list(range(n_layers)) if mode == "full" else list(range(0, n_layers, SELECTIVE_EVERY))


def recompute_fraction(mode: str, n_layers: int) -> float:
    """Share of the blocks whose forward runs twice (for hardware FLOPs)."""
    return len(_checkpointed_blocks(mode, n_layers)) / n_layers


def _checkpointed_forward(block: nn.Module):
    plain_forward = block.forward

    def forward(*args, **kwargs):
        return checkpoint(plain_forward, *args, use_reentrant=False, **kwargs)

    return forward


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    blocks = list(model.layers.values())
    for index in _checkpointed_blocks(mode, len(blocks)):
        blocks[index].forward = _checkpointed_forward(blocks[index])
