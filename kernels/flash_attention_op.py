"""FlashAttention-2 in Triton, as PyTorch custom ops with autograd, fake tensors and DTensor rules.

    out = flash_attention(q, k, v, causal=True, softmax_scale=None)

q is (batch, q_heads, q_len, head_dim), k (batch, kv_heads, kv_len, head_dim) and v (batch,
kv_heads, kv_len, v_head_dim); the output is (batch, q_heads, q_len, v_head_dim). v's head dim may
differ from q's and k's, as in latent attention (DeepSeek-V3, Kimi K2: 192 and 128). q_heads is a
multiple of kv_heads (grouped-query and multi-query attention read the shared K/V head,
never a repeated copy). Input strides are arbitrary; the output (and dq, dk, dv) is laid out as
(batch, seq, heads, head_dim) in memory, viewed as (batch, heads, seq, head_dim), so a model's
`out.transpose(1, 2).reshape(batch, seq, -1)` is free. dtype fp16, bf16 or fp32 (fp32 with IEEE
fp32 dot products, not TF32); head dims up to 256 (each padded inside the kernel to the next power
of two, at least 16, and masked; the configs are those of the larger padded head dim).

Causal masking with q_len != kv_len is aligned to the lower right, as PyTorch's
`torch.nn.attention.bias.causal_lower_right` and FlashAttention >= 2.1: the last query sees every
key, query i sees keys j <= i + kv_len - q_len. When q_len > kv_len the first q_len - kv_len
queries see no key; their output and gradients are zero (as SDPA's math backend gives).

The kernels live in _flash_attention_kernels.py, the config sets per GPU architecture in
flash_attention_configs.py.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton

from trillion.kernels._triton_setup import device_arch, interpreting, next_power_of_2, unavailable_reason
from trillion.kernels.flash_attention_configs import configs

__all__ = ["flash_attention", "reference_attention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
DELTA_BLOCK_M = 64
_KERNEL_NAMES = {"fwd": "attn_fwd", "dkdv": "attn_bwd_dkdv", "dq": "attn_bwd_dq", "delta": "attn_bwd_delta"}


# ----------------------------------------------------------------------------- tuning and launch


def kernel_fn(name: str):
    # Imported on first use, not with this module: Triton decides between compiling and
    # interpreting when a kernel is defined, and TRITON_INTERPRET may be set after start-up
    # (by a test's conftest) but before the first call.
    from trillion.kernels import _flash_attention_kernels

    return getattr(_flash_attention_kernels, _KERNEL_NAMES[name])


@functools.cache
def _tuned(kernel: str, arch: str, block_d: int, block_dv: int):
    return triton.autotune(
        configs(kernel, arch, block_d, block_dv), key=["HEAD_DIM", "V_DIM", "IS_CAUSAL", "q_len", "kv_len"]
    )(kernel_fn(kernel))


def _launch(kernel: str, device: torch.device, grid_rows: int, grid_cols: int, *args, **meta):
    """Launch `kernel` with the device's tuned configs, or the interpreter's fixed one.

    The grid's first axis tiles `grid_rows` by the chosen config's block (BLOCK_M for the
    forward and dQ, BLOCK_N for dK/dV)."""
    tile = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
    dims = meta["BLOCK_D"], meta["BLOCK_DV"]
    if interpreting():
        (config,) = configs(kernel, "interpreter", *dims)
        kernel_fn(kernel)[(triton.cdiv(grid_rows, config.kwargs[tile]), grid_cols)](*args, **meta, **config.kwargs)
        return
    fn = _tuned(kernel, device_arch(device), *dims)
    with torch.cuda.device(device):
        fn[lambda cfg: (triton.cdiv(grid_rows, cfg[tile]), grid_cols)](*args, **meta)


# ----------------------------------------------------------------------------- launchers
def _new_like_layout(batch: int, heads: int, seq: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    # (batch, seq, heads, head_dim) in memory: what models produce from a (batch, seq, dim)
    # projection and reshape back to, so neither side needs a copy.
    return like.new_empty((batch, seq, heads, head_dim)).transpose(1, 2)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _check_runnable(t: torch.Tensor) -> None:
    reason = unavailable_reason(t.device)
    if reason is not None:
        raise RuntimeError(f"flash_attention cannot run: {reason}")


def block_d_for(head_dim: int) -> int:
    """The head dim padded to the kernels' tile: the next power of two, at least 16."""
    return max(16, next_power_of_2(head_dim))


def kernel_args(
    kernel: str, q, k, v, out, lse, causal: bool, softmax_scale: float, *, grad_out=None, delta=None, grads=None
) -> tuple[tuple, dict]:
    """(positional arguments, constexprs) of one launch of `kernel` ("fwd", "delta", "dkdv", "dq"),
    block sizes excluded. The launchers below and the ahead-of-time report (kernels/report.py) both
    build their launches here, so the report compiles exactly the specialization that runs."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len, v_dim = k.shape[1], k.shape[2], v.shape[3]
    if kernel == "delta":  # rowsum(dO * O), both of v's head dim
        meta = dict(HEAD_DIM=v_dim, BLOCK_D=block_d_for(v_dim))
        return (out, grad_out, delta, *_strides(out), *_strides(grad_out), q_heads, q_len), meta
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d_for(head_dim), V_DIM=v_dim, BLOCK_DV=block_d_for(v_dim))
    meta["IS_CAUSAL"] = causal
    group, qk_scale = q_heads // kv_heads, softmax_scale * _LOG2E
    qkv_strides = (*_strides(q), *_strides(k), *_strides(v))
    if kernel == "fwd":
        return (q, k, v, out, lse, *qkv_strides, *_strides(out), q_heads, group, q_len, kv_len, qk_scale), meta
    if kernel == "dkdv":
        dk, dv = grads
        return (
            q,
            k,
            v,
            grad_out,
            dk,
            dv,
            lse,
            delta,
            *qkv_strides,
            *_strides(grad_out),
            *_strides(dk),
            *_strides(dv),
            q_heads,
            kv_heads,
            group,
            q_len,
            kv_len,
            qk_scale,
            softmax_scale,
        ), meta
    (dq,) = grads
    return (
        q,
        k,
        v,
        grad_out,
        dq,
        lse,
        delta,
        *qkv_strides,
        *_strides(grad_out),
        *_strides(dq),
        q_heads,
        group,
        q_len,
        kv_len,
        qk_scale,
        softmax_scale,
    ), meta


def _forward(q, k, v, causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    batch, q_heads, q_len, _ = q.shape
    out = _new_like_layout(batch, q_heads, q_len, v.shape[3], q)
    lse = q.new_empty((batch, q_heads, q_len), dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    _check_runnable(q)
    args, meta = kernel_args("fwd", q, k, v, out, lse, causal, softmax_scale)
    _launch("fwd", q.device, q_len, batch * q_heads, *args, **meta)
    return out, lse


def _backward(grad_out, q, k, v, out, lse, causal: bool, softmax_scale: float):
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    dq = _new_like_layout(batch, q_heads, q_len, head_dim, q)
    dk = _new_like_layout(batch, kv_heads, kv_len, head_dim, k)
    dv = _new_like_layout(batch, kv_heads, kv_len, v.shape[3], v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _check_runnable(q)
    delta = torch.empty_like(lse)
    common = dict(grad_out=grad_out, delta=delta)
    args, meta = kernel_args("delta", q, k, v, out, lse, causal, softmax_scale, **common)
    block_m = 32 if interpreting() else DELTA_BLOCK_M
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        kernel_fn("delta")[(triton.cdiv(q_len, block_m), batch * q_heads)](*args, **meta, BLOCK_M=block_m)
    args, meta = kernel_args("dkdv", q, k, v, out, lse, causal, softmax_scale, **common, grads=(dk, dv))
    _launch("dkdv", q.device, kv_len, batch * kv_heads, *args, **meta)
    args, meta = kernel_args("dq", q, k, v, out, lse, causal, softmax_scale, **common, grads=(dq,))
    _launch("dq", q.device, q_len, batch * q_heads, *args, **meta)
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("trillion::flash_attn_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, softmax_scale)


@_fwd_op.register_fake
def _(q, k, v, causal, softmax_scale):
    batch, heads, q_len, _ = q.shape
    return (
        _new_like_layout(batch, heads, q_len, v.shape[3], q),
        q.new_empty((batch, heads, q_len), dtype=torch.float32),
    )


@torch.library.custom_op("trillion::flash_attn_bwd", mutates_args=())
def _bwd_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad_out, q, k, v, out, lse, causal, softmax_scale)


@_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse, causal, softmax_scale):
    return (_new_like_layout(*q.shape, q), _new_like_layout(*k.shape, k), _new_like_layout(*v.shape, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(grad_out, q, k, v, out, lse, ctx.causal, ctx.softmax_scale)
    return dq, dk, dv, None, None


_fwd_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _register_dtensor_sharding() -> None:
    """Attention is local per batch element and per head: with heads (tensor parallel) or batch
    sharded on every input, each rank runs the op on its shard. Multi-query attention under head
    sharding keeps its single K/V head replicated, and its dK/dV come back as partial sums."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.trillion.flash_attn_fwd.default)
    def _fwd_sharding(q, k, v, causal, softmax_scale):
        rules = [([p, p], [p, p, p, None, None]) for p in (Replicate(), Shard(0), Shard(1))]
        if k.shape[1] == 1:
            rules.append(([Shard(1), Shard(1)], [Shard(1), Replicate(), Replicate(), None, None]))
        return rules

    @register_sharding(torch.ops.trillion.flash_attn_bwd.default)
    def _bwd_sharding(grad_out, q, k, v, out, lse, causal, softmax_scale):
        rules = [([p, p, p], [p, p, p, p, p, p, None, None]) for p in (Replicate(), Shard(0), Shard(1))]
        if k.shape[1] == 1:
            s, r = Shard(1), Replicate()
            rules.append(([s, Partial(), Partial()], [s, s, r, r, s, s, None, None]))
        return rules


_register_dtensor_sharding()


# ----------------------------------------------------------------------------- public API
def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, softmax_scale: float | None = None
) -> torch.Tensor:
    """softmax(q @ k^T * softmax_scale [+ causal mask]) @ v, shapes and alignment as in the module
    docstring. softmax_scale defaults to 1/sqrt(head_dim) of q and k."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"flash_attention takes 4-d (batch, heads, seq, head_dim) tensors, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"flash_attention: k and v must share batch, heads and length, k q's batch and head_dim; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"flash_attention: q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(
            f"flash_attention needs q, k, v of one dtype among fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (0 < q.shape[3] <= MAX_HEAD_DIM and 0 < v.shape[3] <= MAX_HEAD_DIM):
        raise ValueError(
            f"flash_attention supports head_dim 1..{MAX_HEAD_DIM}, got {q.shape[3]} for q/k and {v.shape[3]} for v"
        )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[3])
    out, _ = _fwd_op(q, k, v, causal, float(softmax_scale))
    return out


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, softmax_scale: float | None = None
) -> torch.Tensor:
    """Plain PyTorch attention with the same semantics (lower-right causal alignment, zero output
    for queries that see no key), computed in the inputs' dtype. It is the test oracle (in
    float64) and the "same-precision PyTorch math" that tolerances are measured against."""
    q_heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[3])
    group = q_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * softmax_scale
    if causal:
        rows = torch.arange(q_len, device=q.device)[:, None]
        cols = torch.arange(kv_len, device=q.device)[None, :]
        visible = cols <= rows + (kv_len - q_len)
        seen = visible.any(dim=1, keepdim=True)
        # Rows that see nothing get a harmless uniform softmax, then are zeroed; filling them
        # with -inf would make NaN values and NaN gradients.
        scores = scores.masked_fill(~visible & seen, float("-inf"))
        return (scores.softmax(dim=-1) * seen) @ v
    return scores.softmax(dim=-1) @ v
