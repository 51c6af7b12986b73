"""SwiGLU, silu(gate) x up, that keeps its inputs for backward in float8 (float8.cache_activations, DeepSeek-V3's
cached SwiGLU input): gate and up quantised in 1 x 128 tiles with power-of-two scales, as the float8 experts quantise
their activations (kernels/float8_scaling.py), and the output recomputed from them in backward. The forward is
SwiGLU's own, in high precision; backward keeps about 2 bytes an element of gate and up where autograd keeps gate,
up and silu's output in the activations' dtype (6 in bf16)."""

import torch
import torch.nn.functional as F

from trillion.kernels.float8_scaling import BLOCK, dequantize_blocks, quantize_blocks


class Float8KeptSwiGLU(torch.autograd.Function):
    """gate, up (rows, width) -> silu(gate) * up; `dtype` the float8 format (kernels/float8_grouped_gemm.py
    float8_dtype)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(*quantize_blocks(gate, 1, BLOCK, dtype), *quantize_blocks(up, 1, BLOCK, dtype))
        ctx.out_dtype = gate.dtype
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_data, gate_scale, up_data, up_scale = ctx.saved_tensors
        gate = dequantize_blocks(gate_data, gate_scale, 1, BLOCK, ctx.out_dtype).requires_grad_()
        up = dequantize_blocks(up_data, up_scale, 1, BLOCK, ctx.out_dtype).requires_grad_()
        with torch.enable_grad():
            d_gate, d_up = torch.autograd.grad(F.silu(gate) * up, (gate, up), grad)
        return d_gate, d_up, None
