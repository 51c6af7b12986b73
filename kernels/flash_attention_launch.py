"""The flash attention kernels' launches (kernels/flash_attention_op.py is the op around them): the arguments
of each kernel (shared with the ahead-of-time report), the head dim's blocks, the documents' bounds, the
autotuned launch, and the forward and backward passes that run them."""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from trillion.kernels._triton_setup import DELTA_WARPS, device_arch, interpreting, unavailable_reason
from trillion.kernels.flash_attention_configs import configs
from trillion.kernels.head_dims import block_d_for, block_dims_for

_LOG2E = 1.4426950408889634
DELTA_BLOCK_M = 64
_KERNEL_NAMES = {"fwd": "attn_fwd", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq", "delta": "attn_bwd_delta"}


# ----------------------------------------------------------------------------- tuning and launch


def kernel_fn(name: str):
    # Imported on first use, not with this module: Triton decides between compiling and
    # interpreting when a kernel is defined, and TRITON_INTERPRET may be set after start-up
    # (by a test's conftest) but before the first call.
    from trillion.kernels import _flash_attention_dkdv_kernel, _flash_attention_kernels

    module = _flash_attention_dkdv_kernel if name == "dkdv" else _flash_attention_kernels
    return getattr(module, _KERNEL_NAMES[name])


@functools.cache
def _tuned(kernel: str, arch: str, block_d: int, block_dv: int, documents: bool):
    return triton.autotune(
        configs(kernel, arch, block_d, block_dv, documents), key=["HEAD_DIM", "V_DIM", "IS_CAUSAL", "q_len", "kv_len"]
    )(kernel_fn(kernel))


def _launch(kernel: str, device: torch.device, grid_rows: int, grid_cols: int, *args, **meta):
    """Launch `kernel` with the device's tuned configs, or the interpreter's fixed one.

    The grid's first axis tiles `grid_rows` by the chosen config's block (BLOCK_M for the
    forward and dQ, BLOCK_N for dK/dV)."""
    tile = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
    dims = config_dims(meta)
    if interpreting():
        (config,) = configs(kernel, "interpreter", *dims)
        kernel_fn(kernel)[(triton.cdiv(grid_rows, config.kwargs[tile]), grid_cols)](*args, **meta, **config.kwargs)
        return
    fn = _tuned(kernel, device_arch(device), *dims, meta["HAS_DOCS"])
    with torch.cuda.device(device):
        fn[lambda cfg: (triton.cdiv(grid_rows, cfg[tile]), grid_cols)](*args, **meta)


# ----------------------------------------------------------------------------- launchers
def new_like_layout(batch: int, heads: int, seq: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    # (batch, seq, heads, head_dim) in memory: what models produce from a (batch, seq, dim)
    # projection and reshape back to, so neither side needs a copy.
    return like.new_empty((batch, seq, heads, head_dim)).transpose(1, 2)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _check_runnable(t: torch.Tensor) -> None:
    reason = unavailable_reason(t.device)
    if reason is not None:
        raise RuntimeError(f"flash_attention cannot run: {reason}")


def config_dims(meta: dict) -> tuple[int, int]:
    """The (q/k width as run, v's padded head dim) a launch's configs are chosen by (flash_attention_configs)."""
    return meta["BLOCK_D"] + meta["BLOCK_D2"], meta["BLOCK_DV"]


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's document as (its first position, one past its last), two int32 (batch, seq) tensors:
    what the kernels read to skip and mask (a document is a run of equal ids)."""
    batch, seq = document_ids.shape
    positions = torch.arange(seq, device=document_ids.device, dtype=torch.int32).expand(batch, seq)
    change = document_ids[:, 1:] != document_ids[:, :-1]
    edge = torch.ones_like(change[:, :1])
    starts = torch.where(torch.cat([edge, change], 1), positions, 0).cummax(1).values
    ends = torch.where(torch.cat([change, edge], 1), positions + 1, seq).flip(1).cummin(1).values.flip(1)
    return starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()


def kernel_args(
    kernel: str,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    softmax_scale: float,
    *,
    grad_out=None,
    delta=None,
    grads=None,
    documents=None,
) -> tuple[tuple, dict]:
    """(positional arguments, constexprs) of one launch of `kernel` ("fwd", "delta", "dkdv", "dq"),
    block sizes excluded; `documents`: document_bounds' (starts, ends), or None. The launchers below and the
    ahead-of-time report (kernels/report.py) both build their launches here, so the report compiles exactly
    the specialization that runs."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[3]
    if kernel == "delta":  # rowsum(dO * O), both of v's head dim
        meta = dict(HEAD_DIM=v_dim, BLOCK_D=block_d_for(v_dim))
        return (out, grad_out, delta, *_strides(out), *_strides(grad_out), q_heads, q_len), meta
    block_d, block_d2 = block_dims_for(head_dim)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_D2=block_d2, V_DIM=v_dim, BLOCK_DV=block_d_for(v_dim))
    meta.update(IS_CAUSAL=causal, HAS_DOCS=documents is not None)
    doc_start, doc_end = documents if documents is not None else (None, None)  # contiguous (batch, kv_len)
    group, qk_scale = q_heads // kv_heads, softmax_scale * _LOG2E
    if kernel == "fwd":
        tensors, strided, scalars = (q, k, v, out, lse), (q, k, v, out), (q_heads, group, q_len, kv_len, qk_scale)
    else:  # dkdv's grads are (dk, dv), dq's (dq,)
        tensors, strided = (q, k, v, grad_out, *grads, lse, delta), (q, k, v, grad_out, *grads)
        heads = (q_heads, kv_heads, group) if kernel == "dkdv" else (q_heads, group)
        scalars = (*heads, q_len, kv_len, qk_scale, softmax_scale)
    strides = [stride for t in strided for stride in _strides(t)]
    return (*tensors, doc_start, doc_end, *strides, *scalars), meta


def forward(q, k, v, causal: bool, softmax_scale: float, document_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, q_heads, q_len, _ = q.shape
    out = new_like_layout(batch, q_heads, q_len, v.shape[3], q)
    lse = q.new_empty((batch, q_heads, q_len), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    _check_runnable(q)
    documents = document_bounds(document_ids) if document_ids is not None else None
    args, meta = kernel_args("fwd", q, k, v, out, lse, causal, softmax_scale, documents=documents)
    _launch("fwd", q.device, q_len, batch * q_heads, *args, **meta)
    return out, lse


def backward(grad_out, q, k, v, out, lse, causal: bool, softmax_scale: float, document_ids=None):
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    dq = new_like_layout(batch, q_heads, q_len, head_dim, q)
    dk = new_like_layout(batch, kv_heads, kv_len, head_dim, k)
    dv = new_like_layout(batch, kv_heads, kv_len, v.shape[3], v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _check_runnable(q)
    delta = torch.empty_like(lse)
    common = dict(grad_out=grad_out, delta=delta)
    args, meta = kernel_args("delta", q, k, v, out, lse, causal, softmax_scale, **common)
    block_m = 32 if interpreting() else DELTA_BLOCK_M
    warps = 4 if interpreting() else DELTA_WARPS.get(device_arch(q.device), 4)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kernel_fn("delta")[(triton.cdiv(q_len, block_m), batch * q_heads)](
            *args, **meta, BLOCK_M=block_m, num_warps=warps
        )
    common["documents"] = document_bounds(document_ids) if document_ids is not None else None
    args, meta = kernel_args("dkdv", q, k, v, out, lse, causal, softmax_scale, **common, grads=(dk, dv))
    _launch("dkdv", q.device, kv_len, batch * kv_heads, *args, **meta)
    args, meta = kernel_args("dq", q, k, v, out, lse, causal, softmax_scale, **common, grads=(dq,))
    _launch("dq", q.device, q_len, batch * q_heads, *args, **meta)
    return dq, dk, dv
