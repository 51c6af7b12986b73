"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Modes (`parallel.activation_checkpoint`, the table in modes.py):
- none: keep everything.
- full: every block keeps only its input; its forward runs again in backward.
- selective: every second block (half the memory saved for half the recompute);
  selective:N checkpoints every N-th block.
- selective:op: every block, but an op-level policy saves the outputs of matmuls, attention and
  tensor-parallel reduce-scatters and recomputes only the cheap elementwise work (norms,
  activations, rotary, residual adds) - most of full's savings on the big intermediates at a
  few percent of its recompute. (Expert parallelism's dispatch stays outside the policy and is
  recomputed whole: expert_parallel.py.)

Applied from outside by wrapping each block's forward in place, so parameter names do not change
(checkpoint_wrapper would add a prefix to them), and before compile and FSDP (parallelize.py).
"""

import contextvars

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trillion.kernels.attention_dispatch import SAVED_ATTENTION_OPS
from trillion.parallel.modes import checkpoint_mode, checkpointed_blocks

_aten = torch.ops.aten
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.linear.default,
    _aten._scaled_mm.default,  # the float8 GEMM (parallel/float8.py), as torchtitan saves it
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    *SAVED_ATTENTION_OPS,
}


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


# The input of the checkpointed block running (its first forward or its recompute), in this thread: what a part
# that replays its first forward's choices in the recompute finds them by (parallel/expert_parallel.py)
_RECOMPUTE_KEY: contextvars.ContextVar = contextvars.ContextVar("recompute_key", default=None)


def recompute_key():
    """The running checkpointed block's input tensor (the same object in its recompute), or None."""
    return _RECOMPUTE_KEY.get()


def _checkpointed_forward(block: nn.Module, op_level: bool):
    plain_forward = block.forward
    extra = {"context_fn": _op_context} if op_level else {}

    def keyed(*args, **kwargs):
        token = _RECOMPUTE_KEY.set(args[0])
        try:
            return plain_forward(*args, **kwargs)
        finally:
            _RECOMPUTE_KEY.reset(token)

    def forward(*args, **kwargs):
        return checkpoint(keyed, *args, use_reentrant=False, **extra, **kwargs)

    return forward


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    op_level = checkpoint_mode(mode).op_level
    blocks = list(model.layers.values())
    for index in checkpointed_blocks(mode, len(blocks)):
        blocks[index].forward = _checkpointed_forward(blocks[index], op_level=op_level)
