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
- deepseek: DeepSeek-V3's recompute (arXiv 2412.19437 section 3.2.3): no block is replayed. Each block's
  attention branch (its norm and the attention: TransformerBlock.attend) runs under an op-level policy
  that keeps the outputs of the attention and of the linears other than the up-projections the part
  declares (latent attention's wq_b, wkv_b: Part.up_projections) and the output projection (nothing
  reads its output in backward), so the norms, the up-projections, rotary and the q/k/v they make are
  recomputed from the kept latents; a dense block's feed-forward branch (TransformerBlock.feed) keeps its
  matmul outputs and recomputes the norm and SwiGLU; an MoE block's feed-forward runs once (its dispatch
  never twice) and its routed experts recompute their SwiGLU output from the kept w1 and w3 outputs
  (models/moe.py RoutedExperts.recompute_swiglu), its shared experts likewise under the op-level policy.

Applied from outside by wrapping each block's forward in place, so parameter names do not change
(checkpoint_wrapper would add a prefix to them), and before compile and FSDP (parallelize.py).
"""

import contextvars
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trillion.kernels.attention_dispatch import SAVED_ATTENTION_OPS
from trillion.models.parts.spec import ROW
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
    if checkpoint_mode(mode).sublayers:
        apply_sublayer_recompute(model)
        return
    op_level = checkpoint_mode(mode).op_level
    blocks = list(model.layers.values())
    for index in checkpointed_blocks(mode, len(blocks)):
        blocks[index].forward = _checkpointed_forward(blocks[index], op_level=op_level)


# Whether the linear running now keeps its output (DeepSeek's mode: hooks on the linears the parts declare)
_KEEP_OUTPUT: contextvars.ContextVar = contextvars.ContextVar("keep_linear_output", default=True)


def _keep_kept_outputs(ctx, op, *args, **kwargs):
    """The op-level policy with the linears' say: a matmul inside an up-projection or an output projection is
    recomputed (or, for the latter, never needed)."""
    if op in _SAVE_OPS and _KEEP_OUTPUT.get():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _marked(module: nn.Module, keep: bool) -> None:
    """While `module` (a linear: linears do not nest) runs, the policy keeps its matmul's output or not."""

    def enter(*_) -> None:
        _KEEP_OUTPUT.set(keep)

    def leave(*_) -> None:
        _KEEP_OUTPUT.set(True)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _under_policy(function, policy):
    def run(*args, **kwargs):
        return checkpoint(
            function,
            *args,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, policy),  # not a closure: compile takes a partial
            **kwargs,
        )

    return run


def apply_sublayer_recompute(model: nn.Module) -> None:
    """DeepSeek's mode (the module docstring) on every block of `model` (a model or a pipeline stage), from the
    parts' declarations: which linears are up-projections, which part routes to experts and where they live."""
    from trillion.models import parts

    for index, block in model.layers.items():
        declared = parts.layer_block(model.args, int(index))
        for part in declared.parts:
            for linear in part.linears:
                recomputed = linear.name in part.up_projections or linear.split == ROW
                _marked(block.get_submodule(linear.name), keep=not recomputed)
        block.attend = _under_policy(block.attend, _keep_kept_outputs)
        routed_part = next((part for part in declared.parts if part.routing is not None), None)
        if routed_part is None:
            block.feed = _under_policy(block.feed, _keep_kept_outputs)
            continue
        for stack in {expert.name.rsplit(".", 1)[0] for expert in routed_part.experts}:
            block.get_submodule(stack).recompute_swiglu = True
        for owner in {linear.name.rsplit(".", 1)[0] for linear in routed_part.linears}:  # the shared experts
            module = block.get_submodule(owner)
            module.forward = _under_policy(module.forward, _keep_kept_outputs)
