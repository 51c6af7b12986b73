"""Deferred weight gradients (parallel.defer_weight_grads): a stage's backward computes each deferrable product's
input gradient at once and queues its weight gradient, which the schedule's weight-gradient action (W) computes
later. DeepSeek-V3's WeightGradStore, Megatron-Core's --delay-wgrad-compute.

Why not torch's own split: torch.distributed.pipelining splits a backward by running autograd twice, the input
pass then a weight pass over the weights' part of the graph. Under activation checkpointing that second pass
recomputes every checkpointed region again, which selective checkpointing refuses ("backward once on any region")
and which would repeat the expert all-to-alls of replayed blocks; so without deferral such a layout runs each weight
pass inside its input pass (pipeline_pairing.py join_weight_passes) and the zero-bubble fill is lost. Here the
backward runs once: a product's backward keeps what its weight gradient needs (its input and the gradient of its
output, already recomputed where checkpointed) and hands the product to the stage's queue; torch's PipelineStage
takes the queue right after the backward (its `dw_builder`) and runs it at the schedule's W. The queue takes only
during an input-gradient pass (pipeline_stage.py opens it): a full backward (1F1B's, a paired OVERLAP_F_B's) has no
W after it and computes its weight gradients as it goes, holding nothing more.

What defers, in the blocks and the multi-token prediction modules (not the output head: BLOCK_CONTAINERS): the
linears whose weight is a plain tensor (nn.Linear, and torchao's Float8Linear, whose product's backward is split
here with torchao's own casts: a queued float8 weight gradient holds its operands in float8), and the routed
experts' grouped products, high precision or float8 by the project's own blockwise product
(kernels/float8_grouped_gemm.py; torchao's rowwise and MXFP8 grouped products own their backward). Not the
tensor-parallel linears (DTensor weights), the norms, the embeddings: they compute their weight gradients in the
input pass, as without deferral; the result is the same, the W action just holds less.

A queued gradient reaches its parameter by autograd from the tensor the product took (`torch.autograd.backward`),
so a weight seen through `DTensor.to_local()` (the experts under expert parallelism) accumulates into its DTensor
parameter as the product's own backward would, and FSDP finds it where it looks at the step's end (torch's stage
reduces gradients after the last W: PipelineStage.perform_reduce_grad).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trillion.kernels.grouped_gemm import grouped_mm, grouped_weight_grad
from trillion.models.moe import routed_expert_stacks
from trillion.parallel.float8 import is_float8_linear


class WeightGradQueue:
    """The weight gradients one stage's backward deferred, in the order it deferred them."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []
        self._open = False
        self.computed = 0  # weight gradients computed after their backward, since the queue was made

    @contextlib.contextmanager
    def deferring(self, on: bool):
        """While on, `defer` queues; else it computes at once (a full backward's, which no W follows)."""
        self._open = on
        try:
            yield
        finally:
            self._open = False

    def defer(self, weight: torch.Tensor, gradient: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """`weight`'s gradient from this backward, `gradient()`: queued (None returned) while deferring, else
        computed and returned, for the product's backward to return as any backward does."""
        if not self._open:
            return gradient()
        self._pending.append((weight, gradient))
        return None

    def __len__(self) -> int:
        return len(self._pending)

    def take(self) -> Callable[[], None]:
        """What the backward just deferred, as one runner (a PipelineStage's `dw_builder`); the queue is empty after."""
        pending, self._pending = self._pending, []

        def run() -> None:
            for weight, gradient in pending:  # one at a time: each gradient is freed once accumulated
                torch.autograd.backward(weight, gradient().to(weight.dtype))
            self.computed += len(pending)

        return run


# where the deferrable products are: the blocks and the multi-token prediction modules. Not the output head, whose
# output gradient (a vocabulary's width a token) would be held from the input pass to the W
BLOCK_CONTAINERS = ("layers", "mtp")


def defer_weight_grads(model: nn.Module) -> WeightGradQueue:
    """Make `model`'s deferrable products (the module docstring) queue their weight gradients on one new queue,
    which is returned. Run after float8 conversion and tensor parallelism, which decide what is deferrable."""
    queue = WeightGradQueue()
    for name, module in model.named_modules():
        if name.split(".")[0] not in BLOCK_CONTAINERS or isinstance(getattr(module, "weight", None), DTensor):
            continue
        if type(module) is nn.Linear:
            module.forward = functools.partial(_linear, module, queue)
        elif is_float8_linear(module):
            module.forward = functools.partial(_float8_linear, module, queue)
    for stack in routed_expert_stacks(model):
        if stack.float8 is None:
            stack.grouped_mm = functools.partial(_grouped_product, queue)
        else:  # its float8 product defers where it is the project's own
            stack.float8 = dataclasses.replace(stack.float8, defer=queue.defer)
    return queue


def _linear(module: nn.Linear, queue: WeightGradQueue, x: torch.Tensor) -> torch.Tensor:
    return _DeferredLinear.apply(x, module.weight, module.bias, queue)


def _float8_linear(module: nn.Linear, queue: WeightGradQueue, x: torch.Tensor) -> torch.Tensor:
    """torchao's Float8Linear.forward (its autocast rule, its product, the bias after), the product's weight
    gradient deferred."""
    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())
    out = _DeferredFloat8Linear.apply(x, module.weight.t(), module.linear_mm_config, module.config, queue)
    return out if module.bias is None else out + module.bias.to(out.dtype)


def _grouped_product(queue: WeightGradQueue, x, weight, offsets, impl: str = "auto") -> torch.Tensor:
    return _DeferredGroupedProduct.apply(x, weight, offsets, impl, queue)


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands as autocast would give them to the product (the step may run under autocast)."""
    device = tensors[0].device.type
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):  # meta has none
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, queue):
        x_, weight_ = _autocast(x, weight)
        ctx.save_for_backward(x_, weight_)
        ctx.weight, ctx.queue, ctx.has_bias = weight, queue, bias is not None
        return F.linear(x_, weight_, None if bias is None else bias.to(x_.dtype))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        rows_in, rows_out = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw = ctx.queue.defer(ctx.weight, lambda: rows_out.t() @ rows_in) if ctx.needs_input_grad[1] else None
        bias_grad = rows_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dy @ weight if ctx.needs_input_grad[0] else None, dw, bias_grad, None


class _DeferredGroupedProduct(torch.autograd.Function):
    """kernels/grouped_gemm.py grouped_mm, its weight gradient (grouped_weight_grad) deferred."""

    @staticmethod
    def forward(ctx, x, weight, offsets, impl, queue):
        x_, weight_ = _autocast(x, weight)
        ctx.save_for_backward(x_, weight_, offsets)
        ctx.weight, ctx.queue, ctx.impl = weight, queue, impl
        return grouped_mm(x_, weight_, offsets, impl)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offsets = ctx.saved_tensors
        dy, impl = dy.contiguous(), ctx.impl
        dw = (
            ctx.queue.defer(ctx.weight, lambda: grouped_weight_grad(x, dy, offsets, impl))
            if ctx.needs_input_grad[1]
            else None
        )
        dx = grouped_mm(dy, weight.transpose(1, 2), offsets, impl) if ctx.needs_input_grad[0] else None
        return dx, dw, None, None, None


class _DeferredFloat8Linear(torch.autograd.Function):
    """torchao's float8 product (matmul_with_hp_or_float8_args: its forward, run as is), its backward's two GEMMs
    apart: the input gradient now, the weight gradient queued. Each operand is cast as torchao's backward casts it
    (the config's cast for that GEMM and role, along the same axis), so the gradients are torchao's own."""

    @staticmethod
    def forward(ctx, x, weight_t, mm_config, config, queue):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        ctx.weight_t, ctx.queue = weight_t, queue
        return matmul_with_hp_or_float8_args.forward(ctx, x, weight_t, mm_config, config)

    @staticmethod
    def backward(ctx, dy):
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, weight_t = ctx.saved_tensors
        c, cast = ctx.config, functools.partial(_float8_cast, ctx.linear_mm_config, ctx.config)
        rows_out, rows_in = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dw_t = dx = None
        if ctx.needs_input_grad[1]:
            dy_t = cast(rows_out, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0).t()
            x_for_weight = cast(rows_in, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0)
            dw_t = ctx.queue.defer(ctx.weight_t, lambda: torch.mm(dy_t, x_for_weight).t())
        if ctx.needs_input_grad[0]:
            dy_for_input = cast(rows_out, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1)
            w = cast(weight_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1)
            dx = torch.mm(dy_for_input, w.t()).reshape(*dy.shape[:-1], -1)
        return dx, dw_t, None, None, None


def _float8_cast(mm_config, config, t: torch.Tensor, cast_config, role, axis: int) -> torch.Tensor:
    """`t` as torchao's float8 backward casts it for one GEMM (unchanged where already float8 or not cast)."""
    from torchao.float8.config import ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic

    if tensor_already_casted_to_fp8(t) or cast_config.scaling_type is ScalingType.DISABLED:
        return t
    return hp_tensor_to_float8_dynamic(
        t,
        cast_config.target_dtype,
        mm_config,
        gemm_input_role=role,
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(axis, cast_config.scaling_granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )
