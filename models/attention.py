"""Grouped-query attention (Llama, Qwen3, GPT with kv_heads = heads): q, k, v and o projections, optional
QK-norm per head, rotary positions; the attention itself through kernels.attention. Declared in
models/parts/gqa.py (the default attention kind)."""

import torch
from torch import nn

from trillion.kernels import attention
from trillion.models.args import ModelArgs
from trillion.models.kv_cache import LayerKV
from trillion.models.rope import apply_rope


def with_documents(document_ids: torch.Tensor | None) -> dict:
    """The keyword that hands `document_ids` on, where there are some: what takes none (a generation step, an
    `attend` swapped in by a test, an attention kind that cannot mask documents) keeps its signature."""
    return {} if document_ids is None else {"document_ids": document_ids}


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.impl = args.attention_impl
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.bias)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        # context parallelism (parallel/context_parallel.py) puts attention across sequence shards here
        self.attend = attention

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor | None, cache: LayerKV | None = None, document_ids=None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 instead of the head count: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is not None:  # generation: attend to the cached positions too (causal aligns lower right)
            k, v = cache.append(k, v)
        out = self.attend(q, k, v, impl=self.impl, causal=True, **with_documents(document_ids))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
