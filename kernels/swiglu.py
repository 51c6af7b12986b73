"""The routed experts' SwiGLU with the router's weight: silu(gate) x up x weight, one weight per row (the routing
weight of the slot the row is; models/expert_rows.py says why it is applied here, before the down projection).

Backward keeps gate, up and the weights and recomputes the rest from them: the row weights' gradient is the dot of
the output's gradient with silu(gate) x up, so no product of the forward is kept (autograd would keep gate,
silu's output, up and their product). With float8.cache_activations (DeepSeek-V3's cached SwiGLU input) gate and up
are kept in float8 (`float8_inputs`), quantised in 1 x 128 tiles with power-of-two scales as the float8 experts
quantise their activations (kernels/float8_scaling.py): about 2 bytes an element of gate and up where bf16 keeps 4;
under DeepSeek's recompute the down projection's product then keeps nothing of its input, which backward rebuilds
from them (`from_float8_inputs`: DeepSeek-V3 recomputes the SwiGLU output from its cached inputs, arXiv 2412.19437
section 3.3.3). The forward is the same in every case, in the activations' precision."""

import torch
import torch.nn.functional as F

from trillion.kernels.float8_scaling import BLOCK, dequantize_blocks, quantize_blocks


def routed_swiglu(
    gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor, kept: tuple[torch.Tensor, ...] | None = None
) -> torch.Tensor:
    """gate, up (rows, width), weights (rows,) -> silu(gate) * up * weights (rows, width); `kept`: gate and up as
    backward keeps them in float8 (float8_inputs), None: as they are."""
    return _RoutedSwiGLU.apply(gate, up, weights, kept)


def float8_inputs(gate: torch.Tensor, up: torch.Tensor, float8: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(gate's data, its scales, up's data, its scales) in `float8` (kernels/float8_grouped_gemm.py float8_dtype),
    outside autograd (recorded, the quantisation's ops would keep gate and up themselves)."""
    return (*quantize_blocks(gate.detach(), 1, BLOCK, float8), *quantize_blocks(up.detach(), 1, BLOCK, float8))


def from_float8_inputs(gate, gate_scale, up, up_scale, weights, dtype: torch.dtype) -> torch.Tensor:
    """The SwiGLU output (in `dtype`) rebuilt from gate and up as float8_inputs keeps them: what w2's product takes in
    backward in place of its kept input under DeepSeek's recompute (models/moe.py RoutedExperts)."""
    return _forward(*_dequantized((gate, gate_scale, up, up_scale), dtype), weights.detach())


def _dequantized(kept, dtype: torch.dtype) -> list[torch.Tensor]:
    return [dequantize_blocks(data, scale, 1, BLOCK, dtype) for data, scale in (kept[:2], kept[2:])]


def _forward(gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up * weights.unsqueeze(-1).to(gate.dtype)


class _RoutedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weights, kept):
        ctx.float8, ctx.dtype = kept is not None, gate.dtype
        ctx.save_for_backward(weights, *((gate, up) if kept is None else kept))
        return _forward(gate, up, weights)

    @staticmethod
    def backward(ctx, grad):
        weights, *kept = ctx.saved_tensors
        if ctx.float8:
            kept = _dequantized(kept, ctx.dtype)
        gate, up, weights = (t.detach().requires_grad_() for t in (*kept, weights))
        with torch.enable_grad():
            d_gate, d_up, d_weights = torch.autograd.grad(_forward(gate, up, weights), (gate, up, weights), grad)
        return d_gate, d_up, d_weights, None
