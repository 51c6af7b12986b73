"""One entry point for scaled-dot-product attention, so the model never names a backend.

Every backend takes `document_ids` (batch, kv_len), non-decreasing per row: a query then sees only keys
of its own document (kernels/flash_attention_op.py). The Triton kernel skips the other documents' tiles;
eager and SDPA mask the score matrix with the block-diagonal (causal) mask, which SDPA hands to a
backend that takes an explicit mask (memory-efficient or math attention, not flash)."""

import math

import torch
import torch.nn.functional as F

from trillion.kernels._triton_setup import has_triton, use_triton

ATTENTION_IMPLS = ("sdpa", "eager", "triton")


def visible_keys(q_len: int, kv_len: int, causal: bool, document_ids, device) -> torch.Tensor | None:
    """The (q_len, kv_len) or, with documents, (batch, 1, q_len, kv_len) mask of the keys each query sees
    (causal: aligned to the lower right; documents: queries are the last q_len positions), or None for all."""
    keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len) if causal else None
    if document_ids is None:
        return keep
    same = document_ids[:, None, kv_len - q_len :, None] == document_ids[:, None, None, :]
    return same if keep is None else same & keep


def eager_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None, document_ids=None):
    """Plain PyTorch reference: materializes the score matrix. q (b, hq, sq, d), k (b, hkv, sk, d),
    v (b, hkv, sk, dv): v's head dim may differ from q's and k's (latent attention: 192 and 128).

    With sq != sk the causal mask is aligned to the lower right (query i sees keys up to
    i + sk - sq), as in torch.nn.attention.bias.causal_lower_right.
    """
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    keep = visible_keys(q.shape[-2], k.shape[-2], causal, document_ids, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    # A query that sees no key (causal, q_len > kv_len) gets zeros, as SDPA and the Triton kernel give.
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(probs, v)


def sdpa_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None, document_ids=None):
    if q.shape[-2] != k.shape[-2] and causal and document_ids is None:
        # SDPA's is_causal aligns top-left; lower-right is what a decoder with a KV prefix needs.
        return eager_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    gqa = q.shape[1] != k.shape[1]
    if document_ids is not None:  # each query sees at least itself: no row is all masked
        mask = visible_keys(q.shape[-2], k.shape[-2], causal, document_ids, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=gqa)


def triton_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None, document_ids=None):
    """Our Triton FlashAttention-2 (kernels/flash_attention_op.py); SDPA where Triton cannot run,
    with the reason logged once."""
    if not use_triton("kernels.attention=triton", q.device.type):
        return sdpa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, document_ids=document_ids)
    return flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, document_ids=document_ids)


if has_triton():
    from trillion.kernels.flash_attention_op import flash_attention
else:

    def flash_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None, document_ids=None):
        raise RuntimeError("flash_attention needs the triton package (pip install triton), which is not installed")


# Attention ops whose outputs op-level activation checkpointing keeps (with SDPA's own), so that
# selective:op never recomputes our attention: its output and log-sum-exp are all the backward needs.
SAVED_ATTENTION_OPS = (torch.ops.trillion.flash_attn_fwd.default,) if has_triton() else ()

_IMPLS = {"sdpa": sdpa_attention, "eager": eager_attention, "triton": triton_attention}


def attention(
    q, k, v, *, impl: str = "sdpa", causal: bool = True, softmax_scale: float | None = None, document_ids=None
):
    """Attention of q (batch, q_heads, q_len, head_dim) over k (batch, kv_heads, kv_len, head_dim) and
    v (batch, kv_heads, kv_len, v_head_dim); the output is (batch, q_heads, q_len, v_head_dim). With
    `document_ids` (batch, kv_len), within each document only (the module docstring)."""
    return _IMPLS[impl](q, k, v, causal=causal, softmax_scale=softmax_scale, document_ids=document_ids)
