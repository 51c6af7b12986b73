"""The routed experts' SwiGLU with the router's weight: silu(gate) x up x weight, one weight per row (the routing
weight of the slot the row is; models/expert_rows.py says why it is applied here, before the down projection).

Backward keeps gate, up and the weights and recomputes the rest from them: the row weights' gradient is the dot of
the output's gradient with silu(gate) x up, so no product of the forward is kept (autograd would keep gate,
silu's output, up and their product). With `float8` (float8.cache_activations, DeepSeek-V3's cached SwiGLU input)
gate and up are kept in that format, quantised in 1 x 128 tiles with power-of-two scales as the float8 experts
quantise their activations (kernels/float8_scaling.py): about 2 bytes an element of gate and up where bf16 keeps 4.
The forward is the same in every case, in the activations' precision."""

import torch
import torch.nn.functional as F

from trillion.kernels.float8_scaling import BLOCK, dequantize_blocks, quantize_blocks


def routed_swiglu(
    gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, float8: torch.dtype | None = None
) -> torch.Tensor:
    """gate, up (rows, width), weights (rows,) -> silu(gate) * up * weights (rows, width); `float8`: the format gate
    and up are kept in for backward (kernels/float8_grouped_gemm.py float8_dtype), None: their own."""
    return _RoutedSwiGLU.apply(gate, up, weights, float8)


def _forward(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up * weights.unsqueeze(-1).to(gate.dtype)


class _RoutedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weights, float8):
        ctx.float8, ctx.dtype = float8, gate.dtype
        kept = (gate, up)
        if float8 is not None:
            kept = (*quantize_blocks(gate, 1, BLOCK, float8), *quantize_blocks(up, 1, BLOCK, float8))
        ctx.save_for_backward(weights, *kept)
        return _forward(gate, up, weights)

    @staticmethod
    def backward(ctx, grad):
        weights, *kept = ctx.saved_tensors
        if ctx.float8 is not None:
            kept = [dequantize_blocks(data, scale, 1, BLOCK, ctx.dtype) for data, scale in (kept[:2], kept[2:])]
        gate, up, weights = (t.detach().requires_grad_() for t in (*kept, weights))
        with torch.enable_grad():
            d_gate, d_up, d_weights = torch.autograd.grad(_forward(gate, up, weights), (gate, up, weights), grad)
        return d_gate, d_up, d_weights, None
