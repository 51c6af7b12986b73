"""The token permutation around the routed experts (models/moe.py): each token's row copied to its top_k slots
in expert order, and the experts' rows brought back to their token, weighted by the router and summed.

    positions = inverse_order(order)                          # where slot s sits in expert order
    rows = permute(x, order, positions, top_k, impl)          # (tokens x top_k, dim), expert order
    out = unpermute(routed, positions, weights, impl)         # (tokens, dim)

Backends (`kernels.permutation`): `torch` is the reference, three indexing ops and a reduction per direction
(x[order // top_k]; routed[positions] times the weights, summed over the slots), each forward and backward
materialising an intermediate the size of the routed rows; `triton` fuses each direction into one kernel
(kernels/_permute_kernels.py), forward and backward, reading and writing each row once, and gives the
reference's float32 results bit for bit (the rows, the tokens' gradients, the rows' gradients; the weights'
gradient, a dot product over dim whose summation order torch leaves to the CPU's vector width, to fp32
rounding). `auto` takes triton on a GPU, torch elsewhere, saying once why where a GPU cannot run Triton.
Rows of dropped slots (capacity) travel like any other: the experts leave them zero.
"""

import torch

from trillion.kernels._triton_setup import interpreting, next_power_of_2, unavailable_reason, use_triton

PERMUTE_IMPLS = ("auto", "triton", "torch")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Columns a program moves at a time: GPUs a wide slice, one config; the interpreter a narrow one, so that
# test rows span several. num_warps 4 on every target (experiments/kernels/RESOURCES.md).
BLOCK_D, INTERPRETER_BLOCK_D, NUM_WARPS = 1024, 16, 4
KERNELS = ("permute_fwd", "permute_bwd", "unpermute_fwd", "unpermute_bwd")


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """positions[order[i]] = i: where each slot sits in expert order."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def permute(x: torch.Tensor, order: torch.Tensor, positions: torch.Tensor, top_k: int, impl: str = "auto"):
    if _choose(impl, x):
        return _permute_op(x.contiguous(), positions.view(-1, top_k))
    return x[order // top_k]


def unpermute(routed: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, impl: str = "auto"):
    """routed (tokens x top_k, dim) in expert order, weights (tokens, top_k) -> (tokens, dim)."""
    if _choose(impl, routed):
        return _unpermute_op(routed.contiguous(), positions.view(weights.shape), weights.contiguous())
    top_k = weights.shape[1]
    return (routed[positions].view(-1, top_k, routed.shape[1]) * weights.unsqueeze(-1).to(routed.dtype)).sum(dim=1)


def _choose(impl: str, x: torch.Tensor) -> bool:
    """Whether `impl` runs the Triton kernels on x."""
    if impl == "torch" or (impl == "auto" and x.device.type != "cuda"):
        return False
    dtype = "" if x.dtype in _DTYPES else f"the fused permutation takes float16, bfloat16 or float32, not {x.dtype}"
    return use_triton(f"kernels.permutation={impl}", x.device.type, dtype)


def permutation_unavailable(device: torch.device) -> str | None:
    """Why kernels.permutation=triton cannot run on `device` (None when it can)."""
    return unavailable_reason(device)


# ----------------------------------------------------------------------------- launches
def kernel_fn(kernel: str):
    from trillion.kernels import _permute_kernels  # on first use: Triton picks interpreting when it is defined

    return getattr(_permute_kernels, kernel)


def kernel_args(
    kernel: str, rows: torch.Tensor, positions, out, weights=None, extra=(), block_d: int = BLOCK_D
) -> tuple[tuple, dict]:
    """(positional arguments, constexprs) of one launch (the launchers and kernels/aot.py build them here):
    permute_*: rows the tokens' (fwd) or the slots' gradient (bwd), out the other; unpermute_fwd: rows the
    routed rows, out the tokens'; unpermute_bwd: rows the tokens' gradient, extra (routed, drouted, dweights)."""
    top_k = positions.shape[1]
    meta = {"TOP_K": top_k, "BLOCK_D": block_d}
    dim = rows.shape[1]
    if kernel == "permute_fwd":
        return (rows, positions, out, dim, rows.stride(0), out.stride(0)), meta
    if kernel == "permute_bwd":
        return (rows, positions, out, dim, rows.stride(0), out.stride(0)), meta | {"SLOTS": next_power_of_2(top_k)}
    if kernel == "unpermute_fwd":
        return (rows, positions, weights, out, dim, rows.stride(0), out.stride(0)), meta
    routed, drouted, dweights = extra
    args = (rows, routed, positions, weights, drouted, dweights, dim, rows.stride(0), routed.stride(0))
    return (*args, drouted.stride(0)), meta


def _launch(kernel: str, rows, positions, out, weights=None, extra=()):
    block_d = INTERPRETER_BLOCK_D if interpreting() else BLOCK_D
    args, meta = kernel_args(kernel, rows, positions, out, weights, extra, block_d)
    tokens = positions.shape[0]
    grid = (tokens,) if kernel == "unpermute_bwd" else (tokens, -(-rows.shape[1] // meta["BLOCK_D"]))
    if tokens and rows.shape[1]:
        kernel_fn(kernel)[grid](*args, **meta, num_warps=NUM_WARPS)


@torch.library.custom_op("trillion::permute", mutates_args=())
def _permute_op(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(positions.numel(), x.shape[1])
    _launch("permute_fwd", x, positions, out)
    return out


@_permute_op.register_fake
def _(x, positions):
    return x.new_empty(positions.numel(), x.shape[1])


@torch.library.custom_op("trillion::permute_backward", mutates_args=())
def _permute_backward(dout: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    dx = dout.new_empty(positions.shape[0], dout.shape[1])
    _launch("permute_bwd", dout, positions, dx)
    return dx


@_permute_backward.register_fake
def _(dout, positions):
    return dout.new_empty(positions.shape[0], dout.shape[1])


def _save_positions(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _permute_grad(ctx, dout):
    return _permute_backward(dout.contiguous(), ctx.saved_tensors[0]), None


_permute_op.register_autograd(_permute_grad, setup_context=_save_positions)


@torch.library.custom_op("trillion::unpermute", mutates_args=())
def _unpermute_op(routed: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    out = routed.new_empty(positions.shape[0], routed.shape[1])
    _launch("unpermute_fwd", routed, positions, out, weights)
    return out


@_unpermute_op.register_fake
def _(routed, positions, weights):
    return routed.new_empty(positions.shape[0], routed.shape[1])


@torch.library.custom_op("trillion::unpermute_backward", mutates_args=())
def _unpermute_backward(
    dout: torch.Tensor, routed: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    drouted, dweights = torch.empty_like(routed), torch.empty_like(weights)
    _launch("unpermute_bwd", dout, positions, None, weights, (routed, drouted, dweights))
    return drouted, dweights


@_unpermute_backward.register_fake
def _(dout, routed, positions, weights):
    return torch.empty_like(routed), torch.empty_like(weights)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_grad(ctx, dout):
    routed, positions, weights = ctx.saved_tensors
    drouted, dweights = _unpermute_backward(dout.contiguous(), routed, positions, weights)
    return drouted, None, dweights


_unpermute_op.register_autograd(_unpermute_grad, setup_context=_save_inputs)
