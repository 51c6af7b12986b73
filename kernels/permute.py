"""The token permutation around the routed experts (models/moe.py): each token's row copied to its top_k slots
in expert order, and the experts' rows summed back into their token (the router's weights are applied inside the
experts, before their down projection: models/expert_rows.py says why).

    positions = inverse_order(order)                          # where slot s sits in expert order
    rows = permute(x, order, positions, top_k, impl)          # (tokens x top_k, dim), expert order
    out = combine(routed, positions, impl)                    # (tokens, dim)

The combine is the permutation's transpose: its backward hands each slot its token's gradient (the permutation's
forward), so it keeps only the positions for backward, never the routed rows. Backends (`kernels.permutation`):
`torch` is the reference, indexing and a reduction per direction (x[order // top_k]; routed[positions] summed over
the slots), each forward and backward materialising an intermediate the size of the routed rows; `triton` fuses
each direction into one kernel (kernels/_permute_kernels.py), reading and writing each row once, and gives the
reference's float32 results bit for bit (the rows, the combined output, the tokens' and the routed rows'
gradients). `auto` takes triton on a GPU, torch elsewhere, saying once why where a GPU cannot run Triton. Rows of
dropped slots (capacity) travel like any other: the experts leave them zero.
"""

import torch

from trillion.kernels._triton_setup import interpreting, next_power_of_2, unavailable_reason, use_triton

PERMUTE_IMPLS = ("auto", "triton", "torch")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Columns a program moves at a time: GPUs a wide slice, one config; the interpreter a narrow one, so that
# test rows span several. num_warps 4 on every target (experiments/kernels/RESOURCES.md).
BLOCK_D, INTERPRETER_BLOCK_D, NUM_WARPS = 1024, 16, 4
KERNELS = ("permute_fwd", "permute_bwd", "combine_fwd")


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """positions[order[i]] = i: where each slot sits in expert order."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def permute(x: torch.Tensor, order: torch.Tensor, positions: torch.Tensor, top_k: int, impl: str = "auto"):
    if fused(impl, x):
        return _permute_op(x.contiguous(), positions.view(-1, top_k))
    return x[order // top_k]


def combine(routed: torch.Tensor, positions: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """routed (tokens x top_k, dim) in expert order, positions (tokens, top_k) -> (tokens, dim), each token's slots
    summed."""
    if fused(impl, routed):
        return _combine_op(routed.contiguous(), positions)
    return routed[positions].sum(dim=1)


def fused(impl: str, x: torch.Tensor) -> bool:
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


def kernel_args(kernel: str, rows: torch.Tensor, positions, out, block_d: int = BLOCK_D) -> tuple[tuple, dict]:
    """(positional arguments, constexprs) of one launch (the launchers and kernels/aot.py build them here):
    permute_*: rows the tokens' (fwd) or the slots' gradient (bwd), out the other; combine_fwd: rows the routed
    rows, out the tokens'."""
    top_k = positions.shape[1]
    meta = {"TOP_K": top_k, "BLOCK_D": block_d}
    if kernel == "permute_bwd":
        meta |= {"SLOTS": next_power_of_2(top_k)}
    return (rows, positions, out, rows.shape[1], rows.stride(0), out.stride(0)), meta


def _launch(kernel: str, rows, positions, out):
    block_d = INTERPRETER_BLOCK_D if interpreting() else BLOCK_D
    args, meta = kernel_args(kernel, rows, positions, out, block_d)
    tokens = positions.shape[0]
    grid = (tokens, -(-rows.shape[1] // meta["BLOCK_D"]))
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


@torch.library.custom_op("trillion::combine", mutates_args=())
def _combine_op(routed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = routed.new_empty(positions.shape[0], routed.shape[1])
    _launch("combine_fwd", routed, positions, out)
    return out


@_combine_op.register_fake
def _(routed, positions):
    return routed.new_empty(positions.shape[0], routed.shape[1])


def _combine_grad(ctx, dout):
    return _permute_op(dout.contiguous(), ctx.saved_tensors[0]), None  # each slot takes its token's: the permutation


_combine_op.register_autograd(_combine_grad, setup_context=_save_positions)
