"""FlashAttention-2 in Triton, as PyTorch custom ops with autograd, fake tensors and DTensor rules.

    out = flash_attention(q, k, v, causal=True, softmax_scale=None, document_ids=None)

q is (batch, q_heads, q_len, head_dim), k (batch, kv_heads, kv_len, head_dim) and v (batch,
kv_heads, kv_len, v_head_dim); the output is (batch, q_heads, q_len, v_head_dim). v's head dim may
differ from q's and k's, as in latent attention (DeepSeek-V3, Kimi K2: 192 and 128). q_heads is a
multiple of kv_heads (grouped-query and multi-query attention read the shared K/V head,
never a repeated copy). Input strides are arbitrary; the output (and dq, dk, dv) is laid out as
(batch, seq, heads, head_dim) in memory, viewed as (batch, heads, seq, head_dim), so a model's
`out.transpose(1, 2).reshape(batch, seq, -1)` is free. dtype fp16, bf16 or fp32 (fp32 with IEEE
fp32 dot products, not TF32); head dims up to 256, each padded inside the kernel to a power of two (at
least 16) and masked, except a q/k head dim that two powers of two cover with less padding: latent
attention's 192 runs as 128 + 64, two dot products per tile, not as 256 (`block_dims_for`). The configs
are those of the q/k width so run and v's padded head dim (latent attention's 192/128 has its own).

Causal masking with q_len != kv_len is aligned to the lower right, as PyTorch's
`torch.nn.attention.bias.causal_lower_right` and FlashAttention >= 2.1: the last query sees every
key, query i sees keys j <= i + kv_len - q_len. When q_len > kv_len the first q_len - kv_len
queries see no key; their output and gradients are zero (as SDPA's math backend gives).

Document masking: `document_ids` (batch, kv_len) of integers, non-decreasing along each row, marks the
documents packed into each sequence; a query sees a key only when both have the same id (and, causal,
the key is not later). Queries are the last q_len positions (the causal alignment), so q_len <= kv_len.
Tiles whose query and key blocks share no document are skipped before any work: the attention costs
the sum of the documents' squared lengths, not the sequence's. None is the kernel without any of it.

The kernels live in _flash_attention_kernels.py and _flash_attention_dkdv_kernel.py, their launches in
flash_attention_launch.py, the config sets per GPU architecture in flash_attention_configs.py.
"""

from __future__ import annotations

import math

import torch

from trillion.kernels.flash_attention_launch import backward, forward, new_like_layout

__all__ = ["flash_attention", "reference_attention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------- custom ops
@torch.library.custom_op("trillion::flash_attn_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, causal, softmax_scale, document_ids)


@_fwd_op.register_fake
def _(q, k, v, causal, softmax_scale, document_ids=None):
    batch, heads, q_len, _ = q.shape
    return (
        new_like_layout(batch, heads, q_len, v.shape[3], q),
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
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(grad_out, q, k, v, out, lse, causal, softmax_scale, document_ids)


@_bwd_op.register_fake
def _(grad_out, q, k, v, out, lse, causal, softmax_scale, document_ids=None):
    return (new_like_layout(*q.shape, q), new_like_layout(*k.shape, k), new_like_layout(*v.shape, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, document_ids = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, document_ids)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, document_ids = ctx.saved_tensors
    dq, dk, dv = _bwd_op(grad_out, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, document_ids)
    return dq, dk, dv, None, None, None


_fwd_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _register_dtensor_sharding() -> None:
    """Attention is local per batch element and per head: with heads (tensor parallel) or batch
    sharded on every input, each rank runs the op on its shard. Multi-query attention under head
    sharding keeps its single K/V head replicated, and its dK/dV come back as partial sums. Document
    ids have no head dim: replicated under head sharding, sharded with the batch."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def ids(document_ids, placement):
        return None if document_ids is None else Replicate() if placement == Shard(1) else placement

    @register_sharding(torch.ops.trillion.flash_attn_fwd.default)
    def _fwd_sharding(q, k, v, causal, softmax_scale, document_ids=None):
        rules = [([p, p], [p, p, p, None, None, ids(document_ids, p)]) for p in (Replicate(), Shard(0), Shard(1))]
        if k.shape[1] == 1:
            s, r = Shard(1), Replicate()
            rules.append(([s, s], [s, r, r, None, None, ids(document_ids, s)]))
        return rules

    @register_sharding(torch.ops.trillion.flash_attn_bwd.default)
    def _bwd_sharding(grad_out, q, k, v, out, lse, causal, softmax_scale, document_ids=None):
        rules = [
            ([p, p, p], [p, p, p, p, p, p, None, None, ids(document_ids, p)]) for p in (Replicate(), Shard(0), Shard(1))
        ]
        if k.shape[1] == 1:
            s, r = Shard(1), Replicate()
            rules.append(([s, Partial(), Partial()], [s, s, r, r, s, s, None, None, ids(document_ids, s)]))
        return rules


_register_dtensor_sharding()


# ----------------------------------------------------------------------------- public API
def check_document_ids(document_ids: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    """ValueError unless `document_ids` fits q and k: (batch, kv_len) integers, q_len <= kv_len, on their device,
    non-decreasing along each row (checked where that costs no device synchronization: a tensor on the CPU,
    outside torch.compile; on a GPU each run of equal ids is then one document)."""
    expected = (k.shape[0], k.shape[2])
    if document_ids.dim() != 2 or tuple(document_ids.shape) != expected:
        raise ValueError(
            f"flash_attention: document_ids must be (batch, kv_len) = {expected}, got {tuple(document_ids.shape)}"
        )
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise ValueError(f"flash_attention: document_ids must hold integers, got {document_ids.dtype}")
    if document_ids.device != q.device:
        raise ValueError(f"flash_attention: document_ids is on {document_ids.device}, q on {q.device}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(
            f"flash_attention: document_ids needs q_len <= kv_len (queries are the last q_len positions), "
            f"got {q.shape[2]} > {k.shape[2]}"
        )
    plain = not torch.compiler.is_compiling() and type(document_ids) is torch.Tensor
    if plain and document_ids.device.type == "cpu" and (document_ids[:, 1:] < document_ids[:, :-1]).any():
        row, at = (document_ids[:, 1:] < document_ids[:, :-1]).nonzero()[0].tolist()
        raise ValueError(
            f"flash_attention: document_ids must be non-decreasing along each row; row {row} goes from "
            f"{document_ids[row, at].item()} to {document_ids[row, at + 1].item()} at position {at + 1}"
        )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q @ k^T * softmax_scale [+ causal mask] [+ document mask]) @ v, shapes, alignment and documents
    as in the module docstring. softmax_scale defaults to 1/sqrt(head_dim) of q and k."""
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
    if document_ids is not None:
        check_document_ids(document_ids, q, k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[3])
    if document_ids is None:  # the op's schema as it was, for callers (and traces) without documents
        out, _ = _fwd_op(q, k, v, causal, float(softmax_scale))
    else:
        out, _ = _fwd_op(q, k, v, causal, float(softmax_scale), document_ids)
    return out


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch attention with the same semantics (lower-right causal alignment, zero output
    for queries that see no key, documents), computed in the inputs' dtype. It is the test oracle (in
    float64) and the "same-precision PyTorch math" that tolerances are measured against."""
    q_heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[3])
    group = q_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * softmax_scale
    rows = torch.arange(q_len, device=q.device)[:, None]
    cols = torch.arange(kv_len, device=q.device)[None, :]
    visible = cols <= rows + (kv_len - q_len) if causal else cols >= 0  # without causality: every key
    if document_ids is not None:
        visible = visible & (document_ids[:, None, kv_len - q_len :, None] == document_ids[:, None, None, :])
    if not causal and document_ids is None:
        return scores.softmax(dim=-1) @ v
    seen = visible.any(dim=-1, keepdim=True)
    # Rows that see nothing get a harmless uniform softmax, then are zeroed; filling them
    # with -inf would make NaN values and NaN gradients.
    scores = scores.masked_fill(~visible & seen, float("-inf"))
    return (scores.softmax(dim=-1) * seen) @ v
